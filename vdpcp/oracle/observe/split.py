"""Was the work split as the case expects: which microbatch rows reached each rank's tower (the read table, one
collective), what each rank encoded, and the verdict on the distribution (not sharded, plan or policy mismatch)."""

from __future__ import annotations

import torch

from vdpcp.feature import comm
from vdpcp.matrix.case import RankResult
from vdpcp.oracle.observe.execution import Execution


def describe(result: RankResult, spec, plan, cp_rank: int) -> None:
    """What this rank encoded, for the report: the rows that really reached its tower where that was measured,
    else what the plan gives it (the whole microbatch when not sharded); placeholders as the plan says."""
    if result.read is not None:
        rows = result.read
    else:
        rows = plan.rows_of(cp_rank) if plan is not None else range(len(spec.images))
    result.images, result.patches = len(rows), sum(spec.row_patches[r] for r in rows)
    result.placeholders = plan.placeholders[cp_rank] if plan is not None and cp_rank < len(plan.placeholders) else 0


def read_table(spec, ran: Execution, cp: int, cp_rank: int, cp_group, device) -> torch.Tensor:
    """[CP ranks, rows], True where a microbatch row's patches reached that rank's tower (Execution.read: seen at
    the tower's inputs, whatever the grad mode). Placeholders and padding carry no row, so they read nothing; a
    tower run on every image reads every row, with or without a graph. One collective, every rank alike."""
    rows = len(spec.images)
    table = torch.zeros(cp, rows, dtype=torch.float64, device=device)
    table[cp_rank, sorted(r for r in ran.read if r < rows)] = 1.0
    return comm.all_reduce_sum(table, cp_group) > 0


def ranks_reading(read: torch.Tensor, row: int) -> list[int]:
    return read[:, row].nonzero().flatten().tolist()


def contradicts(read: torch.Tensor, plan) -> bool:
    return len(plan.owner) != read.shape[1] or any(ranks_reading(read, row) != [owner] for row, owner in enumerate(plan.owner))


def judge_distribution(result: RankResult, read: torch.Tensor, plan, sharded: bool, replicated_run: bool) -> None:
    """Was the work distributed as the case expects? Sharded: every row on exactly one rank (the plan's, where
    there is one). Replicated (the opt-out, or the implementation's fallback policy): every row on every rank."""
    cp, rows = read.shape
    if rows == 0:
        return
    if not sharded:
        why = result.replicated or "vision_dp_over_cp is off"
        if not replicated_run:
            per_rank = " ".join(str(int(read[r].sum())) for r in range(cp))
            result.plan_mismatch.append(f"policy mismatch: sharded (rows per rank {per_rank}) where every rank should encode all {rows} "
                                        f"rows: {why}")
        return
    if replicated_run:
        result.not_sharded.append(f"not sharded: every CP rank's tower read all {rows} rows, so the microbatch was "
                                  f"encoded {cp} times (vision_dp_over_cp is on at CP={cp})")
        return
    readers = {row: ranks_reading(read, row) for row in range(rows)}
    twice = [f"row {row} on ranks {ranks}" for row, ranks in readers.items() if len(ranks) > 1]
    if twice:
        result.not_sharded.append(f"not sharded: {len(twice)} of {rows} rows encoded on more than one rank "
                                  f"({_few(twice)})")
    nowhere = [str(row) for row, ranks in readers.items() if not ranks]
    if nowhere:
        result.failures.append(f"execution: row(s) {_few(nowhere)} reached no rank's tower (no rank's tower input held "
                               f"their pixels)")
    if plan is not None:
        moved = [f"row {row} encoded on rank {ranks[0]}, the plan says rank {plan.owner[row]}"
                 for row, ranks in readers.items() if len(ranks) == 1 and row < len(plan.owner) and ranks != [plan.owner[row]]]
        if moved:
            result.plan_mismatch.append(f"plan mismatch: {_few(moved)}")


def _few(items: list[str], n: int = 4) -> str:
    return "; ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")
