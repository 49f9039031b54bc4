"""Split planning: which CP rank encodes which images (or tubelets), as pure functions over shapes.

No torch.distributed here. A plan is computed identically on every rank from the microbatch's
shapes, so ranks agree on it without talking.

Two strategies:
- ``count``: MCore 0.19.2's ``split_to_context_parallel_ranks_dynamic_res``, reproduced rule for rule:
  images divided by count with the remainder on the last rank; with tubelets (T > 1), frame-space split
  points moved onto tubelet or media boundaries. When there are fewer images (tubelets) than ranks,
  P x P placeholder images are appended so no rank runs an empty encoder; the trailing ranks that hold
  only placeholders are ``num_padded_ranks``, whose outputs the gather drops. One deliberate difference:
  where MCore's tubelet split gives up with a rank still empty (``mcore_gives_up``) and breaks tubelets,
  the count plan divides tubelets by count instead, as MCore divides images at T=1.
- ``balanced``: contiguous ranges of whole units (images, or tubelets) that minimise the busiest rank's
  cost: an optimal linear partition, found by binary search on the bottleneck. Same placeholder rule.
- ``packed``: whole units assigned to ranks without keeping image order (a multiway number partition:
  the balanced split and LPT, largest first onto the least loaded rank, each improved by moves and swaps
  off the busiest rank while it cools; the better wins), so the busiest rank can come close to
  max(largest unit, total / CP) where no contiguous split can. The plan's ``order`` lists the rows rank by
  rank, each unit its own media item; the gather's output is put back in image order after. Same
  placeholder rule (with fewer units than ranks every rank holds one unit anyway, in order).

Rows are image rows as the VLM packs them: one per image or video frame; placeholders are extra rows
after the real ones, each its own one-frame media item. Shards are contiguous ranges of the rows in split
order: ``order[i]`` is the microbatch row at split position i (the identity for count and balanced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from vdpcp.contract.protocol import TOY_TOWER_ALPHA

STRATEGIES = ("count", "balanced", "packed")
COSTS = ("patches", "attention")


class PlanError(ValueError):
    """An impossible split request (bad CP size, unknown strategy or cost)."""


@dataclass(frozen=True)
class RankShard:
    """One rank's share: rows [start, stop) of the padded row list in split order, described as the encoder needs."""

    rank: int
    start: int
    stop: int
    num_placeholders: int
    imgs_sizes: tuple[tuple[int, int], ...]
    num_frames: tuple[int, ...]  # frames per local media item (a video may be cut on a tubelet boundary)
    cu_seqlens: tuple[int, ...]  # local, per row, starting at 0

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    @property
    def num_real_rows(self) -> int:
        return self.num_rows - self.num_placeholders

    @property
    def num_patches(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def max_seqlen(self) -> int:
        return max((b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:])), default=0)


@dataclass(frozen=True)
class Plan:
    cp_size: int
    strategy: str
    patch_dim: int
    temporal_patch_size: int
    rows: tuple[tuple[int, int], ...]  # (H, W) pixels of every row in split order, real rows first, then placeholders
    media_frames: tuple[int, ...]  # frames per media item over the padded row list in split order
    num_real_rows: int
    shards: tuple[RankShard, ...]
    num_padded_ranks: int
    order: tuple[int, ...]  # microbatch row of each split position (placeholders map to themselves)

    @property
    def reordered(self) -> bool:
        """True when ranks hold rows out of image order, so the gathered features need putting back."""
        return any(i != row for i, row in enumerate(self.order))

    @property
    def num_placeholders(self) -> int:
        return len(self.rows) - self.num_real_rows

    def shard(self, rank: int) -> RankShard:
        return self.shards[rank]

    def loads(self, cost: str = "patches", alpha: int = TOY_TOWER_ALPHA) -> list[int]:
        """Each rank's encoder cost: the sum of its units' costs (placeholders included: they are encoded)."""
        unit_cost = _cost_fn(cost, alpha)
        return [
            sum(unit_cost(tokens) for tokens in _unit_tokens(s.imgs_sizes, s.num_frames, self.temporal_patch_size, self.patch_dim))
            for s in self.shards
        ]

    def lower_bound(self, cost: str = "patches", alpha: int = TOY_TOWER_ALPHA) -> float:
        """No split on unit boundaries can beat max(largest unit, total / CP)."""
        unit_cost = _cost_fn(cost, alpha)
        costs = [unit_cost(t) for t in _unit_tokens(self.rows, self.media_frames, self.temporal_patch_size, self.patch_dim)]
        return max(max(costs, default=0), sum(costs) / self.cp_size)


