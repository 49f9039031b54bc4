"""Was the work split as the case expects: which microbatch rows reached each rank's tower (the read table, one
collective), what each rank encoded, and the verdict on the distribution (not sharded, plan or policy mismatch)."""

from __future__ import annotations

import torch

from vdpcp.feature import comm
from vdpcp.matrix.case import FAILURE, NOT_SHARDED, PLAN_MISMATCH, Finding, Telemetry
from vdpcp.oracle.failures import found
from vdpcp.oracle.observe.execution import Execution


def describe(figures: Telemetry, spec, plan, cp_rank: int) -> None:
    """What this rank encoded, into its ``figures`` for the report: the rows that really reached its tower where that
    was measured, else what the plan gives it (the whole microbatch when not sharded); placeholders as the plan says."""
    if figures.read is not None:
        rows = figures.read
    else:
        rows = plan.rows_of(cp_rank) if plan is not None else range(len(spec.images))
    figures.images, figures.patches = len(rows), sum(spec.row_patches[r] for r in rows)
    figures.placeholders = plan.placeholders[cp_rank] if plan is not None and cp_rank < len(plan.placeholders) else 0


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


def judge_distribution(rank: int, read: torch.Tensor, plan, sharded: bool, replicated_run: bool,
                       replicated: str | None = None) -> list[Finding]:
    """Was the work distributed as the case expects? Sharded: every row on exactly one rank (the plan's, where
    there is one). Replicated (the opt-out, or the implementation's fallback policy, ``replicated`` its reason):
    every row on every rank. What is not, as findings of ``rank``."""
    cp, rows = read.shape
    if rows == 0:
        return []
    if not sharded:
        if replicated_run:
            return []
        per_rank = " ".join(str(int(read[r].sum())) for r in range(cp))
        return found(PLAN_MISMATCH, rank, f"policy mismatch: sharded (rows per rank {per_rank}) where every rank should "
                                          f"encode all {rows} rows: {replicated or 'vision_dp_over_cp is off'}")
    if replicated_run:
        return found(NOT_SHARDED, rank, f"not sharded: every CP rank's tower read all {rows} rows, so the microbatch "
                                        f"was encoded {cp} times (vision_dp_over_cp is on at CP={cp})")
    readers = {row: ranks_reading(read, row) for row in range(rows)}
    twice = [f"row {row} on ranks {ranks}" for row, ranks in readers.items() if len(ranks) > 1]
    nowhere = [str(row) for row, ranks in readers.items() if not ranks]
    moved = [] if plan is None else [
        f"row {row} encoded on rank {ranks[0]}, the plan says rank {plan.owner[row]}"
        for row, ranks in readers.items() if len(ranks) == 1 and row < len(plan.owner) and ranks != [plan.owner[row]]]
    said = found(NOT_SHARDED, rank, f"not sharded: {len(twice)} of {rows} rows encoded on more than one rank "
                                    f"({_few(twice)})") if twice else []
    said += found(FAILURE, rank, f"execution: row(s) {_few(nowhere)} reached no rank's tower (no rank's tower input "
                                 f"held their pixels)") if nowhere else []
    return said + (found(PLAN_MISMATCH, rank, f"plan mismatch: {_few(moved)}") if moved else [])


def _few(items: list[str], n: int = 4) -> str:
    return "; ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")
