"""MCore's own helpers as an Implementation: split_to_context_parallel_ranks_dynamic_res and
gather_from_context_parallel_ranks_dynamic_res around vdpcp's tower. MCore is code under test here: it is
called, never patched.

MCore resolves the CP group from its global parallel_state, not from the group it is handed, so the adapter
sets parallel_state up for the group's size (tensor and pipeline parallel 1; data parallel takes the rest of
the world) and raises the documented mismatch error when the group handed in is not MCore's CP group.

Its gather's backward is torch.distributed.nn's all_to_all, whose gloo fallback fails on uneven token counts and
on any CP group but the first: on gloo the oracle runs it with vdpcp.oracle.observe.gloo_collectives's all_to_all instead (torch's
name swapped for the case; MCore's own code and attributes untouched), so every gradient case runs on gloo too.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from vdpcp.contract.protocol import (
    GROUP_MISMATCH_TEXT,
    GroupMismatchError,
    Implementation,
    KnownLimit,
    MediaAxes,
    check_group,
)
from vdpcp.feature.model import REAL_PATCH
from vdpcp.feature.plan import mcore_gives_up
from vdpcp.feature.sharded import encode_unsharded, ownership, plan_for

MCORE_EMPTY_MICROBATCH = KnownLimit(
    "mcore-empty-microbatch",
    "MCore 0.19.2 pads an empty microbatch to one placeholder per rank, then its gather drops every rank's "
    "output and torch.cat gets an empty list",
    "expected a non-empty list of Tensors",
)
MCORE_TUBELET_GIVE_UP = KnownLimit(
    "mcore-tubelet-give-up",
    "MCore 0.19.2's tubelet-aware split still leaves a rank empty after its re-plans and then cuts, drops or "
    "misplaces real frames (see vdpcp.feature.plan.mcore_gives_up)",
    "",  # any failure: outputs of the wrong shape, or a rank that raised
)


def ensure_parallel_state(cp_size: int) -> None:
    """Initialise MCore's model-parallel groups for ``cp_size``, reusing them when already set up."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps.get_context_parallel_world_size() == cp_size:
        return
    ps.destroy_model_parallel()
    # No gloo copies of the data-parallel groups: only MCore's distributed-optimizer checkpointing reads them, never
    # the vision path; each case builds its groups afresh, and the copies would be most of that cost.
    ps.initialize_model_parallel(context_parallel_size=cp_size, create_gloo_process_groups=False)


def mcore_context_parallel_group(group, name: str):
    """MCore's CP group, set up for ``group``'s size; it must be ``group`` itself (MCore's split and gather read their
    group from parallel_state, not from the caller): the documented mismatch error, on every rank, where it is not."""
    from megatron.core import parallel_state as ps

    ensure_parallel_state(dist.get_world_size(group))
    handed, mcores = dist.get_process_group_ranks(group), ps.get_context_parallel_global_ranks()
    if list(handed) != list(mcores):
        raise GroupMismatchError(f"{name}: {GROUP_MISMATCH_TEXT}: MCore's parallel_state CP group is ranks "
                                 f"{list(mcores)}, the group handed in is ranks {list(handed)}")
    return ps.get_context_parallel_group()


class MCore(Implementation):
    name = "mcore"
    splits = ("count",)
    loader_pixels = "device"  # Megatron's data step moves each batch to the device before the model
    pixel_grads = True  # MCore's split slices the pixels differentiably
    towers = {"toy": MediaAxes(), "real": MediaAxes(patch_dim=REAL_PATCH)}  # vdpcp's tower, as the reference's
    preload = ("megatron.core.parallel_state", "megatron.core.models.multimodal.context_parallel",
               "megatron.core.packed_seq_params")

    def encode(self, model, batch):
        return encode_unsharded(model, batch)

    def encode_sharded(self, model, batch, config, group):
        from megatron.core import parallel_state as ps
        from megatron.core.models.multimodal.context_parallel import split_to_context_parallel_ranks_dynamic_res
        from megatron.core.packed_seq_params import PackedSeqParams

        ensure_parallel_state(dist.get_world_size(group))  # MCore's groups follow the world; the config may disagree
        check_group(config, ps.get_context_parallel_world_size(), self.name)
        mcore_context_parallel_group(group, self.name)
        if not config.shard_vision:
            return encode_unsharded(model, batch)
        spec = batch.spec
        T = spec.temporal_patch_size
        local, local_sizes, _, _, num_padded_ranks, local_frames = split_to_context_parallel_ranks_dynamic_res(
            batch.patches,
            batch.imgs_sizes,
            PackedSeqParams(cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens, qkv_format="thd"),
            patch_dim=spec.patch_dim,
            num_frames=torch.tensor(spec.media_frames) if T > 1 else None,
            temporal_patch_size=T,
        )
        return self.encode_local(model, local, local_sizes, local_frames, num_padded_ranks)

    def encode_local(self, model, patches, imgs_sizes, num_frames, num_padded_ranks):
        """This rank's share of MCore's split through the tower and the projector, then MCore's gather."""
        from megatron.core.models.multimodal.context_parallel import gather_from_context_parallel_ranks_dynamic_res

        projected = model.project(model.encode(patches, imgs_sizes, num_frames))
        return gather_from_context_parallel_ranks_dynamic_res(projected, num_padded_ranks)

    def plan(self, spec, config):
        """MCore always splits by count: vdpcp's count plan, which is parity-tested against MCore's split."""
        return ownership(plan_for(spec, replace(config, strategy="count"))) if config.shard_vision else None

    def known_limit(self, case, backend: str) -> KnownLimit | None:
        config = case.config
        if not config.shard_vision or case.config_cp is not None:
            return None
        spec = case.spec
        if not spec.images:
            return MCORE_EMPTY_MICROBATCH
        if spec.temporal_patch_size > 1 and mcore_gives_up(spec.media_frames, case.cp, spec.temporal_patch_size):
            return MCORE_TUBELET_GIVE_UP
        return None


mcore = MCore()
