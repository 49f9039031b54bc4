"""Vision DP over CP, the reference: plan -> split -> encode -> project -> gather, around a CP-unaware model.

Each CP rank encodes only its share of the microbatch's images with the full tower, projects them (so the
projector stays sharded and only the smaller projected features cross the wire), and one gather restores
the global feature set that every rank's media merge needs. Where the plan assigns images out of order
(the packed split), one index_select after the gather puts the features back in image order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vdpcp.contract.protocol import Ownership, VisionDPConfig, check_group
from vdpcp.feature.comm import gather_features
from vdpcp.feature.model import VisionModel, output_tokens
from vdpcp.feature.plan import Plan, RankShard, make_plan
from vdpcp.feature.spec import Microbatch, MicrobatchSpec


def plan_for(spec: MicrobatchSpec, config: VisionDPConfig) -> Plan:
    return make_plan(
        spec.images,
        config.context_parallel_size,
        patch_dim=spec.patch_dim,
        num_frames=spec.num_frames,
        temporal_patch_size=spec.temporal_patch_size,
        strategy=config.strategy,
        cost=config.cost,
        alpha=config.alpha,
    )


def encode_unsharded(model: VisionModel, batch: Microbatch) -> torch.Tensor:
    return model(to_tower(model, batch.patches), batch.imgs_sizes, batch.spec.num_frames)


def to_tower(model: VisionModel, patches: torch.Tensor) -> torch.Tensor:
    """Patches on the tower's device: a loader's host pixels are moved here, a rank's own share only."""
    return patches.to(model.pos.device, non_blocking=True)


def encode_sharded(model: VisionModel, batch: Microbatch, config: VisionDPConfig, group=None) -> torch.Tensor:
    """The global projected features [tokens, lm_hidden], identical on every rank of ``group``."""
    if group is not None or config.shard_vision:
        check_group(config, dist.get_world_size(group), "reference")
    if not config.shard_vision:
        return encode_unsharded(model, batch)
    plan = plan_for(batch.spec, config)
    shard = plan.shard(dist.get_rank(group))
    local = to_tower(model, split(batch, shard, plan.order))  # sliced on the host, so only its share crosses
    projected = model.project(model.encode(local, shard.imgs_sizes, shard.num_frames))
    gathered = gather_features(projected, real_tokens(plan), group)
    index = image_order(plan)
    return gathered if index is None else gathered.index_select(0, torch.tensor(index, device=gathered.device))


def split(batch: Microbatch, shard: RankShard, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """A rank's packed patches: views of its real rows (so input gradients flow back), then placeholders.

    ``order`` maps the shard's split positions to microbatch rows (None: the identity); each run of
    consecutive rows is one slice, so an in-order shard is a single view.
    """
    real_stop = shard.stop - shard.num_placeholders
    rows = range(shard.start, real_stop) if order is None else order[shard.start : real_stop]
    cu = batch.cu_seqlens
    parts = [batch.patches[:, int(cu[first]) : int(cu[last + 1])] for first, last in row_runs(rows)]
    if shard.num_placeholders:  # a P x P placeholder is one all-zero patch
        parts.append(batch.patches.new_zeros(1, shard.num_placeholders, batch.patches.shape[-1]))
    if not parts:
        return batch.patches[:, :0]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def row_runs(rows) -> list[tuple[int, int]]:
    """(first, last) of each run of consecutive row indices, in the order given."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and row == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], row)
        else:
            runs.append((row, row))
    return runs


def real_units(plan: Plan) -> list[tuple[int, int, int]]:
    """(rank, first microbatch row, output tokens) of every real (non-placeholder) unit, in split order."""
    units = []
    for shard in plan.shards:
        row = shard.start
        for n in shard.num_frames:
            for k in range(0, n, plan.temporal_patch_size):
                if row + k < plan.num_real_rows:
                    h, w = plan.rows[row + k]
                    units.append((shard.rank, plan.order[row + k], output_tokens((h // plan.patch_dim, w // plan.patch_dim))))
            row += n
    return units


def ownership(plan: Plan) -> Ownership:
    """The plan as row ownership: each real row's rank, its tokens (on a tubelet's first frame), placeholders."""
    owner, tokens = [0] * plan.num_real_rows, [0] * plan.num_real_rows
    for shard in plan.shards:
        pos = shard.start
        for n in shard.num_frames:
            for k in range(0, n, plan.temporal_patch_size):
                tubelet = [plan.order[p] for p in range(pos + k, min(pos + k + plan.temporal_patch_size, pos + n))
                           if p < plan.num_real_rows]
                for row in tubelet:
                    owner[row] = shard.rank
                if tubelet:
                    h, w = plan.rows[pos + k]
                    tokens[tubelet[0]] = output_tokens((h // plan.patch_dim, w // plan.patch_dim))
            pos += n
    return Ownership(tuple(owner), tuple(tokens), tuple(s.num_placeholders for s in plan.shards))


def real_tokens(plan: Plan) -> list[int]:
    """Output tokens of each rank's real (non-placeholder) units: what the gather keeps of each rank."""
    counts = [0] * plan.cp_size
    for rank, _, tokens in real_units(plan):
        counts[rank] += tokens
    return counts


def image_order(plan: Plan) -> list[int] | None:
    """Gathered token row of each output token in image order, or None where the gather is already in order."""
    if not plan.reordered:
        return None
    spans, start = [], 0
    for _, first_row, tokens in real_units(plan):
        spans.append((first_row, start, start + tokens))
        start += tokens
    return [i for _, a, b in sorted(spans) for i in range(a, b)]
