"""Split plans: the count plan's rules on hand-checked examples, every plan's invariants on random microbatches,
the balanced plan's optimality against brute force over every contiguous partition, and the packed plan's
assignment (every unit once, tubelets whole, never worse than LPT or balanced)."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vdpcp.feature.plan import TOY_TOWER_ALPHA, PlanError, make_plan, mcore_gives_up

P = 4
SEARCH = settings(derandomize=True, database=None, max_examples=300, deadline=None)

# Hand-checked count plans. Every image is P x P (one patch) unless the case says otherwise, so shards are
# (start row, stop row, placeholders among them, local num_frames); placeholders are rows after the real ones.
# The working is in the comment: targets are int(r * total / cp) in frame space (MCore's rule).
COUNT_EXAMPLES = [
    # (case, num_frames or row count, T, cp, shards, num_padded_ranks)
    ("remainder-on-last-rank", 5, 1, 2, [(0, 2, 0, (1, 1)), (2, 5, 0, (1, 1, 1))], 0),
    ("remainder-cp4", 7, 1, 4, [(0, 1, 0, (1,)), (1, 2, 0, (1,)), (2, 3, 0, (1,)), (3, 7, 0, (1,) * 4)], 0),
    ("one-rank", 3, 1, 1, [(0, 3, 0, (1, 1, 1))], 0),
    ("fewer-images-than-ranks", 2, 1, 4, [(0, 1, 0, (1,)), (1, 2, 0, (1,)), (2, 3, 1, (1,)), (3, 4, 1, (1,))], 2),
    ("empty", 0, 1, 2, [(0, 1, 1, (1,)), (1, 2, 1, (1,))], 2),
    ("frames-at-T1-split-by-row", [3, 1], 1, 2, [(0, 2, 0, (2,)), (2, 4, 0, (1, 1))], 0),
    # total 8, target 4 is a media boundary
    ("tubelets-media-boundary", [4, 1, 3], 2, 2, [(0, 4, 0, (4,)), (4, 8, 0, (1, 3))], 0),
    # target 3 inside the 6-frame video: tubelet round(3/2) = 2 -> frame 4
    ("tubelets-inside-video", [6], 2, 2, [(0, 4, 0, (4,)), (4, 6, 0, (2,))], 0),
    # target 4 inside the 7-frame video: tubelet round(4/3) = 1 -> frame 3; rank 1 gets tubelets [3,6), [6,7)
    ("tubelets-T3-short-last", [7, 1], 3, 2, [(0, 3, 0, (3,)), (3, 8, 0, (4, 1))], 0),
    # target 3 inside a one-tubelet item [1, 4): the nearer end is 4
    ("single-tubelet-nearer-end", [1, 3, 2], 4, 2, [(0, 4, 0, (1, 3)), (4, 6, 0, (2,))], 0),
    # 2 tubelets, cp 4: 2 placeholders, total 5 -> points 0,2,2,3,5 leave rank 1 empty; one more placeholder,
    # total 6 -> points 0,2,3,4,6; ranks 2 and 3 hold only placeholders
    ("fewer-tubelets-than-ranks", [3], 2, 4, [(0, 2, 0, (2,)), (2, 3, 0, (1,)), (3, 4, 1, (1,)), (4, 6, 2, (1, 1))], 2),
    # 3 tubelets: total 5 -> points 0,2,2,5 leave rank 1 empty; a placeholder, total 6 -> 0,2,4,6; the real
    # frames end at 5 inside rank 2, which is cut there, so the placeholder lands on no rank
    ("straddle-cut", [4, 1], 2, 3, [(0, 2, 0, (2,)), (2, 4, 0, (2,)), (4, 5, 0, (1,))], 0),
    # MCore gives up (mcore_gives_up): the count plan splits the 2 tubelets by count, 2 placeholders
    ("mcore-gives-up", [6], 3, 4, [(0, 3, 0, (3,)), (3, 6, 0, (3,)), (6, 7, 1, (1,)), (7, 8, 1, (1,))], 2),
]


def _plan(frames, T, cp):
    """Plan P x P images: ``frames`` is a media list, or a count of stills (then no num_frames is passed)."""
    num_frames = None if isinstance(frames, int) else frames
    rows = frames if num_frames is None else sum(frames)
    return make_plan([(P, P)] * rows, cp, patch_dim=P, num_frames=num_frames, temporal_patch_size=T)


@pytest.mark.parametrize("num_frames, T, cp, shards, num_padded",
                         [pytest.param(*row[1:], id=row[0]) for row in COUNT_EXAMPLES])
def test_count_plan_hand_checked(num_frames, T, cp, shards, num_padded):
    plan = _plan(num_frames, T, cp)
    assert [(s.start, s.stop, s.num_placeholders, s.num_frames) for s in plan.shards] == shards
    assert plan.num_padded_ranks == num_padded
    placeholder_rows = plan.rows[plan.num_real_rows:]
    assert placeholder_rows == ((P, P),) * plan.num_placeholders


def test_mcore_gives_up_only_on_the_known_example():
    assert mcore_gives_up([6], 4, 3)
    assert not any(mcore_gives_up(frames, cp, T) for _, frames, T, cp, _, _ in COUNT_EXAMPLES[:-1] if T > 1)
    assert not mcore_gives_up([1] * 9, 8, 1)  # the rule without tubelets never gives up


def test_local_imgs_sizes_and_cu_seqlens():
    images = [(8, 8), (4, 12), (4, 4), (16, 8), (8, 4)]  # 4, 3, 1, 8, 2 patches
    plan = make_plan(images, 2, patch_dim=P)
    first, last = plan.shards
    assert (first.imgs_sizes, first.cu_seqlens, first.max_seqlen) == (((8, 8), (4, 12)), (0, 4, 7), 4)
    assert (last.imgs_sizes, last.cu_seqlens, last.max_seqlen) == (((4, 4), (16, 8), (8, 4)), (0, 1, 9, 11), 8)
    assert (first.num_patches, last.num_patches) == (7, 11)


def test_placeholder_shard_is_one_patch():
    shard = make_plan([(8, 8)], 2, patch_dim=P).shard(1)
    assert (shard.imgs_sizes, shard.cu_seqlens, shard.max_seqlen, shard.num_real_rows) == (((P, P),), (0, 1), 1, 0)


# --- invariants on random microbatches ------------------------------------------------------------


@st.composite
def microbatches(draw, max_items=8):
    """(images, num_frames, T, cp): media items of 1..2T+1 frames, each with one random grid up to 6x6."""
    T = draw(st.sampled_from((1, 2, 3, 4)))
    frames = draw(st.lists(st.integers(1, 2 * T + 1), max_size=max_items))
    images = []
    for n in frames:
        images += [(P * draw(st.integers(1, 6)), P * draw(st.integers(1, 6)))] * n
    return images, frames, T, draw(st.integers(1, 8))


def units_of(plan):
    """(first row, tokens) of every image or tubelet of the padded microbatch, in order."""
    out, row = [], 0
    for n in plan.media_frames:
        for k in range(0, n, plan.temporal_patch_size):
            h, w = plan.rows[row + k]
            out.append((row + k, (h // P) * (w // P)))
        row += n
    return out


def check_plan_invariants(plan, images, frames, T, cp):
    """What any valid split of this microbatch satisfies, whatever the strategy."""
    shards = plan.shards
    assert len(shards) == cp and [s.rank for s in shards] == list(range(cp))
    assert shards[0].start == 0 and all(a.stop == b.start for a, b in zip(shards, shards[1:]))
    assert plan.num_real_rows == len(images)
    # Split order is a permutation of the microbatch's rows with the placeholders last, in place.
    assert sorted(plan.order) == list(range(len(plan.rows)))
    assert plan.order[len(images) :] == tuple(range(len(images), len(plan.rows)))
    assert [plan.rows[pos] for pos in range(len(images))] == [images[row] for row in plan.order[: len(images)]]
    assert shards[-1].stop >= len(images), "real rows left on no rank"
    unit_starts = {first for first, _ in units_of(plan)}
    for s in shards:
        assert s.num_rows > 0, f"rank {s.rank} is empty"
        assert s.num_placeholders in (0, s.num_rows), f"rank {s.rank} mixes real rows and placeholders"
        assert s.start in unit_starts, f"rank {s.rank} starts inside a tubelet at row {s.start}"
        assert sum(s.num_frames) == s.num_rows and s.imgs_sizes == plan.rows[s.start : s.stop]
        seqlens = [(h // P) * (w // P) for h, w in s.imgs_sizes]
        assert list(s.cu_seqlens) == list(itertools.accumulate(seqlens, initial=0))
        assert s.max_seqlen == max(seqlens)
    trailing = next((i for i, s in enumerate(reversed(shards)) if s.num_real_rows), cp)
    assert plan.num_padded_ranks == trailing
    num_units = sum(math.ceil(n / T) for n in frames)
    assert plan.num_placeholders >= max(0, cp - num_units)
    assert plan.rows[len(images) :] == ((P, P),) * plan.num_placeholders


@SEARCH
@given(microbatches())
def test_count_plan_invariants(case):
    images, frames, T, cp = case
    plan = make_plan(images, cp, patch_dim=P, num_frames=frames, temporal_patch_size=T)
    check_plan_invariants(plan, images, frames, T, cp)
    if T == 1:  # images by count: the first ranks get len // cp each, the last the rest
        per_rank = max(len(images), cp) // cp
        assert [s.start for s in plan.shards] == [r * per_rank for r in range(cp)]
        assert plan.num_placeholders == plan.num_padded_ranks == max(0, cp - len(images))


@SEARCH
@given(microbatches(), st.sampled_from(("patches", "attention")))
def test_balanced_plan_invariants(case, cost):
    images, frames, T, cp = case
    plan = make_plan(images, cp, patch_dim=P, num_frames=frames, temporal_patch_size=T, strategy="balanced", cost=cost)
    check_plan_invariants(plan, images, frames, T, cp)
    check_placeholder_rule(plan, frames, T, cp)


def check_placeholder_rule(plan, frames, T, cp):
    """Fewer units than ranks: one unit per rank, in order, the placeholders last on ranks of their own."""
    num_units = sum(math.ceil(n / T) for n in frames)
    assert plan.num_placeholders == plan.num_padded_ranks == max(0, cp - num_units)
    if num_units < cp:
        assert [len(units_in(plan, s)) for s in plan.shards] == [1] * cp and not plan.reordered


def units_in(plan, shard):
    return [u for u in units_of(plan) if shard.start <= u[0] < shard.stop]


def unit_cost(tokens, cost):
    return tokens if cost == "patches" else tokens * (tokens + TOY_TOWER_ALPHA)


def brute_force_bottleneck(costs, cp):
    """The smallest largest-group sum over every split of ``costs`` into cp non-empty contiguous groups."""
    best = math.inf
    for cuts in itertools.combinations(range(1, len(costs)), cp - 1):
        bounds = (0, *cuts, len(costs))
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@SEARCH
@given(microbatches(max_items=6), st.sampled_from(("patches", "attention")))
def test_balanced_plan_is_optimal(case, cost):
    images, frames, T, cp = case
    plan = make_plan(images, cp, patch_dim=P, num_frames=frames, temporal_patch_size=T, strategy="balanced", cost=cost)
    costs = [unit_cost(tokens, cost) for _, tokens in units_of(plan)]  # placeholders included
    loads = plan.loads(cost)
    assert loads == [sum(unit_cost(t, cost) for _, t in units_in(plan, s)) for s in plan.shards]
    assert max(loads) == brute_force_bottleneck(costs, cp)
    assert plan.lower_bound(cost) == max(max(costs), sum(costs) / cp) <= max(loads)


@SEARCH
@given(microbatches(), st.sampled_from(("patches", "attention")))
def test_packed_plan_invariants(case, cost):
    images, frames, T, cp = case
    plan = make_plan(images, cp, patch_dim=P, num_frames=frames, temporal_patch_size=T, strategy="packed", cost=cost)
    check_plan_invariants(plan, images, frames, T, cp)
    check_placeholder_rule(plan, frames, T, cp)
    # Every unit of the microbatch sits whole on exactly one rank: a split-order media item is one unit's
    # frames, consecutive in the microbatch, starting on a tubelet boundary of its video.
    microbatch_units = {(first, n) for first, n in _units_of_media(frames, T)}
    for first, n in _units_of_media(plan.media_frames[: len(plan.media_frames) - plan.num_placeholders], T):
        rows = plan.order[first : first + n]  # a unit in split order
        assert list(rows) == list(range(rows[0], rows[0] + n)), f"unit at split position {first} is not whole"
        microbatch_units.remove((rows[0], n))  # raises if a unit appears twice or was never a unit
    assert not microbatch_units, f"units on no rank: {microbatch_units}"
    # Within a rank, units keep image order (only the ranks' shares are out of order).
    for s in plan.shards:
        real = plan.order[s.start : min(s.stop, plan.num_real_rows)]
        assert list(real) == sorted(real)


def _units_of_media(frames, T):
    out, row = [], 0
    for n in frames:
        out += [(row + k, min(T, n - k)) for k in range(0, n, T)]
        row += n
    return out


def lpt_bottleneck(costs, cp):
    loads = [0] * cp
    for c in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads)


@SEARCH
@given(microbatches(max_items=6), st.sampled_from(("patches", "attention")))
def test_packed_is_never_worse_than_lpt_or_balanced(case, cost):
    images, frames, T, cp = case
    kwargs = dict(patch_dim=P, num_frames=frames, temporal_patch_size=T, cost=cost)
    packed = make_plan(images, cp, strategy="packed", **kwargs)
    balanced = make_plan(images, cp, strategy="balanced", **kwargs)
    costs = [unit_cost(tokens, cost) for _, tokens in units_of(packed)]  # placeholders included
    loads = packed.loads(cost)
    assert loads == [sum(unit_cost(t, cost) for _, t in units_in(packed, s)) for s in packed.shards]
    assert sorted(costs) == sorted(unit_cost(t, cost) for _, t in units_of(balanced))
    assert max(loads) <= min(lpt_bottleneck(costs, cp), max(balanced.loads(cost)))
    assert packed.lower_bound(cost) == balanced.lower_bound(cost) <= max(loads)


def test_packed_reaches_the_bound_where_contiguous_cannot():
    images = ((12, 12), (12, 12), (4, 4), (4, 4))  # 9, 9, 1, 1 patches on 2 ranks: the bound is 20 / 2 = 10
    balanced = make_plan(images, 2, patch_dim=P, strategy="balanced")
    packed = make_plan(images, 2, patch_dim=P, strategy="packed")
    assert balanced.loads() == [9, 11]  # the best cut keeps the two 9s apart but both 1s together
    assert packed.loads() == [10, 10] and packed.lower_bound() == 10
    assert packed.order == (0, 2, 1, 3) and packed.reordered
    assert [(s.start, s.stop, s.imgs_sizes) for s in packed.shards] == [(0, 2, images[0::2]), (2, 4, images[1::2])]


def test_balanced_beats_count_on_a_skewed_batch():
    images = [(32, 32)] + [(4, 4)] * 7  # 64 patches, then seven 1-patch images
    count = make_plan(images, 2, patch_dim=P)
    balanced = make_plan(images, 2, patch_dim=P, strategy="balanced")
    assert count.loads() == [67, 4] and balanced.loads() == [64, 7]
    assert balanced.lower_bound() == 64


def test_loads_count_tubelets_once_and_placeholders():
    plan = make_plan([(8, 8)] * 3, 4, patch_dim=P, num_frames=[3], temporal_patch_size=2, strategy="balanced")
    # a 3-frame video at T=2 is 2 tubelets of 4 tokens each; 2 placeholders of 1 patch
    assert plan.loads() == [4, 4, 1, 1]
    assert plan.loads("attention", alpha=10) == [4 * 14, 4 * 14, 11, 11]
    assert plan.lower_bound() == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"cp_size": 0}, "cp_size must be a positive integer, got 0"),
    ({"cp_size": -2}, "cp_size must be a positive integer, got -2"),
    ({"cp_size": 1.5}, "cp_size must be a positive integer, got 1.5"),
    ({"cp_size": "2"}, "cp_size must be a positive integer, got '2'"),
    ({"strategy": "greedy"}, "strategy must be one of ('count', 'balanced', 'packed'), got 'greedy'"),
    ({"cost": "flops"}, "cost must be one of ('patches', 'attention'), got 'flops'"),
    ({"temporal_patch_size": 2}, "num_frames is required when temporal_patch_size=2 > 1"),
    ({"num_frames": [1, 1]}, "num_frames [1, 1] sums to 2, expected 3 rows"),
])
def test_bad_plan_request(kwargs, message):
    args = {"cp_size": 2, **kwargs}
    with pytest.raises(PlanError) as err:
        make_plan([(8, 8)] * 3, args.pop("cp_size"), patch_dim=P, **args)
    assert str(err.value) == message
