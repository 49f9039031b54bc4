"""What one rank's run of a case ended in, and how the ranks' outcomes settle into one answer.

Both ways of running a case (warm workers, or in-process under torchrun) produce one Outcome per rank
and hand the list to settle(): every rank's value in rank order, or the case's skip/xfail, or a
RankFailure that tells every failing rank's story.
"""

import pickle
import sys
import traceback
from dataclasses import dataclass
from typing import Any

from vdpcp.harness.errors import RankFailure

OK, RAISED, SKIPPED, XFAILED, DIED, HUNG = "ok", "raised", "skipped", "xfailed", "died", "hung"
FAULTS = (RAISED, DIED, HUNG)


@dataclass
class Outcome:
    rank: int
    kind: str
    value: Any = None
    summary: str = ""  # one line: the exception, the skip reason, the exit code
    detail: str = ""  # the traceback or the Python stack, for the report


def capture(rank: int, call) -> Outcome:
    """Run ``call()`` and say how it ended; pytest's skip and xfail are outcomes, not failures."""
    try:
        return Outcome(rank, OK, value=call())
    except BaseException as err:  # noqa: BLE001 - a rank reports everything, even SystemExit
        kind = _pytest_outcome_kind(err)
        if kind is not None:
            return Outcome(rank, kind, summary=getattr(err, "msg", None) or str(err))
        summary = "raised " + traceback.format_exception_only(err)[-1].strip()
        detail = "".join(traceback.format_exception(type(err), err, _without_harness(err.__traceback__)))
        return Outcome(rank, RAISED, summary=summary, detail=detail)


def settle(outcomes: list[Outcome], what: str):
    """The ranks' values in rank order, or raise what the case ended in."""
    faults = [o for o in outcomes if o.kind in FAULTS]
    if faults:
        raise RankFailure(failure_report(outcomes, what), {o.rank: o.summary for o in faults})
    for kind in (SKIPPED, XFAILED):
        first = next((o for o in outcomes if o.kind == kind), None)
        if first is not None:
            import pytest

            (pytest.skip if kind == SKIPPED else pytest.xfail)(first.summary)
    return [o.value for o in outcomes]


def pickled(outcome: Outcome) -> bytes:
    """The outcome as bytes to send; a value that does not pickle makes it the rank's failure."""
    try:
        return pickle.dumps(outcome)
    except Exception as err:  # noqa: BLE001 - the value is the body's; say what was wrong with it
        return pickle.dumps(Outcome(outcome.rank, RAISED, summary=f"returned a value that cannot be pickled: {err!r}"))


def failure_report(outcomes: list[Outcome], what: str) -> str:
    faults = [o for o in outcomes if o.kind in FAULTS]
    lines = [f"{what} failed on {len(faults)} of {len(outcomes)} ranks: "
             + "; ".join(f"rank {o.rank} {o.summary}" for o in faults)]
    for o in faults:
        lines += ["", f"----- rank {o.rank}: {o.summary} -----", o.detail.rstrip() or "(nothing recorded)"]
    return "\n".join(lines)


def _without_harness(tb):
    """The traceback from the first frame that is not the harness's own (the body's, usually)."""
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_globals.get("__name__", "").startswith(__package__):
        tb = tb.tb_next
    return tb


def _pytest_outcome_kind(err: BaseException) -> str | None:
    outcomes = sys.modules.get("_pytest.outcomes")  # only a body that imported pytest can skip
    if outcomes is None:
        return None
    if isinstance(err, outcomes.XFailed):
        return XFAILED
    if isinstance(err, outcomes.Skipped):
        return SKIPPED
    return None
