"""Megatron-Bridge's vision encoders as Implementations: any module with Bridge's
``_encode_images(images, imgs_sizes, packed_seq_params, num_frames)`` and a ``vision_dp_over_cp`` flag.

Bridge's models (Nemotron Omni's ``NemotronOmniModel``) shard their images inside ``_encode_images``: with the flag
on they split with MCore's ``split_to_context_parallel_ranks_dynamic_res``, encode, project, and gather with MCore's
``gather_from_context_parallel_ranks_dynamic_res``; with it off they encode everything. The module is code under
test: the adapter only hands it vdpcp's microbatch as Bridge's forward does and sets the switches Bridge derives
from its config, nothing else:

- ``vision_dp_over_cp`` = the configured flag AND configured CP > 1 (Bridge's constructor derives it so: at CP 1 the
  feature self-disables, silently);
- where the module has them, ``context_parallel_lm`` (Bridge's configured CP, which its split compares with its CP
  group and raises on) and ``pg_collection.cp`` (that group);
- MCore's ``parallel_state``, for the CP group's size (its split and gather read the group from there, not from the
  module: vdpcp.impls.mcore.ensure_parallel_state). Only where the flag is on: off, the adapter issues no
  collective at all, as the design asks of a disabled feature.

Bridge's forward encodes only when the microbatch has media; without any it has no vision features and never calls
``_encode_images``. The adapter does the same (``no_features``).

Plugging in Bridge's own model is a few lines (docs/protocol.md shows them): subclass ``BridgeEncoder`` and return
the model from ``build_model``. vdpcp's ``nemotron-omni`` subject runs through this same adapter.
"""

from __future__ import annotations

import torch

from vdpcp.contract.protocol import Implementation
from vdpcp.impls.mcore import MCore, mcore_context_parallel_group

PRELOAD = MCore.preload  # Bridge's split and gather are MCore's: the same modules


def packed_seq_params(cu_seqlens: torch.Tensor):
    """MCore's THD description of the packed images: one sequence per row (image or video frame)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def bridge_arguments(batch) -> tuple:
    """vdpcp's microbatch as Bridge's ``_encode_images`` takes it: packed patches [1, N, 3*P*P] (Bridge accepts
    them already patchified), per-row (H, W) sizes, per-row THD boundaries, and frames per media item."""
    frames = torch.tensor(batch.spec.media_frames, dtype=torch.long, device=batch.patches.device)
    return batch.patches, batch.imgs_sizes, packed_seq_params(batch.cu_seqlens), frames


class BridgeEncoder(Implementation):
    """A Bridge-style vision encoder under test; ``build_model`` returns the module (override it)."""

    name = "bridge"
    preload = PRELOAD

    def encode(self, model, batch):
        configure(model, vision_dp_over_cp=False, context_parallel_size=1, group=None)
        return encoded(model, batch)

    def encode_sharded(self, model, batch, config, group):
        if config.shard_vision:
            cp_group = mcore_context_parallel_group(group, self.name)
        else:  # the feature is off: Bridge never reaches its split, so no process group is set up either
            cp_group = None
        pgs = getattr(model, "pg_collection", None)
        handed_back = getattr(pgs, "cp", None)
        configure(model, vision_dp_over_cp=config.shard_vision, context_parallel_size=config.context_parallel_size,
                  group=cp_group)
        try:
            return encoded(model, batch)
        finally:  # the group is the call's: a model holding a live ProcessGroup cannot be copied (the exact run's
            if cp_group is not None and pgs is not None:  # float64 copy of a reused real-size tower, say)
                pgs.cp = handed_back


def encoded(model, batch) -> torch.Tensor:
    """Bridge's ``_encode_images`` of the microbatch, called only where it has media, as Bridge's forward calls it."""
    if not batch.spec.images:
        return no_features(model)
    return model._encode_images(*bridge_arguments(batch))


def no_features(model) -> torch.Tensor:
    """What Bridge's forward has of a microbatch without media: no vision features, [0, the projector's output
    width] in the projector's dtype and on its device, with no graph (neither tower nor projector ran). The width
    is the language model's hidden size, which MCore's MultimodalProjector projects into (its ``config.hidden_size``)."""
    projector = _projector(model)
    weight = next(projector.parameters())
    return torch.empty(0, projector.config.hidden_size, dtype=weight.dtype, device=weight.device)


def _projector(model):
    """The one MCore MultimodalProjector (with parameters) in the model's ``vision_projection``."""
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector

    projection = getattr(model, "vision_projection", None)
    if not isinstance(projection, torch.nn.Module):
        held = "no vision_projection module"
    else:
        found = [m for m in projection.modules()
                 if isinstance(m, MultimodalProjector) and next(m.parameters(), None) is not None]
        if len(found) == 1:
            return found[0]
        held = f"{len(found)} MCore MultimodalProjectors with parameters in its vision_projection"
    raise ValueError(f"BridgeEncoder: a microbatch without media has no vision features, [0, width] in the "
                     f"projector's dtype, width the config.hidden_size of the one MCore MultimodalProjector in the "
                     f"model's vision_projection; {type(model).__name__} has {held}")


def configure(model, *, vision_dp_over_cp: bool, context_parallel_size: int, group) -> None:
    """Set the switches Bridge's model derives from its config, where the model has them."""
    model.vision_dp_over_cp = vision_dp_over_cp
    if hasattr(model, "context_parallel_lm"):
        model.context_parallel_lm = context_parallel_size
    if group is not None and getattr(model, "pg_collection", None) is not None:
        model.pg_collection.cp = group