def make_plan(
    imgs_sizes: Sequence[Sequence[int]],
    cp_size: int,
    *,
    patch_dim: int,
    num_frames: Sequence[int] | None = None,
    temporal_patch_size: int = 1,
    strategy: str = "count",
    cost: str = "patches",
    alpha: int = TOY_TOWER_ALPHA,
) -> Plan:
    """Plan the split of one microbatch's rows over ``cp_size`` ranks."""
    if not isinstance(cp_size, int) or cp_size < 1:
        raise PlanError(f"cp_size must be a positive integer, got {cp_size!r}")
    if strategy not in STRATEGIES:
        raise PlanError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    _cost_fn(cost, alpha)
    rows = [tuple(int(v) for v in s) for s in imgs_sizes]
    T = temporal_patch_size
    if T > 1 and num_frames is None:
        raise PlanError(f"num_frames is required when temporal_patch_size={T} > 1")
    media = list(num_frames) if num_frames is not None else [1] * len(rows)
    if sum(media) != len(rows):
        raise PlanError(f"num_frames {media} sums to {sum(media)}, expected {len(rows)} rows")
    order = list(range(len(rows)))
    if strategy == "count":
        points, media, num_padded, num_placeholders = _count_split(rows, media, cp_size, T)
    elif strategy == "balanced":
        points, media, num_padded, num_placeholders = _balanced_split(rows, media, cp_size, T, patch_dim, _cost_fn(cost, alpha))
    else:
        points, media, num_padded, num_placeholders, order = _packed_split(rows, media, cp_size, T, patch_dim, _cost_fn(cost, alpha))
    rows = [rows[i] for i in order] + [(patch_dim, patch_dim)] * num_placeholders
    order += range(len(order), len(rows))
    num_real = len(rows) - num_placeholders
    shards = tuple(
        _make_shard(r, points[r], points[r + 1], rows, media, num_real, patch_dim) for r in range(cp_size)
    )
    return Plan(cp_size, strategy, patch_dim, T, tuple(rows), tuple(media), num_real, shards, num_padded, tuple(order))


# --- count split (MCore's rules) ------------------------------------------------------------------


def _count_split(rows, media, cp, T):
    """Split points in row space, the padded media list, num_padded_ranks and the placeholder count."""
    if T > 1:
        split = _mcore_tubelet_split(media, cp, T)
        if split is not None:
            return split
        # MCore gives up here and its split is broken (mcore_gives_up); split tubelets by count instead.
    return _unit_count_split(media, cp, T)


def _unit_count_split(media, cp, T):
    """Units (images, or tubelets) divided by count, the last rank taking the remainder: MCore's rule at T=1."""
    units = _units(media, T)
    placeholders = max(0, cp - len(units))
    starts = [first for first, _ in units] + [sum(media) + i for i in range(placeholders)]
    per_rank = len(starts) // cp
    points = [starts[r * per_rank] for r in range(cp)] + [sum(media) + placeholders]
    return points, media + [1] * placeholders, placeholders, placeholders


def mcore_gives_up(num_frames: Sequence[int], cp_size: int, temporal_patch_size: int) -> bool:
    """True where MCore 0.19.2's tubelet-aware split still leaves a rank empty after its cp re-plans.

    It then keeps split points whose total predates the placeholders it added last, so the real-frame count
    it derives is short: a rank stays empty or a tubelet is cut between ranks, and real frames can land on
    no rank or beside placeholders (one 6-frame video, T=3, CP=4). The count plan splits tubelets by count
    there instead.
    """
    return temporal_patch_size > 1 and _mcore_tubelet_split(list(num_frames), cp_size, temporal_patch_size) is None


def _mcore_tubelet_split(media, cp, T):
    """MCore's tubelet-aware split (T > 1) as _count_split returns it, or None where MCore gives up."""
    tubelets = sum(math.ceil(n / T) for n in media)
    placeholders = max(0, cp - tubelets)
    media = media + [1] * placeholders
    # Tubelet rounding can leave a rank empty; MCore then appends one placeholder per empty rank and
    # plans again, at most cp times.
    for _ in range(cp):
        points = _tubelet_split_points(media, T, cp, sum(media))
        empty = sum(points[k] == points[k + 1] for k in range(cp))
        if empty == 0:
            break
        media = media + [1] * empty
        placeholders += empty
    else:
        return None
    real_total = sum(media) - placeholders
    if placeholders and real_total not in points:
        # Keep real frames and placeholders on different ranks: cut the rank that straddles them.
        for k in range(cp):
            if points[k] < real_total < points[k + 1]:
                points[k + 1] = real_total
                break
    num_padded = 0
    if placeholders:
        for r in reversed(range(cp)):
            if points[r] < real_total:
                break
            num_padded += 1
    return points, media, num_padded, placeholders


