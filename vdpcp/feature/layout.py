"""A case's parallel layout: TP innermost, then CP, then DP, as MCore orders its groups (tp-cp-ep-dp-pp).

World rank = tp_rank + tp * (cp_rank + cp * dp_rank). The CP groups this builds are the ones MCore's
parallel_state builds for the same sizes, so an implementation that reads MCore's state and one handed the
group agree, and one that mixes the default group with its CP group gathers another replica's features.

Within a CP group the language model's sequence is split zigzag-wise (``zigzag_positions``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    cp: int
    dp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.cp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, cp_rank, dp_rank) of a world rank."""
        return rank % self.tp, (rank // self.tp) % self.cp, rank // (self.tp * self.cp)

    def cp_group_ranks(self, dp_rank: int, tp_rank: int) -> list[int]:
        return [tp_rank + self.tp * (c + self.cp * dp_rank) for c in range(self.cp)]

    def tp_group_ranks(self, dp_rank: int, cp_rank: int) -> list[int]:
        return [t + self.tp * (cp_rank + self.cp * dp_rank) for t in range(self.tp)]


@dataclass(frozen=True)
class Groups:
    """This rank's place in a layout and its process groups."""

    cp: dist.ProcessGroup
    tp: dist.ProcessGroup | None
    cp_rank: int
    dp_rank: int
    tp_rank: int


_built: tuple[object, dict[Layout, Groups]] | None = None  # (the default group they belong to, groups by layout)


def groups(layout: Layout) -> Groups:
    """This rank's groups in ``layout``, built once per default process group (every rank must ask, in the same
    order: new_group is collective). A layout of one CP group and nothing else uses the default group itself."""
    global _built
    world = dist.group.WORLD
    if _built is None or _built[0] is not world:
        _built = (world, {})
    if layout not in _built[1]:
        _built[1][layout] = _build(layout, dist.get_rank())
    return _built[1][layout]


def _build(layout: Layout, rank: int) -> Groups:
    if layout.world_size != dist.get_world_size():
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks; the world has {dist.get_world_size()}")
    tp_rank, cp_rank, dp_rank = layout.coords(rank)
    if layout.dp == layout.tp == 1:
        return Groups(dist.group.WORLD, None, cp_rank, dp_rank, tp_rank)
    mine: dict[str, dist.ProcessGroup] = {}
    for d in range(layout.dp):
        for t in range(layout.tp):
            group = dist.new_group(layout.cp_group_ranks(d, t))
            if (d, t) == (dp_rank, tp_rank):
                mine["cp"] = group
    if layout.tp > 1:
        for d in range(layout.dp):
            for c in range(layout.cp):
                group = dist.new_group(layout.tp_group_ranks(d, c))
                if (d, c) == (dp_rank, cp_rank):
                    mine["tp"] = group
    return Groups(mine["cp"], mine.get("tp"), cp_rank, dp_rank, tp_rank)


def zigzag_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Which positions of a ``length``-token sequence CP rank ``rank`` holds, as a bool mask.

    The sequence is padded to a multiple of 2*cp and cut into 2*cp chunks; rank r holds chunks r and 2*cp-1-r,
    so under causal attention every rank gets as much early (cheap) as late (costly) context.
    """
    chunk = math.ceil(length / (2 * cp))
    chunk_of = torch.arange(length) // max(chunk, 1)
    return (chunk_of == rank) | (chunk_of == 2 * cp - 1 - rank)
