"""Hunting a mutant: run cases with it applied until one kills it, judged as the matrix judges them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vdpcp.runner import run_judged


@dataclass
class Hunt:
    """What running a mutant against cases found: the first case that killed it, and every case tried."""

    mutant: str
    killed_by: str | None = None
    verdict: str = ""  # the killing case's verdict (fail or error) and why
    tried: list[str] = field(default_factory=list)

    @property
    def killed(self) -> bool:
        return self.killed_by is not None


def hunt(name: str, cases, backend: str | None = None, timeout: float | None = None, on_case=None) -> Hunt:
    """Run ``cases`` (un-mutated) with mutant ``name`` applied, stopping at the first kill.

    A case kills the mutant when its verdict is not passing (an expected xfail that fails the expected way
    does not count). ``on_case(case, judged, seconds)`` is called after each (a vdpcp.runner.Judged).
    """
    found = Hunt(name)
    for case in cases:
        started = time.monotonic()
        judged = run_judged(case.with_(mutant=name), backend=backend, timeout=timeout)
        found.tried.append(case.id)
        if on_case is not None:
            on_case(case, judged, time.monotonic() - started)
        if not judged.passing:
            found.killed_by = case.id
            found.verdict = f"{judged.verdict}: {judged.why or _first_failure(judged.result)}"
            break
    return found


def _first_failure(result) -> str:
    return (result.failures or [""])[0].splitlines()[0][:300]
