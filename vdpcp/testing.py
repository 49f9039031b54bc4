"""The matrix in a test suite: pytest params, a unittest helper, and the one assertion a case needs.

pytest (vdpcp's plugin parametrizes any test that takes ``vdpcp_case`` with the matrix of ``--vdpcp-impl``,
default the built-ins)::

    def test_vision_dp_over_cp(vdpcp_case):
        assert_case(vdpcp_case)

or, for one implementation regardless of the command line::

    @pytest.mark.parametrize("case", params("my_vlm.vision_dp:impl", cps=(1, 2, 4)))
    def test_my_encoder(case):
        assert_case(case)

unittest (torch's distributed tests are unittest): one named method per case, through ``parameterized``::

    class TestMyEncoder(unittest.TestCase):
        @expand("my_vlm.vision_dp:impl", cps=(1, 2))
        def test(self, _, case):
            assert_case(case)

A known upstream limit the implementation declares is a strict xfail: in pytest an xfail mark (an
unexpected pass fails), in unittest a skip that says "xfail: ..." (an unexpected pass fails).
"""

from __future__ import annotations

import re
import sys

from vdpcp.harness.config import planned_backend
from vdpcp.matrix import expectations, scenarios
from vdpcp.matrix.case import Case


class KnownUpstreamLimit(AssertionError):
    """A case failed exactly the way a known upstream limit says it must (a strict xfail's expected outcome)."""


def backend_for(case: Case) -> str:
    """The backend the harness picks for this case here; forced NCCL without GPUs skips, so call it nccl."""
    return planned_backend(None, case.world_size)


def matrix(impl: str, cps=scenarios.CP_SIZES, **filters) -> tuple[list[Case], list[scenarios.LeftOut]]:
    """The matrix for one implementation (every scenario, layout and special row at ``cps``) as it runs here,
    and the gradient cases a known limit stops on this machine's backend, left out once a case confirms it
    (scenarios.confirm_once)."""
    return scenarios.confirm_once(scenarios.matrix(cps=tuple(cps), impls=(impl,), **filters), backend_for)


def cases(impl: str, cps=scenarios.CP_SIZES, **filters) -> list[Case]:
    return matrix(impl, cps, **filters)[0]


def param(case: Case, left_out: scenarios.LeftOut | None = None):
    """The case as a pytest param named by its id, a strict xfail where a known limit applies here; the case that
    confirms a limit for the cases left out says so in its reason."""
    import pytest

    limit = expectations.known_limit(case, backend_for(case))
    reason = limit.reason + (f" ({left_out.line()})" if left_out else "") if limit else ""
    marks = [pytest.mark.xfail(strict=True, raises=KnownUpstreamLimit, reason=reason)] if limit else []
    return pytest.param(case, id=case.id, marks=marks)


def params(impl: str, cps=scenarios.CP_SIZES, **filters) -> list:
    kept, left_out = matrix(impl, cps, **filters)
    confirming = {group.confirmed_by: group for group in left_out}
    return [param(case, confirming.get(case.id)) for case in kept]


def assert_case(case: Case) -> None:
    """Run the case and judge it: pass, or fail with its summary; a known limit that failed the known way
    raises KnownUpstreamLimit (what its strict xfail mark expects)."""
    from vdpcp.matrix.runner import CORRECT, run_judged

    expected = backend_for(case)
    judged = run_judged(case)
    result = judged.result
    assert result.backend == expected, (
        f"the case was marked for {expected} but ran on {result.backend}: a setting leaked between tests")
    if judged.verdict == "xfail":
        raise KnownUpstreamLimit(f"{judged.why}\n{result.summary()}")
    assert judged.verdict in CORRECT, f"{judged.verdict}: {judged.why}\n{result.summary()}".strip()


def expand(impl: str, cps=scenarios.CP_SIZES, **filters):
    """A ``parameterized.expand`` decorator: one unittest method per case, named ``<method>_<case id>``; the
    method receives (id, case). A known limit's expected failure is a skip saying so; its pass is a failure."""
    from parameterized import parameterized

    def name(func, _num, param):
        return f"{func.__name__}_{re.sub(r'\W', '_', param.args[0])}"

    def decorate(method):
        def run(self, case_id, case):
            try:
                method(self, case_id, case)
            except KnownUpstreamLimit as limit:
                import unittest

                raise unittest.SkipTest(f"xfail (strict): {str(limit).splitlines()[0]}") from None

        run.__name__ = method.__name__
        # parameterized adds one method per case to the namespace it is called from: here, the class body
        class_body = sys._getframe(1).f_locals
        return parameterized.expand([(c.id, c) for c in cases(impl, cps, **filters)], name_func=name,
                                    namespace=class_body)(run)

    return decorate
