"""Nemotron Omni's vision path (Megatron-Bridge's ``vision_dp_over_cp``) around megatron-core 0.19.2's own RADIO
tower and projector, as an Implementation driven through vdpcp.impls.bridge's adapter.

The tower and projector are code under test, built from MCore's layer specs and called, never patched:
``RADIOViTModel`` as Omni configures it (class tokens, dynamic resolution, CPE positions, tubelets of 2 with a
separate video embedder) and ``MultimodalProjector`` (an MLP with squared ReLU). MCore's helpers split and gather.
``OmniVision._encode_images`` is this module's own implementation of the design, with the signature of Bridge's:

    split (MCore, tubelet-aware at T=2; P x P placeholders) -> RADIO -> drop the class tokens
      -> zero-pad odd patch grids to even (sharded only: only the split's placeholders are odd)
      -> 2x2 pixel shuffle on each image's spatial grid -> norm + projector MLP -> gather (MCore)

Two things are ours, and why:

- ``ImageAttention``, the core attention, goes in through the layer spec: RADIO's dynamic resolution always hands
  its layers packed (THD) sequences, and MCore's local ``DotProductAttention`` refuses them without
  TransformerEngine ("Packed sequence is not supported by DotProductAttention"). It attends within each
  image (its cu_seqlens segment), as TE's attention does.
- The projector's norm is MCore's local norm before MCore's projector: Omni fuses it into the first linear
  (TransformerEngine's LayerNormColumnParallelLinear), which MCore's local spec does not have.

The upstream bug this subject shows (docs/known-limits.md): MCore's tubelet-aware split can hand a rank the
1-frame remnant of a video with an odd frame count, and RADIO treats a 1-frame item as an image, so with a separate
video embedder that frame goes through the image embedder sharded and the video embedder unsharded
(``VIDEO_REMNANT``, declared exactly on the cases whose plan has such a remnant, ``video_remnants``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from vdpcp.contract.protocol import KnownLimit, MediaAxes, MismatchError
from vdpcp.contract.sizing import Sizing
from vdpcp.feature.model import seeded
from vdpcp.feature.plan import mcore_gives_up
from vdpcp.feature.sharded import ownership, plan_for
from vdpcp.impls.bridge import PRELOAD, BridgeEncoder
from vdpcp.impls.mcore import MCORE_TUBELET_GIVE_UP

TEMPORAL_PATCH = 2  # Omni's RADIO encodes video frames in tubelets of 2
MERGE = 2  # the pixel shuffle folds 2x2 patches into one token
GROUP_MISMATCH = "vision_dp_over_cp does not match its process group"


@dataclass(frozen=True)
class OmniSize:
    layers: int
    hidden: int
    heads: int
    mlp: int
    class_tokens: int
    patch: int
    max_grid: int  # RADIO's position table, per side (max_img_h / patch); CPE resamples it to every image
    projector_hidden: int
    lm_hidden: int


SIZES = {
    # CPU CI: a couple of layers, tiny hidden; more than one class token, so dropping them by count is exercised.
    "toy": OmniSize(layers=2, hidden=32, heads=2, mlp=64, class_tokens=4, patch=4, max_grid=16, projector_hidden=64,
                    lm_hidden=48),
    # Nemotron Omni's RADIO (ViT-H/16: 32 layers, hidden 1280, 16 heads, MLP 5120, 10 class tokens, 2048 px
    # positions) and its projector 4 x 1280 -> 20480 -> 2688 (squared ReLU) into the language model.
    "real": OmniSize(layers=32, hidden=1280, heads=16, mlp=5120, class_tokens=10, patch=16, max_grid=128,
                     projector_hidden=20480, lm_hidden=2688),
}

VIDEO_REMNANT = KnownLimit(
    "omni-video-remnant",
    "MCore 0.19.2's tubelet-aware split hands a rank the 1-frame remnant of a video with an odd frame count; "
    "RADIO (separate_video_embedder=True) treats an item with num_frames == 1 as an image, so that frame goes "
    "through the image embedder sharded and through the video embedder (repeated to a tubelet) unsharded: its "
    "tokens' features differ",
    # Its failures are wrong values (outputs, then the gradients through them: float64/float32 comparisons say
    # "Tensor-likes are not close", bf16's "relative 2-norm error"). The remnant's rank never runs the video
    # embedder, which the execution check rightly spares: that rank holds real rows that take the image embedder.
    "Tensor-likes are not close",
    alternatives=("relative 2-norm error",),
)


def media_axes(size: OmniSize) -> MediaAxes:
    """Real images with even patch grids (Omni's are; its unsharded path rejects odd ones), tubelets of 2."""
    return MediaAxes(patch_dim=size.patch, temporal_patch_sizes=(1, TEMPORAL_PATCH), min_grid=MERGE, even_grids=True)


class Alone:
    """The process group of a tower with no parallelism inside (TP, PP and its own CP all 1). MCore's layers ask
    their groups only for size and rank, and run no collective on a group of one. A real group would have to be
    created collectively and rebuilt with every world the harness makes; the model outlives both (model_cache)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def process_groups():
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection()
    groups.tp = groups.pp = groups.cp = Alone()
    return groups


class ImageAttention(nn.Module):
    """Core attention within each packed image (THD: its cu_seqlens segment), in MCore's core-attention slot.

    MCore's local DotProductAttention asserts that no packed sequence reaches it (only TransformerEngine's takes
    them), and RADIO's dynamic resolution always packs; so this one goes in through the layer spec instead.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head dim), as MCore's default

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """[t, heads, head_dim] each -> [t, heads * head_dim]."""
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        attended = []
        for start, stop in zip(bounds, bounds[1:]):
            # [1, heads, n, head_dim]: SDPA's fused kernels take 4-D inputs only.
            q, k, v = (t[start:stop].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            attended.append(F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale)[0].transpose(0, 1))
        out = torch.cat(attended) if attended else query[:0]
        return out.reshape(out.shape[0], -1)


