"""Bytes on the wire of the gather, counted by hand on small plans."""

import pytest

from vdpcp.feature.datasets import generate
from vdpcp.feature.plan import make_plan
from vdpcp.feature.sharded import real_tokens
from vdpcp.tools.bench.wire import local_tokens, mcore_gather_bytes, reference_gather_bytes, wire_table

P = 16
WIDTH, ITEM = 10, 2


def plan_of(grids, cp, strategy="count"):
    return make_plan([(gh * P, gw * P) for gh, gw in grids], cp, patch_dim=P, strategy=strategy)


def test_remainder_on_the_last_rank():
    # grids 4x4, 2x2, 4x4 -> 4, 1, 4 tokens after the 2x2 pixel shuffle; count split: [4] [1, 4]
    plan = plan_of([(4, 4), (2, 2), (4, 4)], 2)
    assert local_tokens(plan) == [4, 5]
    assert mcore_gather_bytes(plan, WIDTH, ITEM).forward == 1 * 9 * WIDTH * ITEM  # each rank's shard to the other
    ref = reference_gather_bytes(plan, real_tokens(plan), WIDTH, ITEM)
    assert ref.forward == 2 * 1 * 5 * WIDTH * ITEM  # both shards padded to 5 rows, each sent to 1 rank
    assert ref.backward == 2 * 1 * 9 * WIDTH * ITEM  # ring all-reduce of the 9-row gradient


def test_placeholders_cross_the_wire_in_mcore_only():
    # one 2x2 image on 3 ranks: two 1x1 placeholders, each padded to 2x2 -> 1 token
    plan = plan_of([(2, 2)], 3)
    assert local_tokens(plan) == [1, 1, 1]
    assert real_tokens(plan) == [1, 0, 0]
    assert mcore_gather_bytes(plan, WIDTH, ITEM).forward == 2 * 3 * WIDTH * ITEM
    assert reference_gather_bytes(plan, real_tokens(plan), WIDTH, ITEM).forward == 3 * 2 * 1 * WIDTH * ITEM


def test_balanced_split_shrinks_the_padded_gather():
    spec = generate("multi-image", 0)
    count, balanced = (make_plan(spec.images, 8, patch_dim=P, strategy=s) for s in ("count", "balanced"))
    assert sum(local_tokens(count)) == sum(local_tokens(balanced))  # same features, other owners
    assert mcore_gather_bytes(count, WIDTH, ITEM) == mcore_gather_bytes(balanced, WIDTH, ITEM)
    assert reference_gather_bytes(balanced, real_tokens(balanced), WIDTH, ITEM).forward < reference_gather_bytes(
        count, real_tokens(count), WIDTH, ITEM
    ).forward


def test_projected_features_move_lm_hidden_over_4_hidden_of_the_bytes():
    table = wire_table(generate("multi-image", 0), [4], ["count"])
    ratios = {line.split("|")[1].strip(): float(line.split("|")[7]) for line in table.splitlines()[2:]}
    assert ratios["bench tower (1024 -> 2688)"] == pytest.approx(round(2688 / 4096, 3))
    assert ratios["toy tower (32 -> 48)"] == pytest.approx(round(48 / 128, 3))
