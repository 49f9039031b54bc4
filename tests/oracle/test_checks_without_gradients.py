"""What the oracle holds where gradients are not what decides: outputs-only and forward-only cases are held to the
regrouped reference (vdpcp.oracle.compare.regrouped) and to a stated plan as a case with gradients is, and the units of rounding
allowed for the gradients of an output computed after the gather are never allowed its outputs.

Each subject is right but for one thing, too small or too far from gradients for any other check to see it.
"""

from dataclasses import replace

import pytest
import torch.distributed as dist

from tests.oracle.subjects import ForwardOnly, _sharded_with, plain_all_gather
from vdpcp.contract.protocol import check_group
from vdpcp.feature.comm import gather_features
from vdpcp.impls.reference import Reference
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged
from vdpcp.matrix.scenarios import SCENARIOS

SPECS = {s.spec.name: s.spec for s in SCENARIOS}
HERE = "tests.oracle.test_checks_without_gradients"


def _last_rank_off(gather, eps: float):
    """``gather`` of each rank's projected rows, the last CP rank's x (1 + eps) first: every rank's gathered copy
    is then the same bits, and only that rank's own rows differ from an unsharded encode of them."""
    def gathered(local, counts, group):
        last = dist.get_rank(group) == dist.get_world_size(group) - 1
        return gather(local * (1 + eps) if last else local, counts, group)

    return gathered


class OwnRowsOff(Reference):
    """The reference whose last CP rank's own rows are 1e-9 (relative) off: inside float64's assert_close tolerance
    (rtol 1e-7), so the whole-microbatch comparison passes them and only the regrouped reference tells."""

    name = "own-rows-off"
    splits = ("count",)
    eps = 1e-9
    gather = staticmethod(gather_features)

    def encode_sharded(self, model, batch, config, group):
        check_group(config, dist.get_world_size(group), self.name)
        if not config.shard_vision:
            return self.encode(model, batch)
        return _sharded_with(model, batch, config, group, _last_rank_off(self.gather, self.eps))


class ForwardOnlyRowsOff(OwnRowsOff):
    """OwnRowsOff as an inference engine's tower: a gather with no autograd, declared forward-only."""

    name = "forward-only-rows-off"
    forward_only = True
    gather = staticmethod(plain_all_gather)


class DerivedRowsOff(OwnRowsOff):
    """Two outputs, the second computed from the first after the gather (as subjects.TwoOutputs), the last CP rank's
    rows 2**-51 (relative) off: two to four units of float64's rounding, under the 16 (vdpcp.oracle.compare.regrouped.EXTRA_ROWS_ULPS)
    its gradients are allowed, which a correct run's outputs never need."""

    name = "derived-rows-off"
    eps = 2.0**-51

    def encode(self, model, batch):
        return self._with_derived(super().encode(model, batch))

    def encode_sharded(self, model, batch, config, group):
        if not config.shard_vision:
            return self.encode(model, batch)
        return self._with_derived(super().encode_sharded(model, batch, config, group))

    @staticmethod
    def _with_derived(features):
        return {"features": features, "deepstack0": features.tanh()}


class ForwardOnlyStalePlan(ForwardOnly):
    """Forward-only; shards as the packed split does but states the count plan (as subjects.StalePlan)."""

    name = "forward-only-stale-plan"

    def encode_sharded(self, model, batch, config, group):
        return super().encode_sharded(model, batch, replace(config, strategy="packed"), group)


own_rows_off = OwnRowsOff()
forward_only_rows_off = ForwardOnlyRowsOff()
derived_rows_off = DerivedRowsOff()
forward_only_stale_plan = ForwardOnlyStalePlan()


def _judge(target: str, spec: str, **case):
    return run_judged(Case(SPECS[spec], 2, target, **case))


@pytest.mark.distributed
@pytest.mark.parametrize("target, changes", [(f"{HERE}:own_rows_off", dict(grads=False)),
                                             (f"{HERE}:forward_only_rows_off", {})],
                         ids=["outputs-only", "forward-only"])
def test_outputs_a_hair_off_on_one_rank_fail_the_exact_check_without_gradients(target, changes):
    judged = _judge(target, "eight-equal", **changes)
    assert judged.verdict == "fail", judged.result.summary()
    failures = judged.result.failures
    assert failures and all("exact (regrouped): outputs of rank 1 (CP rank 1)'s own rows" in f and "(expected bitwise)"
                            in f for f in failures), failures  # assert_close absorbed it; rank 0 is right


@pytest.mark.distributed
@pytest.mark.parametrize("target, changes", [("tests.oracle.subjects:stale_plan", dict(grads=False)),
                                             (f"{HERE}:forward_only_stale_plan", {})],
                         ids=["outputs-only", "forward-only"])
def test_a_stated_plan_that_execution_contradicts_is_a_plan_mismatch_without_gradients(target, changes):
    judged = _judge(target, "eleven-images", **changes)
    assert judged.verdict == "plan-mismatch", judged.result.summary()
    messages = judged.result.failures
    assert messages and all("plan mismatch" in m for m in messages), messages
    assert "encoded on rank" in messages[0] and "the plan says rank" in messages[0], messages[0]


@pytest.mark.distributed
def test_outputs_computed_after_the_gather_are_held_bitwise_though_their_gradients_get_units_of_rounding():
    judged = _judge(f"{HERE}:derived_rows_off", "eight-equal")
    assert judged.verdict == "fail", judged.result.summary()
    failures = judged.result.failures
    said = [f"rank 1: exact (regrouped): outputs {name!r} of rank 1 (CP rank 1)'s own rows [4, 5, 6, 7] differ"
            for name in ("features", "deepstack0")]
    assert len(failures) == 2 and all(f.startswith(s) for f, s in zip(failures, said)), failures
    assert all("(expected bitwise)" in f for f in failures), failures  # the gradients' 16 units are not the outputs'
    exact = [r.exact for r in judged.result.ranks]
    assert "within 16 units of rounding" in exact[1] and "'deepstack0' is computed from 'features'" in exact[1], exact
