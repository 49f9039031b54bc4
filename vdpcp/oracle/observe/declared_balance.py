"""Balance held to what an implementation declares: each CP rank's load, measured from what ran, against the best
partition under the implementation's own objective (``Implementation.balance``, a vdpcp.contract.protocol.Balance).

A partition that is off by one at a cut, or that balances another cost than the work, leaves every output and
gradient right, so the correctness checks never see it; only a rank's load does. Each rank's load is the summed
cost of the units its tower read (the read table: the rows whose patches reached its tower, found through autograd,
never the plan), and its busiest rank is held to the busiest rank of the best partition vdpcp knows under the same
objective (vdpcp.feature.plan.best_busiest: the optimal contiguous one, or the packed split's where units may go anywhere).

The slack is one unit: a partition of whole units can be no finer, and the field's partitions stay within one of
the busiest rank's own units of the best (one that cuts at cost targets, as Automodel's does, leaves each rank below
total / CP plus its first unit; largest-first onto the least loaded rank, below total / CP plus its last). A case
is unbalanced where the busiest rank, less its largest unit, still carries as much as the best partition's busiest
rank: a whole unit it need not have held. Pure: the read table in, one line out.
"""

from __future__ import annotations

from collections.abc import Sequence

from vdpcp.contract.protocol import Balance
from vdpcp.feature.plan import best_busiest


def units(spec, objective: Balance) -> list[tuple[range, tuple[int, int]]]:
    """The microbatch rows of each unit and its patch grid (its first frame's): an image, or a video's frames in
    runs of ``objective.frames_per_unit`` (the spec's temporal patch size where it says none)."""
    per_unit = objective.frames_per_unit or spec.temporal_patch_size
    out, row = [], 0
    for frames in spec.media_frames:
        for k in range(0, frames, per_unit):
            out.append((range(row + k, row + min(frames, k + per_unit)), spec.grids[row + k]))
        row += frames
    return out


def loads(read: Sequence[Sequence[bool]], spec, objective: Balance) -> list[list[int]]:
    """Per CP rank, the cost of each unit its tower read a row of (``read[rank][row]``)."""
    found = units(spec, objective)
    return [[objective.unit_cost(grid) for rows, grid in found if any(line[row] for row in rows)] for line in read]


def judge(read: Sequence[Sequence[bool]], spec, objective: Balance | None) -> str | None:
    """Why this run is unbalanced under ``objective`` (one line), or None: balanced, or nothing declared."""
    if objective is None or not read:
        return None
    held = loads(read, spec, objective)
    costs = [objective.unit_cost(grid) for _, grid in units(spec, objective)]
    if not costs or not any(held):
        return None
    cp = len(read)
    best = best_busiest(costs, cp, objective.contiguous) if len(costs) >= cp else max(costs)
    busiest = max(range(cp), key=lambda r: (sum(held[r]), -r))
    load, largest = sum(held[busiest]), max(held[busiest])
    if load - largest < best:
        return None
    kind = "contiguous" if objective.contiguous else "order-free"
    return (f"unbalanced: CP rank {busiest}'s tower read {len(held[busiest])} units costing {load} ({_named(objective)}); "
            f"the best {kind} partition's busiest rank costs {best}, and less its largest unit ({largest}) this rank "
            f"still carries {load - largest} (cost by rank: {' '.join(str(sum(h)) for h in held)})")


def _named(objective: Balance) -> str:
    if objective.cost == "attention":
        return f"p*(p+{objective.alpha}) a unit"
    return "patches" if objective.cost == "patches" else "the declared cost"
