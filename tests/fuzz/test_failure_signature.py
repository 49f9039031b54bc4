"""`vdpcp.tools.fuzz.failing_rank`, the rank an errored case blames (what `vdpcp replay` prints and the signature
reads): the first rank that raised, else the first reported; its section of the report and no other rank's;
and, for an error with no rank sections, no rank (-1), the error's first line and the whole text."""

import pytest

from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import CaseResult
from vdpcp.tools.fuzz import failing_rank, signature

CASE = Case(MicrobatchSpec(images=((8, 8),)), 4)
HEADLINE = "vdpcp.matrix.runner.rank_body (gloo, world size 4) failed on 3 of 4 ranks: ..."


def section(rank: int, what: str, *body: str) -> str:
    """One rank's part of a harness failure report (vdpcp.harness.outcome.failure_report)."""
    return "\n".join([f"----- rank {rank}: {what} -----", *body])


HUNG = section(0, "hung: still running 3 s after rank 1 raised ValueError: bad grid 1x1",
               "Current thread (most recent call first):", '  File "comm.py", line 34 in forward')
RAISED = section(1, "raised ValueError: bad grid 1x1", "Traceback (most recent call last):", "ValueError: bad grid 1x1")
DIED = section(2, "died: exit code -9", "(nothing recorded)")
ALSO_RAISED = section(3, "raised RuntimeError: peer gone", "Traceback (most recent call last):", "RuntimeError: peer gone")


def report(*sections: str) -> str:
    return "\n\n".join([HEADLINE, *sections]) + "\n"


def errored(text: str | None) -> CaseResult:
    return CaseResult(CASE, error=text)


# (the rank sections in report order, the one to blame)
BLAMED = [
    ((HUNG, RAISED, DIED), RAISED),  # the raiser, mid-report: its section ends where the next rank's starts
    ((RAISED, HUNG, DIED), RAISED),  # the raiser, first
    ((HUNG, DIED, RAISED), RAISED),  # the raiser, last: its section runs to the end of the report
    ((HUNG, RAISED, DIED, ALSO_RAISED), RAISED),  # the first raiser, not a later one
    ((HUNG, DIED), HUNG),  # none raised: the first rank reported, not the last
    ((DIED, HUNG), DIED),
]


@pytest.mark.parametrize("sections, blamed", BLAMED, ids=["raiser-mid", "raiser-first", "raiser-last", "first-raiser",
                                                          "none-raised", "none-raised-died-first"])
def test_the_blamed_rank_is_the_first_raiser_else_the_first_reported_with_its_own_section_only(sections, blamed):
    rank, what = blamed.splitlines()[0].removeprefix("----- rank ").removesuffix(" -----").split(": ", 1)
    assert failing_rank(errored(report(*sections))) == (int(rank), what, blamed)


# an error from outside the ranks (the runner's, the harness's): it names no rank
NO_RANKS = "asked to run on nccl, but rank 1 ran on gloo\n(the case is not run on a backend it was not asked for)"


def test_an_error_with_no_rank_sections_blames_no_rank_and_says_its_first_line():
    assert failing_rank(errored(NO_RANKS)) == (-1, "asked to run on nccl, but rank 1 ran on gloo", NO_RANKS)
    assert signature(errored(NO_RANKS)) == "error: asked to run on nccl, but rank # ran on gloo"


def test_an_empty_error_is_an_unknown_error_of_no_rank():
    assert failing_rank(errored("")) == (-1, "unknown error", "")
    assert signature(errored("")) == "error: unknown error"


def test_the_signature_is_the_blamed_ranks_whatever_the_others_said():
    raised = "error: raised ValueError: bad grid #x#"
    assert {signature(errored(report(*sections))) for sections, blamed in BLAMED if blamed is RAISED} == {raised}
    assert signature(errored(report(HUNG, DIED))) == "error: hung: still running # s after rank # raised ValueError: bad grid #x#"
