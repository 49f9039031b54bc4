"""The judge of a process-group mismatch (vdpcp.matrix.expectations.group_error_problems): the documented error is the
declared exception class carrying the declared text, raised by every rank of the case, every DP replica's too.

Pure: the failure text is built by hand as the harness writes it, no rank runs.
"""

import pytest

from vdpcp.contract.protocol import GROUP_MISMATCH_TEXT
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix import expectations
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import CaseResult

SPEC = MicrobatchSpec(images=((16, 16),), name="m")
DOCUMENTED = f"reference: {GROUP_MISMATCH_TEXT}: context_parallel_size=4 but the CP group has 2 ranks"


def _judged(case: Case, raised: dict[int, str]) -> tuple[str, str]:
    """The judge's verdict where rank r raised ``raised[r]`` (its class name) with the documented message."""
    headline = (f"failed on {len(raised)} of {case.world_size} ranks: "
                + "; ".join(f"rank {r} raised {kind}: {DOCUMENTED}" for r, kind in raised.items()))
    return expectations.judge(CaseResult(case, error=headline, backend="gloo"))


@pytest.mark.parametrize("kind", ["RuntimeError", "ValueError", "GroupMismatch", "NotGroupMismatchError"])
def test_the_documented_text_in_another_exception_class_is_not_the_documented_error(kind):
    case = Case(SPEC, 2, config_cp=4)
    assert _judged(case, {0: "GroupMismatchError", 1: "vdpcp.contract.protocol.GroupMismatchError"}) == (
        "pass", "the documented error on every rank")
    verdict, why = _judged(case, {0: kind, 1: kind})
    assert verdict == "fail", why
    assert why == ("rank 0 did not raise the documented GroupMismatchError; "
                   "rank 1 did not raise the documented GroupMismatchError"), why


def test_every_dp_replicas_ranks_must_raise_the_documented_error_not_the_first_replicas_alone():
    case = Case(SPEC, 2, dp=2, config_cp=4)
    assert case.world_size == 4
    assert _judged(case, dict.fromkeys(range(4), "GroupMismatchError"))[0] == "pass"
    verdict, why = _judged(case, {0: "GroupMismatchError", 1: "GroupMismatchError"})  # replica 1 raised nothing
    assert verdict == "fail", why
    assert why == ("rank 2 did not raise the documented GroupMismatchError; "
                   "rank 3 did not raise the documented GroupMismatchError"), why
    verdict, why = _judged(case, {0: "GroupMismatchError", 1: "GroupMismatchError", 2: "GroupMismatchError",
                                  3: "ValueError"})
    assert (verdict, why) == ("fail", "rank 3 did not raise the documented GroupMismatchError")
