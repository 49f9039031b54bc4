"""The same pipeline with MCore's own helpers doing the split and the gather, so the suite can hold them
to the reference's checks. MCore is code under test here: it is called, never patched.

MCore resolves the CP group from its global parallel_state, so the adapter sets parallel_state up for the
case's CP layout (tensor and pipeline parallel sizes 1; data parallel takes the rest of the world).
"""

from __future__ import annotations

import torch

from vdpcp.model import VisionModel
from vdpcp.sharded import VisionDPConfig, check_group, encode_unsharded
from vdpcp.spec import Microbatch


def ensure_parallel_state(cp_size: int) -> None:
    """Initialise MCore's model-parallel groups for ``cp_size``, reusing them when already set up."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps.get_context_parallel_world_size() == cp_size:
        return
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=cp_size)


def encode_sharded_mcore(model: VisionModel, batch: Microbatch, config: VisionDPConfig) -> torch.Tensor:
    """Split with split_to_context_parallel_ranks_dynamic_res, gather with gather_..._dynamic_res."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.multimodal.context_parallel import (
        gather_from_context_parallel_ranks_dynamic_res,
        split_to_context_parallel_ranks_dynamic_res,
    )
    from megatron.core.packed_seq_params import PackedSeqParams

    if ps.model_parallel_is_initialized():
        check_group(config, ps.get_context_parallel_world_size(), impl="mcore")
    if not config.shard_vision:
        return encode_unsharded(model, batch)
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("mcore: parallel_state is not initialised; call ensure_parallel_state(cp_size) first")
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
    projected = model.project(model.encode(local, local_sizes, local_frames))
    return gather_from_context_parallel_ranks_dynamic_res(projected, num_padded_ranks)