def _tubelet_split_points(media, T, cp, total):
    """cp+1 frame indices near the even split, each on a media boundary or a tubelet boundary."""
    bounds = [0]
    for n in media:
        bounds.append(bounds[-1] + n)
    points = [0]
    for rank in range(1, cp):
        target = int(rank * (total / cp))
        if target in bounds:
            point = target
        else:
            m = next((i for i in range(len(media)) if bounds[i + 1] > target), len(media) - 1)
            start, end = bounds[m], bounds[m + 1]
            tubes = math.ceil(media[m] / T)
            if tubes <= 1:  # a single tubelet cannot be cut: take the nearer end
                point = start if target - start < end - target else end
            else:
                k = min(max(round((target - start) / T), 1), tubes - 1)
                point = min(start + k * T, end)
        points.append(max(point, points[-1]))
    points.append(total)
    return points


# --- balanced split -------------------------------------------------------------------------------


def _balanced_split(rows, media, cp, T, patch_dim, unit_cost):
    units = _units(media, T)  # (first row, row count) of each image or tubelet
    placeholders = max(0, cp - len(units))
    if placeholders:
        media = media + [1] * placeholders
        units += [(len(rows) + i, 1) for i in range(placeholders)]
        points = [u[0] for u in units] + [len(rows) + placeholders]
        return points, media, placeholders, placeholders
    costs = [unit_cost(_tokens(rows[first], patch_dim)) for first, _ in units]
    groups = _min_bottleneck_partition(costs, cp)
    points = [units[g][0] for g in groups] + [len(rows)]
    return points, media, 0, 0


def _min_bottleneck_partition(costs: Sequence[int], parts: int) -> list[int]:
    """First unit index of each of ``parts`` non-empty contiguous groups minimising the largest group sum.

    Requires len(costs) >= parts. Binary search on the bottleneck: the smallest B for which a greedy
    left-to-right packing needs at most ``parts`` groups is optimal (greedy is optimal for a fixed B).
    """
    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_starts(costs, mid)) <= parts:
            hi = mid
        else:
            lo = mid + 1
    starts = _greedy_starts(costs, lo)
    # Fewer groups than ranks: peel single units off the end of multi-unit groups (never raises the max).
    while len(starts) < parts:
        ends = starts[1:] + [len(costs)]
        g = max(i for i in range(len(starts)) if ends[i] - starts[i] > 1)
        starts.insert(g + 1, ends[g] - 1)
    return starts


def _greedy_starts(costs, bound):
    starts, load = [0], 0
    for i, c in enumerate(costs):
        if load + c > bound and load > 0:
            starts.append(i)
            load = 0
        load += c
    return starts


def best_busiest(costs: Sequence[int], parts: int, contiguous: bool) -> int:
    """The busiest group's cost in the best partition of ``costs`` into ``parts`` non-empty groups vdpcp knows:
    contiguous, the optimal one (the balanced split's); otherwise the packed split's (the optimum is NP-hard, and
    none beats max(largest, total / parts)). Requires len(costs) >= parts."""
    if not contiguous:
        return max(sum(costs[u] for u in group) for group in _pack(costs, parts))
    starts = _min_bottleneck_partition(costs, parts)
    return max(sum(costs[a:b]) for a, b in zip(starts, starts[1:] + [len(costs)]))


# --- packed split --------------------------------------------------------------------------------


def _packed_split(rows, media, cp, T, patch_dim, unit_cost):
    """_balanced_split's results plus the order: each rank's units, rank by rank, in image order within a rank."""
    units = _units(media, T)
    if len(units) < cp:  # one unit per rank and placeholders after: already optimal, and in order
        return (*_balanced_split(rows, media, cp, T, patch_dim, unit_cost), list(range(len(rows))))
    costs = [unit_cost(_tokens(rows[first], patch_dim)) for first, _ in units]
    bins = _pack(costs, cp)
    order, media, points = [], [], [0]
    for members in bins:
        for u in members:
            first, frames = units[u]
            order += range(first, first + frames)
            media.append(frames)  # each unit its own media item: a tubelet is encoded alone either way
        points.append(len(order))
    return points, media, 0, 0, order


