"""bf16: the sharded encoder against the unsharded one in the precision GPUs train in.

Gradients in bf16 are compared as vectors (vdpcp.case._compare_norm): splitting a sum over tokens differently
moves single elements near cancellation, never the whole tensor, while a sharding bug moves the whole tensor.
These cases check both halves of that claim: the feature passes at bf16, and bugs are still caught at bf16.
"""

import pytest

from vdpcp.runner import run_case
from vdpcp.scenarios import matrix

BF16_CASES = ("eleven-images-cp4-reference-count", "mixed-sizes-cp4-reference-balanced",
              "video-t2-ragged-cp4-reference-balanced", "three-images-cp4-reference-count-zigzag")
BF16_KILLS = (("grad-not-summed", "eight-equal-cp2-reference-count"),
              ("grad-averaged", "eight-equal-cp2-reference-count"),
              ("gather-before-project", "eight-equal-cp2-reference-count"),
              ("replicated-loss", "eight-equal-cp2-reference-count"))


def _case(case_id):
    return next(c for c in matrix() if c.id == case_id).with_(dtype="bfloat16")


@pytest.mark.distributed
@pytest.mark.parametrize("case_id", BF16_CASES)
def test_sharded_matches_unsharded_in_bf16(case_id):
    result = run_case(_case(case_id))
    assert result.passed, result.summary()


@pytest.mark.distributed
@pytest.mark.parametrize("mutant,case_id", BF16_KILLS)
def test_gradient_bugs_are_caught_in_bf16(mutant, case_id):
    result = run_case(_case(case_id).with_(mutant=mutant))
    assert result.verdict == "fail", result.summary()
    assert any("grads" in f for f in result.failures), result.summary()
