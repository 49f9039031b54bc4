"""A configured context_parallel_size that disagrees with the process group raises the documented error on
every rank, for the reference and for the MCore adapter, before any collective: nothing hangs."""

import pytest

from vdpcp import scenarios
from vdpcp.runner import run_case

CASES = [case for case in scenarios.matrix() if scenarios.expects_group_error(case)]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_mismatch_raises_the_documented_error_on_every_rank(case):
    result = run_case(case)
    assert result.error is not None, f"expected every rank to raise, but:\n{result.summary()}"
    problems = scenarios.group_error_problems(case, result.error)
    assert not problems, "; ".join(problems) + "\n" + result.error
