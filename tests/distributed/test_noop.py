"""CP=1 and opt-out: vision DP over CP is a no-op. The encoder path issues no collective at all, and the result
is the unsharded one exactly (the same computation, so the outputs are bitwise equal).

Counting is done in the ranks by wrapping torch.distributed's collectives; the checker's own sums
(vdpcp.feature.comm.all_reduce_sums) and MCore's group set-up are not the encoder path and are left uncounted.
A sharded case is the control: the same counter must see its gather.
"""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from vdpcp.feature import comm
from vdpcp.harness import run_ranks
from vdpcp.impls import BUILT_INS, mcore
from vdpcp.matrix import scenarios
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import rank_body

COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather", "irecv", "isend", "recv",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "send",
)


class CollectiveCounter:
    def __init__(self):
        self.calls: list[str] = []
        self.paused = 0

    def counting(self, name, fn):
        def wrapper(*args, **kwargs):
            if not self.paused:
                self.calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    def pausing(self, fn):
        def wrapper(*args, **kwargs):
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1

        return wrapper

    @contextlib.contextmanager
    def installed(self):
        originals = [(module, name, getattr(module, name)) for module in (dist, c10d) for name in COLLECTIVES
                     if hasattr(module, name)]
        originals += [(comm, "all_reduce_sums", comm.all_reduce_sums), (mcore, "ensure_parallel_state", mcore.ensure_parallel_state)]
        try:
            for module, name, fn in originals[:-2]:
                setattr(module, name, self.counting(name, fn))
            for module, name, fn in originals[-2:]:
                setattr(module, name, self.pausing(fn))
            yield self
        finally:
            for module, name, fn in originals:
                setattr(module, name, fn)


def check_counting_collectives(ctx, case: Case):
    """Rank body: the case's check, and the collectives its encoder path issued on this rank."""
    with CollectiveCounter().installed() as counter:
        result = rank_body(ctx, case)
    return result, counter.calls


def _spec(name):
    return next(s.spec for s in scenarios.SCENARIOS if s.spec.name == name)


NOOP_CASES = [Case(_spec(name), 1, impl) for name in ("three-images", "video-and-images") for impl in BUILT_INS]
NOOP_CASES += [case for case in scenarios.matrix(cps=(2, 4, 8)) if not case.vision_dp_over_cp]
CONTROLS = [Case(_spec("eight-equal"), 2, impl) for impl in BUILT_INS]  # equal token counts: runs on gloo too


@pytest.mark.distributed
@pytest.mark.parametrize("case", NOOP_CASES, ids=[case.id for case in NOOP_CASES])
def test_no_collective_and_the_unsharded_result(case):
    outcomes = run_ranks(check_counting_collectives, case.cp, case)
    for result, calls in outcomes:
        assert calls == [], f"rank {result.rank}'s encoder path issued collectives {calls}"
        assert result.ok, result.failures
        assert result.out_err == 0.0, f"rank {result.rank}: outputs differ from the unsharded ones by {result.out_err}"


@pytest.mark.distributed
@pytest.mark.parametrize("case", CONTROLS, ids=[case.id for case in CONTROLS])
def test_the_counter_sees_a_sharded_gather(case):
    outcomes = run_ranks(check_counting_collectives, case.cp, case)
    for result, calls in outcomes:
        assert result.ok, result.failures
        assert "all_gather" in calls, f"rank {result.rank}: the counter saw {calls}, not the gather"
