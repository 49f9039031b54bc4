"""The Bridge adapter (vdpcp.impls.bridge) leaves nothing of a case on the model: a model reused for the next case
(the rank's cache, vdpcp.model_cache) is copied for the exact run below float64, and a ProcessGroup left on it
cannot be copied (measured on the H200: every nemotron-omni case after the first on a worker errored)."""

import pytest

from vdpcp.case import Case
from vdpcp.impls.nemotron_omni import SIZES
from vdpcp.runner import run_judged
from vdpcp.spec import MicrobatchSpec

P = SIZES["toy"].patch
SPEC = MicrobatchSpec(((4 * P, 4 * P), (2 * P, 4 * P), (4 * P, 2 * P)), patch_dim=P, seed=2, name="three-even")


@pytest.mark.parametrize("loss", ["rank", "zigzag"])  # the second runs on the model the first left in the cache
def test_a_bf16_case_passes_on_the_model_the_case_before_it_used(loss):
    judged = run_judged(Case(SPEC, 2, "nemotron-omni", loss=loss, dtype="bfloat16"), backend="gloo")
    assert judged.verdict == "pass", judged.result.summary()
