"""The correctness matrix: every scenario of vdpcp.scenarios at CP 1, 2, 4 and 8, for the reference (count and
balanced splits) and MCore's helpers, outputs and gradients against the unsharded encoder; the zigzag loss on a
subset; opt-out at CP > 1; an empty microbatch. Known upstream limits are strict xfails (see scenarios.py)."""

import pytest

from tests.distributed.matrix_support import assert_case, param, run
from vdpcp import scenarios

CASES = [case for case in scenarios.matrix() if not scenarios.expects_group_error(case)]


@pytest.mark.distributed
@pytest.mark.parametrize("case", [param(case) for case in CASES])
def test_case(case):
    assert_case(run(case))
