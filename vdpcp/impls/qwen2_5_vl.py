"""transformers' Qwen2.5-VL vision tower as an Implementation: vision DP over CP around a third-party model.

The tower (``Qwen2_5_VisionTransformerPretrainedModel`` from a tiny random config) is code under test: it is
called, never patched. Its 2x2 patch merger is the projector, so merged features are what crosses the wire.

vdpcp's microbatch -> the tower's input (``inputs``), by reshape, cat, pad and permute only, so the gradient
of every real patch flows back to ``batch.patches``:

- a media item is an image (one row) or a video (``spec.media_frames`` consecutive rows of one size);
- its frames are stacked in time, and the last frame is repeated up to a whole temporal patch of 2 frames:
  an image becomes two copies of itself (as Qwen's image processor does), a video of n frames has
  ceil(n / 2) temporal patches (as its video processor does);
- an odd patch grid gets one row (column) of zero patches at the bottom (right), since the 2x2 merger needs
  even sides. Qwen's processor resizes to a multiple of 2P instead, which would mix pixels; zero padding
  keeps every real patch as it is, and the pad patches take part in attention like any other;
- a patch is vdpcp's (C, P, P) vector with time inserted after the channel, (C, T, P, P), as the tower's
  Conv3d patch embedding views it; patches go (t, h/2, w/2, 2, 2): the four patches of each 2x2 merge
  window consecutive, windows row-major, which is the processor's order and what the tower's rotary
  positions and window index assume.

Sharded (``encode_sharded``), the ``count`` split: whole media items, contiguous, ``n // cp`` per rank and
the remainder on the last rank. With fewer items than ranks the items go one per rank and every rank left
over encodes one placeholder, a zero image of 2x2 patches at t=1 (the smallest grid the merger takes: one
token), so no rank runs an empty tower. Each rank encodes its items with the full tower, then one
autograd-aware all-gather restores every item's features in order on every rank and drops the placeholder
tokens; its backward hands each rank the sum over the CP group of its tokens' gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vdpcp.contract.protocol import Implementation, KnownLimit, MediaAxes, Ownership, check_group
from vdpcp.contract.sizing import Sizing
from vdpcp.oracle.compare import sketch

MODELING = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
CHANNELS = 3
TEMPORAL_PATCH = 2  # frames per temporal patch: the tower's Conv3d kernel depth
MERGE = 2  # the merger folds MERGE x MERGE patches into one token
PLACEHOLDER_GRID = (1, MERGE, MERGE)  # (t, h, w) in patches: the smallest grid the merger takes
PLACEHOLDER_TOKENS = 1  # the placeholder grid merges into one token

EMPTY_MICROBATCH = KnownLimit(
    "qwen-empty-microbatch",
    "transformers' Qwen2.5-VL vision tower cannot encode zero media items: with an empty grid_thw its "
    "forward raises in get_vision_position_ids (torch.cat of no position ids); a VLM skips the tower instead",
    "expected a non-empty list of Tensors",
)
FLOAT32_INSIDE = KnownLimit(
    "qwen-float32-inside",
    "in float64 the tower still computes in float32 inside: Qwen2_5_VLRMSNorm normalizes in float32 (and the "
    "vision rotary embedding rotates q and k in float32), so with sharding off every CP rank's own backward "
    "rounds to float32 before the parameter gradients are summed over ranks, off the one unsharded backward "
    "by 2.6e-7 to 5.7e-7 (float64's atol is 1e-7). The oracle takes that one backward of the summed loss where "
    "the tower's gradients are too large to sum over ranks (over vdpcp.oracle.compare.sketch.WIDTH parameters); a smaller "
    "tower's reference is the ranks' own backwards summed, as the ranks' own are. Sharded, the gather sums the "
    "gradient before the tower, and the cases pass",
    "param grads (summed over ranks)",
    grads_only=True,
)


@dataclass(frozen=True)
class TowerInputs:
    """The tower's two arguments: packed patches in its order, and each media item's (t, h, w) patch grid."""

    pixel_values: torch.Tensor  # [sum of t*h*w, C*T*P*P]
    grid_thw: torch.Tensor  # [media items, 3], int64

    def patch_offsets(self) -> list[int]:
        """Where each media item's patches start in pixel_values, and the end."""
        offsets = [0]
        for t, h, w in self.grid_thw.tolist():
            offsets.append(offsets[-1] + t * h * w)
        return offsets