def tower_config(size: OmniSize):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=size.layers, hidden_size=size.hidden, num_attention_heads=size.heads, ffn_hidden_size=size.mlp,
        add_bias_linear=True, add_qkv_bias=True, activation_func=F.gelu, layernorm_epsilon=1e-6,
        **UNFUSED,
    )


def projector_config(size: OmniSize):
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=size.lm_hidden, num_attention_heads=1,
                             ffn_hidden_size=size.projector_hidden, add_bias_linear=False,
                             activation_func=squared_relu, **UNFUSED)


# No dropout (both arms must compute the same function), no fused kernels (CPU, no TransformerEngine or Apex),
# weights drawn on the CPU generator vdpcp seeds (MCore's GPU path draws from its own RNG tracker).
UNFUSED = dict(hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
               masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
               apply_rope_fusion=False, use_cpu_initialization=True)


def layer_spec():
    """MCore's local ViT layer, with ImageAttention as its core attention (see ImageAttention for why)."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    spec = get_vit_layer_with_local_spec()
    attention = spec.submodules.self_attention
    inner = replace(attention.submodules, core_attention=ImageAttention)
    return replace(spec, submodules=replace(spec.submodules, self_attention=replace(attention, submodules=inner)))


class Projection(nn.Module):
    """MCore's norm, then MCore's projector MLP (4 x hidden -> projector_hidden -> lm_hidden, squared ReLU)."""

    def __init__(self, size: OmniSize):
        super().__init__()
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        config = projector_config(size)
        self.norm = WrappedTorchNorm(config, hidden_size=MERGE**2 * size.hidden, eps=1e-6)
        self.mlp = MultimodalProjector(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                             linear_fc2=RowParallelLinear),
                                       "mlp", MERGE**2 * size.hidden, tp_group=Alone())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[tokens, 4 x hidden] -> [tokens, lm_hidden] (MCore's MLP takes [s, b, h]: one row a sequence)."""
        return self.mlp(self.norm(features).unsqueeze(1)).squeeze(1)


