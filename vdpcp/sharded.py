"""Vision DP over CP, the reference: plan -> split -> encode -> project -> gather, around a CP-unaware model.

Each CP rank encodes only its share of the microbatch's images with the full tower, projects them (so the
projector stays sharded and only the smaller projected features cross the wire), and one gather restores
the global feature set that every rank's media merge needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vdpcp.comm import gather_features
from vdpcp.model import VisionModel, output_tokens
from vdpcp.plan import DEFAULT_ALPHA, Plan, RankShard, make_plan
from vdpcp.spec import Microbatch, MicrobatchSpec


class GroupMismatchError(ValueError):
    """The configured CP size disagrees with the process group the split would run on."""


@dataclass(frozen=True)
class VisionDPConfig:
    context_parallel_size: int = 1
    vision_dp_over_cp: bool = True  # on by default, as shipped; self-disables at CP=1
    strategy: str = "count"
    cost: str = "patches"
    alpha: int = DEFAULT_ALPHA

    @property
    def shard_vision(self) -> bool:
        return self.vision_dp_over_cp and self.context_parallel_size > 1


def check_group(config: VisionDPConfig, group_size: int, impl: str = "reference") -> None:
    """Raise (locally, before any collective, so every rank raises and none hangs) on a CP size mismatch."""
    if config.context_parallel_size != group_size:
        raise GroupMismatchError(
            f"{impl}: vision_dp_over_cp does not match its process group: "
            f"context_parallel_size={config.context_parallel_size} but the CP group has {group_size} ranks"
        )


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
    return model(batch.patches, batch.imgs_sizes, batch.spec.num_frames)


def encode_sharded(model: VisionModel, batch: Microbatch, config: VisionDPConfig, group=None) -> torch.Tensor:
    """The global projected features [tokens, lm_hidden], identical on every rank of ``group``."""
    if group is not None or config.shard_vision:
        check_group(config, dist.get_world_size(group))
    if not config.shard_vision:
        return encode_unsharded(model, batch)
    plan = plan_for(batch.spec, config)
    shard = plan.shard(dist.get_rank(group))
    local = split(batch, shard)
    projected = model.project(model.encode(local, shard.imgs_sizes, shard.num_frames))
    return gather_features(projected, real_tokens(plan), group)


def split(batch: Microbatch, shard: RankShard) -> torch.Tensor:
    """A rank's packed patches: a view of its real rows (so input gradients flow back), then placeholders."""
    real_stop = shard.stop - shard.num_placeholders
    start, stop = (int(batch.cu_seqlens[min(i, len(batch.cu_seqlens) - 1)]) for i in (shard.start, real_stop))
    local = batch.patches[:, start:stop] if shard.num_real_rows else batch.patches[:, :0]
    if shard.num_placeholders:  # a P x P placeholder is one all-zero patch
        zeros = batch.patches.new_zeros(1, shard.num_placeholders, batch.patches.shape[-1])
        local = torch.cat([local, zeros], dim=1)
    return local


def real_tokens(plan: Plan) -> list[int]:
    """Output tokens of each rank's real (non-placeholder) units: what the gather keeps of each rank."""
    counts = []
    for shard in plan.shards:
        tokens, row = 0, shard.start
        for n in shard.num_frames:
            for k in range(0, n, plan.temporal_patch_size):
                if row + k < plan.num_real_rows:
                    h, w = plan.rows[row + k]
                    tokens += output_tokens((h // plan.patch_dim, w // plan.patch_dim))
            row += n
        counts.append(tokens)
    return counts