@dataclass(frozen=True)
class Media:
    """One image or video of the microbatch, as the tower encodes it."""

    first_row: int
    frames: int
    grid: tuple[int, int]  # patches (rows, cols) of each frame, before even padding

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        gh, gw = self.grid
        return math.ceil(self.frames / TEMPORAL_PATCH), gh + gh % MERGE, gw + gw % MERGE

    @property
    def tokens(self) -> int:
        return merged_tokens(self.grid_thw)


def merged_tokens(grid_thw) -> int:
    t, h, w = grid_thw
    return t * h * w // MERGE**2


def media_items(spec) -> list[Media]:
    """The microbatch's media items in order; a video's frames must share one size (one grid_thw each)."""
    items, row = [], 0
    for frames in spec.media_frames:
        sizes = set(spec.images[row : row + frames])
        if len(sizes) > 1:
            raise ValueError(f"qwen2_5_vl: media item {len(items)} (rows {row}..{row + frames - 1}) is a video "
                             f"whose frames differ in size {sorted(sizes)}; expected one size per video")
        items.append(Media(row, frames, spec.grids[row]))
        row += frames
    return items


def media_shards(num_media: int, cp: int) -> list[tuple[int, int]]:
    """[start, stop) of the media items each rank encodes: by count, the remainder on the last rank; with
    fewer items than ranks, one item each and nothing (so a placeholder) on the ranks left over."""
    per_rank = max(num_media // cp, 1)
    starts = [min(rank * per_rank, num_media) for rank in range(cp)]
    return list(zip(starts, starts[1:] + [num_media]))


def tower_patches(rows: torch.Tensor, media: Media, patch_dim: int) -> torch.Tensor:
    """A media item's rows [frames * h * w, C*P*P] in vdpcp's order -> [t * H * W, C*T*P*P] in the tower's."""
    P, (gh, gw) = patch_dim, media.grid
    frames = rows.reshape(media.frames, gh, gw, CHANNELS, P, P)
    short = -media.frames % TEMPORAL_PATCH
    if short:  # the processors' rule: repeat the last frame up to a whole temporal patch
        frames = torch.cat([frames, frames[-1:].expand(short, *frames.shape[1:])])
    # Zero patches at the bottom and right make an odd grid even; F.pad lists the last dimension first.
    frames = F.pad(frames, (0, 0, 0, 0, 0, 0, 0, gw % MERGE, 0, gh % MERGE))
    t, H, W = media.grid_thw
    windows = frames.reshape(t, TEMPORAL_PATCH, H // MERGE, MERGE, W // MERGE, MERGE, CHANNELS, P, P)
    return windows.permute(0, 2, 4, 3, 5, 6, 1, 7, 8).reshape(t * H * W, CHANNELS * TEMPORAL_PATCH * P * P)


# The sizes of the tower: the toy one (CPU CI), and the published Qwen2.5-VL-7B vision tower's (its config.json's
# vision_config: 670M parameters, patch 14, windows of 112 px, full attention in blocks 7, 15, 23 and 31).
SIZES = {
    # Windows of 2x2 merged tokens (4x4 patches): every image larger than that attends in several windows in
    # block 0, and as a whole in block 1 (full attention).
    "toy": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                window_size=2 * MERGE, fullatt_block_indexes=[1]),
    "real": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                 window_size=112 // 14, fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
}
REAL_PATCH = 14


def tower_config(patch_dim: int, size: str = "toy"):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    dims = dict(SIZES[size])
    window = dims.pop("window_size") * patch_dim  # in pixels, as the config takes it: patches x patch side
    return Qwen2_5_VLVisionConfig(patch_size=patch_dim, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH,
                                  in_channels=CHANNELS, window_size=window, **dims)


def built(cls, config, seed: int, dtype, device, toy: bool = True):
    """A transformers model from ``config`` with weights drawn from ``seed`` (the same on every rank), at ``dtype`` on
    ``device``: the toy size on the CPU generator, a real size on the device it runs on (vdpcp.feature.model.seeded)."""
    from vdpcp.feature.model import seeded

    with seeded(seed, None if toy else device):
        # SDPA runs float64 through in float64 (eager's softmax rounds to float32) and bfloat16 on CPU.
        model = cls._from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype)