def _pack(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Unit indices of each of ``parts`` non-empty groups, sorted, with a small largest group sum.

    Requires len(costs) >= parts. Two starts, each improved (see _improve): the optimal contiguous partition
    (the balanced split) and LPT, units largest first, each onto the least loaded group. The better result
    wins, the contiguous one on a tie (it needs no reordering), so packed is never worse than balanced or
    LPT: neither alone is always the better start.
    """
    contiguous = _min_bottleneck_partition(costs, parts) + [len(costs)]
    starts = [[list(range(a, b)) for a, b in zip(contiguous, contiguous[1:])], _lpt(costs, parts)]
    improved = [_improve(groups, costs) for groups in starts]
    return min(improved, key=lambda groups: max(sum(costs[u] for u in g) for g in groups))


def _lpt(costs, parts):
    """Largest first onto the least loaded group; ties to the group with fewer units, then the lower index,
    so the first ``parts`` units open every group."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for u in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min(range(parts), key=lambda k: (loads[k], len(groups[k]), k))
        groups[g].append(u)
        loads[g] += costs[u]
    return groups


def _improve(groups, costs):
    """Move one unit off the busiest group, or swap one of its units for a smaller one, whichever leaves the
    pair's larger sum lowest, while that is below the busiest sum; groups stay non-empty.

    Each step lowers the loads sorted high to low lexicographically (so it ends) and never raises the largest
    sum. Deterministic: ties go to the lower index throughout.
    """
    groups = [list(g) for g in groups]
    loads = [sum(costs[u] for u in g) for g in groups]
    while (step := _best_step(groups, loads, costs)) is not None:
        hot, other, out, back = step  # move unit ``out`` from hot to other, and ``back`` (or None) the other way
        groups[hot].remove(out)
        groups[other].append(out)
        loads[hot] -= costs[out]
        loads[other] += costs[out]
        if back is not None:
            groups[other].remove(back)
            groups[hot].append(back)
            loads[other] -= costs[back]
            loads[hot] += costs[back]
    return [sorted(g) for g in groups]


def _best_step(groups, loads, costs):
    """The move or swap off the busiest group that leaves the pair's larger sum lowest, or None."""
    hot = max(range(len(loads)), key=lambda k: (loads[k], -k))
    best, best_peak = None, loads[hot]
    for other in range(len(loads)):
        if other == hot:
            continue
        for out in groups[hot]:
            backs = [None] if len(groups[hot]) > 1 else []  # a move must not leave the busiest group empty
            backs += [b for b in groups[other] if costs[b] < costs[out]]
            for back in backs:
                delta = costs[out] - (0 if back is None else costs[back])
                peak = max(loads[hot] - delta, loads[other] + delta)
                if peak < best_peak:
                    best, best_peak = (hot, other, out, back), peak
    return best


# --- shared helpers -------------------------------------------------------------------------------


def _units(media, T):
    """(first row, row count) of each encoder unit: an image, or a tubelet of up to T frames."""
    units, row = [], 0
    for n in media:
        for k in range(0, n, T):
            units.append((row + k, min(T, n - k)))
        row += n
    return units


def _unit_tokens(imgs_sizes, media, T, patch_dim):
    """Encoder tokens of each unit: a tubelet stacks its frames channel-wise, so it has one frame's grid."""
    return [_tokens(imgs_sizes[first], patch_dim) for first, _ in _units(list(media), T)]


def _tokens(size, patch_dim):
    return (size[0] // patch_dim) * (size[1] // patch_dim)


def _cost_fn(cost, alpha):
    if cost == "patches":
        return lambda p: p
    if cost == "attention":  # attention inside a unit grows with the square of its token count
        return lambda p: p * (p + alpha)
    raise PlanError(f"cost must be one of {COSTS}, got {cost!r}")


def _make_shard(rank, start, stop, rows, media, num_real, patch_dim):
    local_rows = rows[start:stop]
    cu = [0]
    for h, w in local_rows:
        cu.append(cu[-1] + (h // patch_dim) * (w // patch_dim))
    return RankShard(
        rank=rank,
        start=start,
        stop=stop,
        num_placeholders=max(0, stop - max(start, num_real)),
        imgs_sizes=tuple(local_rows),
        num_frames=tuple(_local_media(media, start, stop)),
        cu_seqlens=tuple(cu),
    )


def _local_media(media, start, stop):
    """Frames of each media item that fall in rows [start, stop)."""
    out, row = [], 0
    for n in media:
        overlap = min(row + n, stop) - max(row, start)
        if overlap > 0:
            out.append(overlap)
        row += n
    return out
