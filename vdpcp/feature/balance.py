"""Load balance of a split: what each CP rank encodes, and how far the busiest rank is from the best case.

The busiest rank sets a step's peak memory and time, so a split is judged by its busiest rank against two
references: the ideal, total / CP, and the lower bound, max(largest unit, total / CP), since a unit (an
image or a tubelet) cannot be cut. Loads are given in both costs: patches, and p*(p+alpha), which also
counts attention inside each unit growing with the square of its p tokens.

Splits compared: MCore's count split, the balanced split (contiguous) and the packed split (any order, put
back in image order after the gather), each planned with either cost. Pure: shapes in,
numbers out; the chart is drawn with matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from vdpcp.feature.plan import COSTS, Plan, make_plan

if TYPE_CHECKING:  # specs are only read here; importing vdpcp.feature.spec would pull torch into `vdpcp bench --help`
    from vdpcp.feature.spec import MicrobatchSpec

# The balance command's and sweep's alpha: 3x the hidden size of the real-size tower, as NeMo Automodel chooses alpha.
REAL_TOWER_ALPHA = 3 * 1024
# (name, strategy, cost the planner minimises)
SPLITS = (
    ("count", "count", "patches"),
    ("balanced:patches", "balanced", "patches"),
    ("balanced:attention", "balanced", "attention"),
    ("packed:patches", "packed", "patches"),
    ("packed:attention", "packed", "attention"),
)
SPLIT_NAMES = tuple(name for name, _, _ in SPLITS)
TARGET_TO_LOWER_BOUND = 1.05  # the balance target: a split's busiest rank within 5% of the lower bound


@dataclass(frozen=True)
class RankLoad:
    rank: int
    images: int  # real rows (images or video frames)
    placeholders: int
    load: dict[str, int]  # cost name -> this rank's load in it


@dataclass(frozen=True)
class SplitBalance:
    split: str
    cp: int
    ranks: tuple[RankLoad, ...]
    ideal: dict[str, float]  # cost -> total / CP
    lower_bound: dict[str, float]  # cost -> max(largest unit, total / CP)

    def busiest(self, cost: str) -> int:
        return max(r.load[cost] for r in self.ranks)

    def to_ideal(self, cost: str) -> float:
        return _ratio(self.busiest(cost), self.ideal[cost])

    def to_lower_bound(self, cost: str) -> float:
        return _ratio(self.busiest(cost), self.lower_bound[cost])


def plan_split(spec: MicrobatchSpec, cp: int, split: str, alpha: int = REAL_TOWER_ALPHA) -> Plan:
    strategy, cost = _split(split)
    return make_plan(
        spec.images,
        cp,
        patch_dim=spec.patch_dim,
        num_frames=spec.num_frames,
        temporal_patch_size=spec.temporal_patch_size,
        strategy=strategy,
        cost=cost,
        alpha=alpha,
    )


def split_balance(spec: MicrobatchSpec, cp: int, split: str, alpha: int = REAL_TOWER_ALPHA) -> SplitBalance:
    plan = plan_split(spec, cp, split, alpha)
    loads = {cost: plan.loads(cost, alpha) for cost in COSTS}
    ranks = tuple(
        RankLoad(s.rank, s.num_real_rows, s.num_placeholders, {cost: loads[cost][s.rank] for cost in COSTS})
        for s in plan.shards
    )
    # The references count real units only: placeholders are overhead of the split, not work to share.
    units = {cost: unit_costs(spec, cost, alpha) for cost in COSTS}
    ideal = {cost: sum(units[cost]) / cp for cost in COSTS}
    bound = {cost: max(ideal[cost], max(units[cost], default=0)) for cost in COSTS}
    return SplitBalance(split, cp, ranks, ideal, bound)


def compare(spec: MicrobatchSpec, cp: int, alpha: int = REAL_TOWER_ALPHA) -> list[SplitBalance]:
    return [split_balance(spec, cp, name, alpha) for name in SPLIT_NAMES]


def unit_costs(spec: MicrobatchSpec, cost: str, alpha: int = REAL_TOWER_ALPHA) -> list[int]:
    """Cost of each encoder unit (image, or tubelet of up to T frames sharing the first frame's grid)."""
    weight = (lambda p: p) if cost == "patches" else (lambda p: p * (p + alpha))
    costs, row = [], 0
    for n in spec.media_frames:
        for k in range(0, n, spec.temporal_patch_size):
            costs.append(weight(spec.row_patches[row + k]))
        row += n
    return costs


def unordered_busiest(costs: Sequence[int], cp: int) -> int:
    """Busiest rank of plain LPT (largest first onto the least loaded rank), free to reorder units.

    A reference only: the packed split starts from it and improves on it; it shows what that improvement
    pass buys.
    """
    heap = [0] * cp
    for c in sorted(costs, reverse=True):
        heapq.heapreplace(heap, heap[0] + c)
    return max(heap)


# --- many microbatches ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepRow:
    split: str
    cp: int
    cost: str
    mean_to_ideal: float
    mean_to_lower_bound: float
    max_to_lower_bound: float
    within_target: int  # microbatches whose busiest rank is within TARGET_TO_LOWER_BOUND of the bound
    microbatches: int


def sweep(specs: Sequence[MicrobatchSpec], cps: Sequence[int], alpha: int = REAL_TOWER_ALPHA) -> list[SweepRow]:
    """Busiest-rank ratios over many microbatches, per (CP, split, cost); 'unordered' is the reference above."""
    rows = []
    for cp in cps:
        per_spec = [compare(spec, cp, alpha) for spec in specs]
        for cost in COSTS:
            for k, name in enumerate(SPLIT_NAMES):
                to_ideal = [b[k].to_ideal(cost) for b in per_spec]
                to_bound = [b[k].to_lower_bound(cost) for b in per_spec]
                rows.append(_sweep_row(name, cp, cost, to_ideal, to_bound))
            to_lb = [unordered_busiest(unit_costs(s, cost, alpha), cp) / b[0].lower_bound[cost] for s, b in zip(specs, per_spec)]
            to_ideal = [unordered_busiest(unit_costs(s, cost, alpha), cp) / b[0].ideal[cost] for s, b in zip(specs, per_spec)]
            rows.append(_sweep_row("unordered LPT (reference)", cp, cost, to_ideal, to_lb))
    return rows


def _sweep_row(name, cp, cost, to_ideal, to_lb) -> SweepRow:
    within = sum(r <= TARGET_TO_LOWER_BOUND for r in to_lb)
    return SweepRow(name, cp, cost, statistics.mean(to_ideal), statistics.mean(to_lb), max(to_lb), within, len(to_lb))


# --- tables and chart -----------------------------------------------------------------------------


def rank_table(balances: Sequence[SplitBalance]) -> str:
    """Markdown: one row per (split, rank), loads in both costs as ratios to the ideal."""
    header = ("CP", "split", "rank", "images", "placeholders", "patches", "patches / ideal", "p(p+a) / ideal")
    rows = [
        (b.cp, b.split, r.rank, r.images, r.placeholders, r.load["patches"],
         f"{r.load['patches'] / b.ideal['patches']:.3f}", f"{r.load['attention'] / b.ideal['attention']:.3f}")
        for b in balances for r in b.ranks
    ]
    return _markdown(header, "rlrrrrrr", rows)


def summary_table(balances: Sequence[SplitBalance]) -> str:
    """Markdown: busiest rank of each split against the ideal and the lower bound, in both costs."""
    header = ("CP", "split", "busiest patches", "/ ideal", "/ lower bound", "busiest p(p+a) / ideal", "/ lower bound")
    rows = [
        (b.cp, b.split, b.busiest("patches"), f"{b.to_ideal('patches'):.3f}", f"{b.to_lower_bound('patches'):.3f}",
         f"{b.to_ideal('attention'):.3f}", f"{b.to_lower_bound('attention'):.3f}")
        for b in balances
    ]
    return _markdown(header, "rlrrrrr", rows)


def sweep_table(rows: Sequence[SweepRow]) -> str:
    header = ("CP", "cost", "split", "mean busiest / ideal", "mean / lower bound", "max / lower bound",
              f"within {TARGET_TO_LOWER_BOUND - 1:.0%} of bound")
    cells = [
        (r.cp, r.cost, r.split, f"{r.mean_to_ideal:.3f}", f"{r.mean_to_lower_bound:.3f}", f"{r.max_to_lower_bound:.3f}",
         f"{r.within_target}/{r.microbatches}")
        for r in rows
    ]
    return _markdown(header, "rllrrrr", cells)


def _markdown(header: Sequence[str], align: str, rows) -> str:
    """A markdown table; ``align`` has one letter per column: r (right) or l (left)."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    lines = [_row(header), rule] + [_row(row) for row in rows]
    return "\n".join(lines)


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def plot_ranks(balances: Sequence[SplitBalance], path: str | Path, title: str = "") -> Path:
    """Bar chart: one panel per (CP, split), each rank's load / ideal in both costs, the lower bound dashed."""
    plt = _pyplot()
    cps = sorted({b.cp for b in balances})
    fig, axes = plt.subplots(len(cps), len(SPLIT_NAMES), figsize=(4.2 * len(SPLIT_NAMES), 2.8 * len(cps)), squeeze=False, sharey="row")
    for b in balances:
        ax = axes[cps.index(b.cp)][SPLIT_NAMES.index(b.split)]
        x = range(b.cp)
        width = 0.4
        ax.bar([i - width / 2 for i in x], [r.load["patches"] / b.ideal["patches"] for r in b.ranks], width, label="patches")
        ax.bar([i + width / 2 for i in x], [r.load["attention"] / b.ideal["attention"] for r in b.ranks], width, label="p(p+alpha)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(b.lower_bound["patches"] / b.ideal["patches"], color="C0", linestyle="--", linewidth=0.8)
        ax.axhline(b.lower_bound["attention"] / b.ideal["attention"], color="C1", linestyle=":", linewidth=0.8)
        busiest = f"busiest {b.to_lower_bound('patches'):.2f}x / {b.to_lower_bound('attention'):.2f}x bound"
        ax.set_title(f"CP={b.cp} {b.split}: {busiest}", fontsize=9)
        ax.set_xticks(list(x))
        ax.set_xlabel("rank")
    for row in axes:
        row[0].set_ylabel("load / ideal (total/CP)")
    axes[0][0].legend(fontsize=8)
    return _save(fig, plt, path, title or "per-rank load (line: ideal; dashed: lower bound)")


def plot_sweep(rows: Sequence[SweepRow], path: str | Path, title: str = "") -> Path:
    """Bar chart over many microbatches: mean busiest / lower bound per split, the worst case as a tick."""
    plt = _pyplot()
    cps = sorted({r.cp for r in rows})
    fig, axes = plt.subplots(1, len(COSTS), figsize=(6 * len(COSTS), 3.5), squeeze=False)
    for ax, cost in zip(axes[0], COSTS):
        names = list(dict.fromkeys(r.split for r in rows))
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            sel = [next(r for r in rows if r.cp == cp and r.cost == cost and r.split == name) for cp in cps]
            xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(cps))]
            ax.bar(xs, [r.mean_to_lower_bound for r in sel], width, label=name)
            ax.scatter(xs, [r.max_to_lower_bound for r in sel], marker="_", color="black", s=80)
        ax.axhline(TARGET_TO_LOWER_BOUND, color="red", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(cps)), [f"CP={cp}" for cp in cps])
        ax.set_ylabel("busiest rank / lower bound")
        ax.set_ylim(bottom=0.9)
        ax.set_title(f"cost: {cost} (bar: mean, tick: worst; red: 5% target)", fontsize=9)
    axes[0][0].legend(fontsize=8)
    return _save(fig, plt, path, title or "busiest rank against the lower bound")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path, title) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ratio(load: float, reference: float) -> float:
    return load / reference if reference else float("nan")  # a microbatch with no images has no reference


def _split(name: str) -> tuple[str, str]:
    for split, strategy, cost in SPLITS:
        if split == name:
            return strategy, cost
    raise ValueError(f"split must be one of {list(SPLIT_NAMES)}, got {name!r}")