def param_count(cls, config) -> int:
    """Parameters of a transformers model from ``config``, counted on the meta device (nothing allocated), once per
    class and config: every case is sized before it runs, and building a real-size tower's modules, even on the
    meta device, is most of what sizing it costs."""
    key = (cls, config.to_json_string())
    if key not in _COUNTED:
        with torch.device("meta"):
            _COUNTED[key] = sum(p.numel() for p in cls._from_config(config).parameters())
    return _COUNTED[key]


_COUNTED: dict[tuple, int] = {}


def seed_of(case) -> int:
    """The toy tower's weights follow the spec's seed; a real-size tower is one model for every microbatch."""
    return case.spec.seed if case.tower == "toy" else 0


def local_inputs(inputs: TowerInputs, start: int, stop: int) -> TowerInputs:
    """The media items [start, stop) of the microbatch, or one placeholder where there are none."""
    if start == stop:
        t, h, w = PLACEHOLDER_GRID
        zeros = inputs.pixel_values.new_zeros(t * h * w, inputs.pixel_values.shape[1])
        return TowerInputs(zeros, torch.tensor([PLACEHOLDER_GRID], dtype=torch.int64, device=inputs.grid_thw.device))
    offsets = inputs.patch_offsets()
    return TowerInputs(inputs.pixel_values[offsets[start] : offsets[stop]], inputs.grid_thw[start:stop])


def gather_features(local: torch.Tensor, kept: list[int], group) -> torch.Tensor:
    """Each rank's first ``kept[rank]`` rows, in rank order, on every rank of ``group``; autograd-aware."""
    return _GatherFeatures.apply(local, list(kept), group)


class _GatherFeatures(torch.autograd.Function):
    """Shards padded to the longest and all-gathered; backward: every rank's gradient summed over the group,
    this rank's rows of it.

    Plain ``dist.all_gather`` and ``dist.all_reduce`` on ``group``, because they are what every torch from the
    declared floor on has, on gloo and NCCL alike, on any subgroup: torch's functional ``all_gather_single``
    is not in torch 2.11; gloo has no list ``reduce_scatter`` in torch 2.6; ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` warn that they are deprecated from 2.14; and torch.distributed.nn's all_gather,
    on gloo, scatters its backward from group rank i as if it were global rank i, which fails on every CP group
    of a CP x DP layout but the first.
    """

    @staticmethod
    def forward(ctx, local, kept, group):
        longest = max(*kept, PLACEHOLDER_TOKENS)  # the same on every rank: none holds more, placeholders included
        padded = F.pad(local, (0, 0, 0, longest - local.shape[0])).contiguous()
        shards = [torch.empty_like(padded) for _ in kept]
        dist.all_gather(shards, padded, group=group)
        rank = dist.get_rank(group)
        ctx.group, ctx.rows, ctx.start, ctx.kept = group, local.shape[0], sum(kept[:rank]), kept[rank]
        return torch.cat([shard[:n] for shard, n in zip(shards, kept)])

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        own = summed[ctx.start : ctx.start + ctx.kept]
        return F.pad(own, (0, 0, 0, ctx.rows - own.shape[0])), None, None


class Qwen25VLSizing(Sizing):
    """What the Qwen2.5-VL tower costs a case (vdpcp.matrix.budget), at the case's tower size."""

    def full_attention(self, case) -> tuple[int, int]:
        dims = SIZES[case.tower]  # the other blocks attend within windows of 8 x 8 patches at most
        return len(dims["fullatt_block_indexes"]), dims["num_heads"]

    def param_count(self, case) -> int:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return param_count(Qwen2_5_VisionTransformerPretrainedModel, tower_config(case.spec.patch_dim, case.tower))

    def patch_bytes(self, case) -> int:
        """One arm's bytes per patch (vdpcp.matrix.budget): each patch enters the tower twice over in time, and inputs()'s
        cat, pad and permute copy it again, with their gradients (about 12 elements per pixel value); each block
        keeps about 13 x hidden + 4 x intermediate elements a patch for its backward (norms, qkv, q and k rotated in
        float32, attention, projection, the gated MLP). Toy size, measured (float64, the slope of one arm's peak
        RSS): 80.8 KB a patch at P=16; this says 84.5 KB."""
        itemsize = {"float64": 8, "float32": 4, "bfloat16": 2}[case.dtype]
        dims = SIZES[case.tower]
        blocks = dims["depth"] * (13 * dims["hidden_size"] + 4 * dims["intermediate_size"])
        return itemsize * (12 * CHANNELS * case.spec.patch_dim**2 + blocks)


