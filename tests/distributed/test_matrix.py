"""The correctness matrix: every scenario of vdpcp.matrix.scenarios at CP 1, 2, 4 and 8 and in CP x DP layouts, for the
implementations of --vdpcp-impl (default: the reference's count, balanced and packed splits and MCore's helpers),
outputs, gradients and execution against the unsharded encoder; the zigzag loss on a subset; opt-out at CP > 1;
a config CP that disagrees with the process group; an empty microbatch. Known upstream limits are strict xfails."""

import pytest

from vdpcp.testing import assert_case


@pytest.mark.distributed
def test_case(vdpcp_case):
    assert_case(vdpcp_case)