class OmniVision(nn.Module):
    """Nemotron Omni's vision encoder with the design's sharding inside ``_encode_images`` (Bridge's signature)."""

    def __init__(self, size: OmniSize, patch_dim: int):
        super().__init__()
        from megatron.core.models.vision.radio import RADIOViTModel

        self.size, self.patch_dim = size, patch_dim
        self.vision_model = RADIOViTModel(
            tower_config(size), layer_spec(), patch_dim=patch_dim, img_h=MERGE * patch_dim, img_w=MERGE * patch_dim,
            max_img_h=size.max_grid * patch_dim, max_img_w=size.max_grid * patch_dim,
            add_class_token=True, class_token_len=size.class_tokens, embedder_bias=False, dynamic_resolution=True,
            # CPE in training mode samples a random crop of the position table on every forward (augmentation), so
            # no two encodes of one image would agree; its eval mode resamples the table deterministically.
            force_cpe_eval_mode=True,
            temporal_patch_dim=TEMPORAL_PATCH, separate_video_embedder=True, pg_collection=process_groups(),
        )
        self.vision_projection = Projection(size)
        self.vision_dp_over_cp = False  # the adapter sets these three as Bridge's config does
        self.context_parallel_lm = 1
        self.pg_collection = process_groups()

    def _encode_images(self, images, imgs_sizes, packed_seq_params, num_frames) -> torch.Tensor:
        """Packed patches [1, N, 3*P*P] of every row -> projected features [tokens, lm_hidden], images in order.
        Called only with media, as Bridge's forward calls it (vdpcp.impls.bridge)."""
        # a loader's pixels arrive in float32 whatever the tower's dtype: cast to the tower's, as Bridge's encode does
        images = images.to(dtype=next(self.vision_model.parameters()).dtype)
        shard, padded_ranks = self.vision_dp_over_cp, 0
        if shard:
            images, imgs_sizes, packed_seq_params, num_frames, padded_ranks = self._split(
                images, imgs_sizes, packed_seq_params, num_frames)
        encoded, sizes, _ = self.vision_model(images, imgs_sizes=imgs_sizes, packed_seq_params=packed_seq_params,
                                              num_frames=num_frames)
        features = self._shuffled(encoded[0], sizes, pad_odd=shard)
        projected = self.vision_projection(features)
        if not shard:
            return projected
        from megatron.core.models.multimodal.context_parallel import gather_from_context_parallel_ranks_dynamic_res

        return gather_from_context_parallel_ranks_dynamic_res(projected, padded_ranks)  # project, THEN gather

    def _split(self, images, imgs_sizes, packed_seq_params, num_frames):
        from megatron.core.models.multimodal.context_parallel import split_to_context_parallel_ranks_dynamic_res

        group = self.pg_collection.cp.size()
        if group != self.context_parallel_lm:  # before any collective: MCore's split reads its own CP group
            raise ValueError(f"Nemotron Omni {GROUP_MISMATCH}: config={self.context_parallel_lm}, group={group}.")
        local, sizes, params, _, padded_ranks, frames = split_to_context_parallel_ranks_dynamic_res(
            images, imgs_sizes, packed_seq_params, patch_dim=self.patch_dim, num_frames=num_frames,
            temporal_patch_size=TEMPORAL_PATCH)
        return local, sizes, params, frames, padded_ranks

    def _shuffled(self, encoded: torch.Tensor, sizes, pad_odd: bool) -> torch.Tensor:
        """RADIO's output [rows, ...] per encoded item (image or tubelet: class tokens, then its patch grid) ->
        pixel-shuffled features [tokens, 4 x hidden]."""
        grids = [(int(h) // self.patch_dim, int(w) // self.patch_dim) for h, w in sizes.tolist()]
        c = self.size.class_tokens
        items = encoded.split([c + gh * gw for gh, gw in grids])
        return torch.cat([pixel_shuffle(item[c:].view(gh, gw, -1), pad_odd) for item, (gh, gw) in zip(items, grids)])


def pixel_shuffle(grid: torch.Tensor, pad_odd: bool) -> torch.Tensor:
    """A [h, w, C] patch grid -> [h/2 * w/2, 4C]: each 2x2 block of patches one token, tokens row-major over the
    blocks, the block's four patches (top-left, top-right, bottom-left, bottom-right) side by side in channels.
    ``pad_odd``: zero-pad an odd side first (the split's 1x1 placeholders); otherwise an odd grid is refused."""
    h, w, c = grid.shape
    if pad_odd:
        grid = F.pad(grid, (0, 0, 0, w % MERGE, 0, h % MERGE))
        h, w = grid.shape[:2]
    if h % MERGE or w % MERGE:
        raise ValueError(f"Nemotron Omni's pixel shuffle needs an even patch grid, got {h}x{w} patches")
    return grid.reshape(h // MERGE, MERGE, w // MERGE, MERGE, c).permute(0, 2, 1, 3, 4).reshape(-1, MERGE**2 * c)


def omni_spec(spec):
    """The microbatch as Omni splits it: MCore's tubelet-aware split at T=2 whatever the spec's T (Bridge passes
    the tower's temporal patch size, and every media item's frames)."""
    return replace(spec, temporal_patch_size=TEMPORAL_PATCH, num_frames=spec.media_frames)


def video_remnants(spec, cp: int) -> list[tuple[int, int]]:
    """(rank, media item) where the count plan hands a rank exactly one frame of a video of several frames."""
    plan = plan_for(omni_spec(spec), _count(cp))
    found, row = [], 0
    for item, frames in enumerate(plan.media_frames[: len(spec.media_frames)]):
        for shard in plan.shards:
            if frames > 1 and min(row + frames, shard.stop) - max(row, shard.start) == 1:
                found.append((shard.rank, item))
        row += frames
    return found


def _count(cp: int):
    from vdpcp.contract.protocol import VisionDPConfig

    return VisionDPConfig(context_parallel_size=cp, strategy="count")


class OmniVisionSizing(Sizing):
    """What Omni's RADIO tower and projector cost a case (vdpcp.matrix.budget), at the case's tower size."""

    def param_count(self, case) -> int:
        s = SIZES[case.tower]
        h, P = s.hidden, case.spec.patch_dim
        layer = 4 * h * h + 4 * h + 2 * h * s.mlp + s.mlp + h + 4 * h  # qkv, proj, MLP, two norms (with biases)
        tower = s.layers * layer + 3 * P * P * h * (1 + TEMPORAL_PATCH) + s.class_tokens * h + s.max_grid**2 * h
        projector = 2 * MERGE**2 * h + MERGE**2 * h * s.projector_hidden + s.projector_hidden * s.lm_hidden
        return tower + projector

    def full_attention(self, case) -> tuple[int, int]:
        s = SIZES[case.tower]  # every layer attends over a whole image
        return s.layers, s.heads

    def patch_bytes(self, case) -> int:
        """One arm's bytes per patch: the patch and its embedding, per layer about 12 x hidden + 2 x MLP elements
        kept for backward (norms, qkv, attention, projection, the MLP's two activations), and a quarter of the
        projector's (each token is four patches: its input, norm, hidden layer twice, output)."""
        s = SIZES[case.tower]
        itemsize = {"float64": 8, "float32": 4, "bfloat16": 2}[case.dtype]
        per_patch = 3 * case.spec.patch_dim**2 * TEMPORAL_PATCH + 2 * s.hidden
        layers = s.layers * (12 * s.hidden + 2 * s.mlp)
        projector = (2 * MERGE**2 * s.hidden + 2 * s.projector_hidden + s.lm_hidden) // MERGE**2
        return itemsize * (per_patch + layers + projector)


class NemotronOmni(BridgeEncoder):
    name = "nemotron-omni"
    splits = ("count",)
    loader_pixels = "device"  # Bridge's data step moves each batch to the device; _encode_images casts
    pixel_grads = True  # MCore's split inside Omni's encoder slices the pixels differentiably
    towers = {size: media_axes(dims) for size, dims in SIZES.items()}
    media = towers["toy"]
    preload = PRELOAD + ("megatron.core.models.vision.radio", "megatron.core.models.vision.multimodal_projector")
    # Omni's own error (OmniVision._split), raised on every rank before the split.
    mismatch_error = MismatchError(kind="ValueError", text=GROUP_MISMATCH, names_sizes=False)
    sizing = OmniVisionSizing()

    def build_model(self, case, dtype, device):
        size = SIZES[case.tower]
        on = device if case.tower != "toy" else None  # a real-size tower is drawn where it runs
        with seeded(0, on):
            model = OmniVision(size, case.spec.patch_dim)
        return model.to(device=device, dtype=dtype)

    def model_key(self, case):
        return case.tower, case.spec.patch_dim

    def plan(self, spec, config):
        """MCore's split at T=2: vdpcp's count plan, parity-tested against MCore's split."""
        return ownership(plan_for(omni_spec(spec), replace(config, strategy="count"))) if config.shard_vision else None

    def known_limit(self, case, backend: str) -> KnownLimit | None:
        config = case.config
        if not config.shard_vision or case.config_cp is not None or not case.spec.images:
            return None
        spec = omni_spec(case.spec)
        if mcore_gives_up(spec.media_frames, case.cp, TEMPORAL_PATCH):
            return MCORE_TUBELET_GIVE_UP
        # MCore's gather backward runs on gloo too (vdpcp.oracle.observe.gloo_collectives): the remnant is the one limit left.
        return VIDEO_REMNANT if video_remnants(case.spec, case.cp) else None


nemotron_omni = NemotronOmni()