class Qwen25VL(Implementation):
    name = "qwen2_5_vl"
    splits = ("count",)
    pixel_grads = True  # its split takes views of the pixels: gradients reach every real patch
    loader_pixels = "host"  # its split is vdpcp's adapter's: it slices a loader's host pixels, then moves its share
    # Its tubelets are always 2 frames (the Conv3d's depth), whatever a spec's T: videos are drawn at T 1 or 2.
    media = MediaAxes(temporal_patch_sizes=(1, TEMPORAL_PATCH))
    towers = {"toy": media, "real": MediaAxes(patch_dim=REAL_PATCH, temporal_patch_sizes=(1, TEMPORAL_PATCH))}
    preload = (MODELING,)  # 2-4 s to import, and it starts no threads: the rank zygote imports it once
    sizing = Qwen25VLSizing()

    def build_model(self, case, dtype, device):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return built(Qwen2_5_VisionTransformerPretrainedModel, tower_config(case.spec.patch_dim, case.tower),
                     seed_of(case), dtype, device, case.tower == "toy")

    def model_key(self, case):
        return case.tower, case.spec.patch_dim, seed_of(case)

    def inputs(self, batch) -> TowerInputs:
        spec, cu = batch.spec, batch.cu_seqlens.tolist()
        items = media_items(spec)
        patches = [tower_patches(batch.patches[0, cu[m.first_row] : cu[m.first_row + m.frames]], m, spec.patch_dim)
                   for m in items]
        width = CHANNELS * TEMPORAL_PATCH * spec.patch_dim**2
        grid_thw = torch.tensor([m.grid_thw for m in items], dtype=torch.int64, device=batch.cu_seqlens.device)
        return TowerInputs(torch.cat(patches) if patches else batch.patches.new_zeros(0, width), grid_thw.reshape(-1, 3))

    def encode(self, model, inputs: TowerInputs) -> torch.Tensor:
        # a loader's host pixels moved here (transformers' tower casts them itself, not moves them)
        return model(inputs.pixel_values.to(model.device, non_blocking=True), inputs.grid_thw).pooler_output

    def encode_sharded(self, model, inputs: TowerInputs, config, group) -> torch.Tensor:
        if group is not None or config.shard_vision:  # a mismatch raises even where sharding is off
            check_group(config, dist.get_world_size(group), self.name)
        if not config.shard_vision:
            return self.encode(model, inputs)
        grids = [tuple(g) for g in inputs.grid_thw.tolist()]
        shards = media_shards(len(grids), dist.get_world_size(group))
        local = self.encode(model, local_inputs(inputs, *shards[dist.get_rank(group)]))
        kept = [sum(merged_tokens(g) for g in grids[start:stop]) for start, stop in shards]
        return self.gather(local, kept, group)

    def gather(self, local: torch.Tensor, kept: list[int], group) -> torch.Tensor:
        return gather_features(local, kept, group)

    def plan(self, spec, config) -> Ownership | None:
        if not config.shard_vision:
            return None
        items = media_items(spec)
        shards = media_shards(len(items), config.context_parallel_size)
        owner, tokens = [0] * len(spec.images), [0] * len(spec.images)
        for rank, (start, stop) in enumerate(shards):
            for m in items[start:stop]:
                owner[m.first_row : m.first_row + m.frames] = [rank] * m.frames
                tokens[m.first_row] = m.tokens
        return Ownership(tuple(owner), tuple(tokens), tuple(int(start == stop) for start, stop in shards))

    def known_limit(self, case, backend: str) -> KnownLimit | None:
        if not case.spec.images:
            return EMPTY_MICROBATCH
        if case.dtype == "float64" and case.grads and case.cp > 1 and not case.config.shard_vision \
                and sketch.pays(self.sizing.param_count(case)):
            return FLOAT32_INSIDE
        return None


qwen2_5_vl = Qwen25VL()
