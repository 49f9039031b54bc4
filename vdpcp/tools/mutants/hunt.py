"""Hunting a mutant: run cases with it applied until one kills it, judged as the matrix judges them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vdpcp.matrix.runner import run_judged
from vdpcp.tools.mutants import NOT_APPLICABLE


@dataclass
class Hunt:
    """What running a mutant against cases found: the first case that killed it, and every case tried."""

    mutant: str
    killed_by: str | None = None
    verdict: str = ""  # the killing case's verdict (fail or error) and why
    tried: list[str] = field(default_factory=list)
    not_applicable: str | None = None  # why the implementation has nothing this mutant changes

    @property
    def killed(self) -> bool:
        return self.killed_by is not None

    @property
    def survived(self) -> bool:
        return not self.killed and self.not_applicable is None


def hunt(name: str, cases, backend: str | None = None, timeout: float | None = None, on_case=None) -> Hunt:
    """Run ``cases`` (un-mutated) with mutant ``name`` applied, stopping at the first kill.

    A case kills the mutant when its verdict is not passing (an expected xfail that fails the expected way
    does not count), but not when a rank ran out of memory, which says nothing about the mutant; a mutant that
    says it does not apply to the implementation stops the hunt as such.
    ``on_case(case, judged, seconds)`` is called after each (a vdpcp.matrix.runner.Judged).
    """
    found = Hunt(name)
    for case in cases:
        started = time.monotonic()
        judged = run_judged(case.with_(mutant=name), backend=backend, timeout=timeout)
        found.tried.append(case.id)
        if on_case is not None:
            on_case(case, judged, time.monotonic() - started)
        error = judged.result.error or ""
        if NOT_APPLICABLE in error:  # every rank said so: the implementation lacks what the mutant changes
            found.not_applicable = error[error.index(NOT_APPLICABLE):].splitlines()[0]
            break
        if not judged.passing and judged.verdict != "resource":
            found.killed_by = case.id
            found.verdict = f"{judged.verdict}: {judged.why or _first_failure(judged.result)}"
            break
    return found


def _first_failure(result) -> str:
    return (result.failures or [""])[0].splitlines()[0][:300]
