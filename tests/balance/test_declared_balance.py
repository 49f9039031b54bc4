"""The balance check (vdpcp.oracle.observe.declared_balance), pure: vdpcp's own balanced and packed splits pass it on every matrix
microbatch; a contiguous partition with a cut one unit short on equal units is unbalanced; nothing declared, nothing judged."""

import pytest

from vdpcp.contract.protocol import Balance
from vdpcp.feature.plan import make_plan
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix import scenarios
from vdpcp.oracle.observe import declared_balance as load_balance

SPECS = {c.spec.name: c.spec for c in scenarios.matrix(impls=("reference",))}.values()


def _read(spec, owners: list[int], cp: int) -> list[list[bool]]:
    return [[owner == r for owner in owners] for r in range(cp)]


def _plan_read(spec, cp, strategy, cost="patches"):
    plan = make_plan(spec.images, cp, patch_dim=spec.patch_dim, num_frames=spec.num_frames,
                     temporal_patch_size=spec.temporal_patch_size, strategy=strategy, cost=cost)
    owners = [0] * len(spec.images)
    for shard in plan.shards:
        for i in range(shard.start, shard.stop):
            if plan.order[i] < len(spec.images):
                owners[plan.order[i]] = shard.rank
    return _read(spec, owners, cp)


@pytest.mark.parametrize("strategy", ["balanced", "packed"])
def test_vdpcps_own_splits_pass_under_the_objective_they_declare(strategy):
    for spec in SPECS:
        for cp in (2, 4, 8):
            for cost in ("patches", "attention"):
                read = _plan_read(spec, cp, strategy, cost)
                assert load_balance.judge(read, spec, Balance(cost, contiguous=strategy == "balanced")) is None, spec.name


def test_a_cut_one_unit_short_on_equal_units_is_unbalanced_and_the_line_names_the_rank():
    spec = MicrobatchSpec(images=((16, 16),) * 8, name="eight")
    assert load_balance.judge(_read(spec, [0] * 4 + [1] * 4, 2), spec, Balance()) is None
    why = load_balance.judge(_read(spec, [0] * 3 + [1] * 5, 2), spec, Balance())
    assert why.startswith("unbalanced: CP rank 1's tower read 5 units costing 80 (patches)"), why


def test_nothing_declared_nothing_judged():
    spec = MicrobatchSpec(images=((16, 16),) * 8, name="eight")
    assert load_balance.judge(_read(spec, [0] + [1] * 7, 2), spec, None) is None
