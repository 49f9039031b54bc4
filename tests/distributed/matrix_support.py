"""What the matrix tests share: the backend a case runs on here, and pytest params with its expectation."""

from __future__ import annotations

import pytest

from vdpcp import scenarios
from vdpcp.case import Case
from vdpcp.harness import BackendUnavailable
from vdpcp.harness.config import resolve_backend
from vdpcp.runner import CaseResult, run_case


class KnownUpstreamLimit(AssertionError):
    """A case failed exactly the way a known upstream limit says it must (a strict xfail's expected outcome)."""


def backend_for(case: Case) -> str:
    """The backend the harness picks for this case here; forced NCCL without GPUs skips, so call it nccl."""
    try:
        return resolve_backend(None, case.cp)
    except BackendUnavailable:
        return "nccl"


def param(case: Case):
    """The case as a pytest param named by its id, a strict xfail where a known limit applies here."""
    limit = scenarios.known_limit(case, backend_for(case))
    marks = [pytest.mark.xfail(strict=True, raises=KnownUpstreamLimit, reason=limit.reason)] if limit else []
    return pytest.param(case, id=case.id, marks=marks)


def run(case: Case) -> CaseResult:
    """run_case, with a short fault grace where a known limit makes one rank raise while the rest wait."""
    limit = scenarios.known_limit(case, backend_for(case))
    return run_case(case, fault_grace=scenarios.KNOWN_LIMIT_GRACE_S if limit else None)


def assert_case(result: CaseResult) -> None:
    """Pass, or fail with the case's summary; a known limit that failed the known way raises KnownUpstreamLimit."""
    expected = backend_for(result.case)
    assert result.backend == expected, (
        f"the case was marked for {expected} at collection but ran on {result.backend}: a setting leaked between tests")
    verdict, why = scenarios.judge(result, result.backend)
    if verdict == "xfail":
        raise KnownUpstreamLimit(f"{why}\n{result.summary()}")
    assert verdict == "pass", f"{why}\n{result.summary()}".strip()
