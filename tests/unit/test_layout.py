"""vdpcp.feature.layout: world = TP x CP x DP in MCore's order (held to MCore's own RankGenerator), the groups each rank
gets on real ranks, and the zigzag split of the language model's sequence."""

import pytest
import torch
import torch.distributed as dist

from vdpcp.feature import layout
from vdpcp.feature.layout import Layout, zigzag_positions

LAYOUTS = [Layout(2), Layout(4), Layout(2, 2), Layout(4, 2), Layout(2, 4), Layout(2, 1, 2), Layout(4, 1, 2),
           Layout(2, 2, 2), Layout(1, 2, 2), Layout(3, 1, 1)]


@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_groups_are_mcores_for_the_same_sizes(lay):
    from megatron.core.parallel_state import RankGenerator

    mcore = RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=1, cp=lay.cp, order="tp-cp-ep-dp-pp")
    ours_cp = sorted(lay.cp_group_ranks(d, t) for d in range(lay.dp) for t in range(lay.tp))
    ours_tp = sorted(lay.tp_group_ranks(d, c) for d in range(lay.dp) for c in range(lay.cp))
    assert ours_cp == sorted(mcore.get_ranks("cp")) and ours_tp == sorted(mcore.get_ranks("tp"))


@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_coords_name_each_rank_once_and_place_it_in_its_groups(lay):
    assert lay.world_size == lay.cp * lay.dp * lay.tp
    coords = [lay.coords(rank) for rank in range(lay.world_size)]
    assert sorted(coords) == [(t, c, d) for t in range(lay.tp) for c in range(lay.cp) for d in range(lay.dp)]
    for rank, (t, c, d) in enumerate(coords):
        assert lay.cp_group_ranks(d, t)[c] == rank and lay.tp_group_ranks(d, c)[t] == rank


def rank_groups(ctx, lay: Layout):
    groups = layout.groups(lay)
    again = layout.groups(lay)  # built once: new_group is collective, a second build would need every rank
    cp = dist.get_process_group_ranks(groups.cp) if groups.cp is not dist.group.WORLD else list(range(ctx.world_size))
    tp = dist.get_process_group_ranks(groups.tp) if groups.tp is not None else None
    seen = torch.tensor([float(ctx.rank)])
    dist.all_reduce(seen, group=groups.cp)  # the CP group really is those ranks
    return dict(cp=cp, tp=tp, coords=(groups.tp_rank, groups.cp_rank, groups.dp_rank), same=again is groups,
                cp_sum=int(seen.item()), world=groups.cp is dist.group.WORLD)


@pytest.mark.distributed
@pytest.mark.parametrize("lay", [Layout(2, 2), Layout(2, 1, 2), Layout(4), Layout(2, 2, 2)], ids=str)
def test_each_rank_gets_its_groups_of_the_layout(run_ranks, lay):
    for rank, got in enumerate(run_ranks(rank_groups, lay.world_size, lay)):
        t, c, d = lay.coords(rank)
        assert got["coords"] == (t, c, d) and got["same"]
        assert got["cp"] == lay.cp_group_ranks(d, t) and got["cp_sum"] == sum(lay.cp_group_ranks(d, t))
        assert got["tp"] == (lay.tp_group_ranks(d, c) if lay.tp > 1 else None)
        assert got["world"] == (lay.dp == lay.tp == 1)  # one CP group and nothing else: the default group itself


def wrong_world(ctx):
    try:
        layout.groups(Layout(ctx.world_size + 1))
    except ValueError as err:
        return str(err)


@pytest.mark.distributed
def test_a_layout_for_another_world_size_is_one_clear_error(run_ranks):
    assert run_ranks(wrong_world, 2) == ["layout Layout(cp=3, dp=1, tp=1) needs 3 ranks; the world has 2"] * 2


@pytest.mark.parametrize("length, cp", [(8, 2), (10, 2), (11, 4), (17, 4), (3, 2), (40, 8)])
def test_zigzag_gives_each_position_to_exactly_one_rank_chunks_r_and_its_mirror(length, cp):
    masks = torch.stack([zigzag_positions(length, cp, r) for r in range(cp)])
    assert masks.dtype == torch.bool and masks.shape == (cp, length)
    assert masks.sum(0).tolist() == [1] * length
    chunk = -(-length // (2 * cp))
    for rank in range(cp):
        expected = [p for p in range(length) if p // chunk in (rank, 2 * cp - 1 - rank)]
        assert masks[rank].nonzero().flatten().tolist() == expected
