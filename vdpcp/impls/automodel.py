"""NeMo Automodel's frame-level CP vision sharding around transformers' Qwen3-VL vision tower, as Implementations.

Both are code under test, called and never patched: ``maybe_distribute_visual`` from nemo-automodel 0.7.0
(``nemo_automodel/components/distributed/cp_vision_frame_shard.py``, installed without its dependencies: see
requirements/no-deps.txt) and ``Qwen3VLVisionModel`` from transformers (a tiny random config, DeepStack on: two
DeepStack mergers besides the main one).

Enabled as Automodel's VLM recipe enables it (``recipes/vlm/finetune.py``, ``_cp_vision_frame_sharding_context``):
where the CP group has more than one rank, ``set_cp_vision_group(cp_group, config=CpVisionFrameShardingConfig(...))``
is in force around the forward and ``reset_cp_vision_group`` restores the previous scope after it; at CP=1 nothing
is published. Inside, the tower is called as Automodel's Qwen3-VL model code calls it
(``components/models/qwen3_vl/model.py``, ``_prepare_visual_inputs_for_cp``): one ``maybe_distribute_visual(visual,
pixel_values.type(visual.dtype), grid_thw)`` for images and videos together. That model file itself does not
import against transformers 5.23 (it imports ``Qwen3VLCausalLMOutputWithPast``, which 5.23's modeling_qwen3_vl
does not have), so its one call is made here.

What Automodel then does, for the report's reader (vdpcp checks it, it does not restate it): each media item's
temporal patches are independent frame units (Qwen3-VL attends per frame, with spatial-only positions); below
its size thresholds every rank encodes everything; with fewer units than ranks it adds 1-token zero frames so
every rank encodes one unit; otherwise it cuts the units into contiguous per-rank runs balanced by
p * (p + 3 x vision hidden); a rank with real frames below 96 patch rows appends zero frames, dropped again; one
autograd all-gather (reduce-scatter SUM backward) restores the merged features and every DeepStack level.

That partition is Automodel's private ``_contiguous_balanced_bounds``, so there is no ``plan``: vdpcp infers who
encoded what from the input gradients (``media_tokens`` says only how many rows each media item gives). The
shipped thresholds' decision has no public function either, so ``replicated`` states it from Automodel's own
config fields (which rows of the matrix must replicate); the matrix holds that statement to what each rank's tower
really encoded.

The tower's input is Qwen2.5-VL's (transformers maps Qwen3-VL to the same image processor, and its video
processor packs patches in the same order): ``vdpcp.impls.qwen2_5_vl``'s transform is reused, and
tests/impls/test_automodel.py checks it against Qwen3-VL's own processors.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from vdpcp.contract.protocol import MAIN_OUTPUT, Balance, Implementation, KnownLimit, MediaAxes, check_group
from vdpcp.contract.sizing import Sizing
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls.qwen2_5_vl import (
    CHANNELS,
    MERGE,
    TEMPORAL_PATCH,
    TowerInputs,
    built,
    media_items,
    param_count,
    qwen2_5_vl,
    seed_of,
)

MODELING = "transformers.models.qwen3_vl.modeling_qwen3_vl"
SHARDING = "nemo_automodel.components.distributed.cp_vision_frame_shard"
# Pixels per patch side. Qwen3-VL's is 16, but the patch size only sets the patch embedding's width: at 16, CPU
# float64's slow_conv3d took half the tower's forward time on the 8k-patch threshold microbatches, so the tiny
# tower takes the toy tower's 4 (the matrix's sizes as drawn).
PATCH = 4
DEEPSTACK_LAYERS = (0, 1)  # of 3 blocks: each feeds a DeepStack merger, as layers 8/16/24 of 27 do in Qwen3-VL-4B
# Automodel's name for its partition: contiguous runs of frame units balanced by cost (_contiguous_balanced_bounds).
SPLIT = "contiguous-balanced"

EMPTY_MICROBATCH = KnownLimit(
    "qwen3-empty-microbatch",
    "transformers' Qwen3-VL vision tower cannot encode zero media items: with an empty grid_thw its forward "
    "raises where it resamples its position grid (get_vision_interpolation_indices_and_weights' repeat_interleave "
    "of no counts, or in older transformers fast_pos_embed_interpolate's torch.cat of no tensors), and Automodel's "
    "maybe_distribute_visual keeps that replicated call when there are no frames; a VLM skips the tower instead",
    "repeats must have the same size as input along dim",
    alternatives=("expected a non-empty list of Tensors",),
)


# The sizes of the tower: the toy one (CPU CI: an 8x8 learned position grid, bilinearly resampled to every image's
# patch grid), and the published Qwen3-VL-8B vision tower's (its config.json's vision_config: 27 blocks, DeepStack
# from blocks 8, 16 and 24, a 48x48 position grid, patch 16, into the 4096-wide LM).
SIZES = {
    "toy": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                num_position_embeddings=64, deepstack_visual_indexes=list(DEEPSTACK_LAYERS)),
    "real": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                 num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
}
REAL_PATCH = 16


def tower_config(patch_dim: int, size: str = "toy"):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    return Qwen3VLVisionConfig(in_channels=CHANNELS, patch_size=patch_dim, spatial_merge_size=MERGE,
                               temporal_patch_size=TEMPORAL_PATCH, **SIZES[size])


def outputs(tower_output) -> dict[str, torch.Tensor]:
    """The merged features and every DeepStack level, all over the same merged-token rows."""
    deepstack = tower_output.deepstack_features or []
    return {MAIN_OUTPUT: tower_output.pooler_output, **{f"deepstack{k}": d for k, d in enumerate(deepstack)}}


class Qwen3VLSizing(Sizing):
    """What the Qwen3-VL tower costs a case (vdpcp.matrix.budget), at the case's tower size."""

    def full_attention(self, case) -> tuple[int, int]:
        dims = SIZES[case.tower]  # every block attends over the whole frame
        return dims["depth"], dims["num_heads"]

    def param_count(self, case) -> int:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return param_count(Qwen3VLVisionModel, tower_config(case.spec.patch_dim, case.tower))

    def patch_bytes(self, case) -> int:
        """One arm's bytes per patch (vdpcp.matrix.budget): the input transform's copies (Qwen2.5-VL's, about 12 elements
        per pixel value), and per block about 13 x hidden + 2 x intermediate elements kept for backward (norms,
        qkv, rotated q and k in float32, attention, projection, the MLP's two activations)."""
        itemsize = {"float64": 8, "float32": 4, "bfloat16": 2}[case.dtype]
        dims = SIZES[case.tower]
        blocks = dims["depth"] * (13 * dims["hidden_size"] + 2 * dims["intermediate_size"])
        return itemsize * (12 * CHANNELS * case.spec.patch_dim**2 + blocks)


class Automodel(Implementation):
    """Automodel's frame sharding with ``thresholds`` (keyword arguments of CpVisionFrameShardingConfig) changed
    from its released defaults; none changed is Automodel as shipped."""

    splits = (SPLIT,)
    loader_pixels = "device"  # Automodel's recipe moves each batch to the device before the model; its model casts
    pixel_grads = True  # its split slices the pixels it is handed; gradients reach them through the tower
    preload = (MODELING, SHARDING)  # the rank zygote imports them once (it refuses a preload that starts a thread)
    sizing = Qwen3VLSizing()

    def __init__(self, name: str, **thresholds):
        self.name = name
        self.thresholds = thresholds

    @property
    def media(self) -> MediaAxes:
        return self.towers["toy"]

    @property
    def towers(self) -> dict[str, MediaAxes]:
        # Below min_local_patch_rows a rank with real frames pads locally: the matrix adds microbatches above it.
        floor = self.frame_sharding(True).min_local_patch_rows
        return {size: MediaAxes(patch_dim=patch, temporal_patch_sizes=(1, TEMPORAL_PATCH), min_grid=MERGE,
                                min_rows_per_rank=floor) for size, patch in (("toy", PATCH), ("real", REAL_PATCH))}

    def frame_sharding(self, enabled: bool):
        from nemo_automodel.components.distributed.cp_vision_frame_shard import CpVisionFrameShardingConfig

        return CpVisionFrameShardingConfig(enabled=enabled, **self.thresholds)

    def build_model(self, case, dtype, device):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return built(Qwen3VLVisionModel, tower_config(case.spec.patch_dim, case.tower), seed_of(case), dtype, device,
                     case.tower == "toy")

    def model_key(self, case):
        return case.tower, case.spec.patch_dim, seed_of(case)

    def inputs(self, batch) -> TowerInputs:
        return qwen2_5_vl.inputs(batch)

    def encode(self, model, inputs: TowerInputs) -> dict[str, torch.Tensor]:
        return outputs(model(inputs.pixel_values, grid_thw=inputs.grid_thw, return_dict=True))

    def encode_sharded(self, model, inputs: TowerInputs, config, group) -> dict[str, torch.Tensor]:
        from nemo_automodel.components.distributed import cp_vision_frame_shard as automodel

        if group is not None or config.shard_vision:  # a mismatch raises even where sharding is off
            check_group(config, dist.get_world_size(group), self.name)
        if config.strategy not in self.splits:
            raise ValueError(f"{self.name}: split {config.strategy!r} is not Automodel's; expected one of {self.splits}")
        # The recipe publishes only where its configured CP is above 1 (it builds the CP group from that config): a
        # configured CP of 1 is the feature off, whatever group vdpcp hands in (the design's no-op).
        publish = group is not None and config.context_parallel_size > 1
        token = automodel.set_cp_vision_group(group, config=self.frame_sharding(config.vision_dp_over_cp)) \
            if publish else None
        try:
            return outputs(automodel.maybe_distribute_visual(model, inputs.pixel_values.type(model.dtype), inputs.grid_thw))
        finally:
            if publish:
                automodel.reset_cp_vision_group(token)

    def replicated(self, spec, config) -> str | None:
        """Why Automodel encodes this microbatch whole on every rank although sharding is on, or None.

        Its rule (maybe_distribute_visual; no public function decides it): replicated when the merged tokens are
        below ``min_tokens`` AND the frame units (temporal patches) below ``min_frames``, or there are no frames.
        """
        if not config.shard_vision:
            return None
        items = media_items(spec)
        units, tokens = sum(m.grid_thw[0] for m in items), sum(m.tokens for m in items)
        policy = self.frame_sharding(True)
        if units == 0:
            return "no frames: Automodel keeps the replicated call"
        if tokens < policy.min_tokens and units < policy.min_frames:
            return (f"{tokens} merged tokens < min_tokens={policy.min_tokens} and {units} frames < "
                    f"min_frames={policy.min_frames}: Automodel replicates small visual workloads")
        return None

    def balance(self, case) -> Balance:
        """Automodel's objective (``_contiguous_balanced_bounds``): contiguous runs of frame units (a temporal patch
        of 2 frames, an image) balanced by p * (p + alpha), p a unit's patches (its grid padded to even, as the
        tower takes it), alpha 3 x the vision hidden size (its ``cost_alpha="auto"``)."""
        return Balance(functools.partial(frame_cost, 3 * SIZES[case.tower]["hidden_size"]), contiguous=True,
                       frames_per_unit=TEMPORAL_PATCH)

    def media_tokens(self, spec) -> tuple[int, ...]:
        """Each media item's merged tokens, as the tower returns them (its grid padded to even, 2x2 merged)."""
        return tuple(m.tokens for m in media_items(spec))

    def known_limit(self, case, backend: str) -> KnownLimit | None:
        return EMPTY_MICROBATCH if not case.spec.images else None

    def scenarios(self) -> tuple:
        """Microbatches just below and just above each of its thresholds, so the decision itself is tested."""
        return threshold_scenarios(self.name, self.frame_sharding(True))


def frame_cost(alpha: int, rows: int, cols: int) -> int:
    """A frame unit's cost to Automodel's partition: p * (p + alpha), p its patches padded to even grid sides."""
    p = (rows + rows % MERGE) * (cols + cols % MERGE)
    return p * (p + alpha)


TOKEN_THRESHOLD_CPS = (2,)


def threshold_scenarios(name: str, policy) -> tuple:
    """Automodel replicates below min_tokens merged tokens AND below min_frames frame units: min_tokens - 1 and
    min_tokens tokens in few images; min_frames - 1 and min_frames units of one token each, in one video (frames
    and frame units differ by 2x there; the odd one repeats its last frame). Each pair stays below the other
    threshold, so only its own decides; each microbatch is as small as its threshold allows. Last, a sharded
    microbatch of ragged units, where its partition's cost model decides the cuts."""
    if not policy.min_tokens or not policy.min_frames:
        return ()  # a zero threshold: nothing is replicated, so there is no decision to straddle
    specs = []
    for tokens in (policy.min_tokens - 1, policy.min_tokens):
        grids = token_grids(tokens)
        images = tuple((MERGE * rows * PATCH, MERGE * cols * PATCH) for rows, cols in grids)
        # 8k patches each, the matrix's costliest microbatches: at one CP size (the decision does not depend on it)
        specs.append((MicrobatchSpec(images, patch_dim=PATCH, seed=len(specs) + 1, name=f"{name}-tokens-{tokens}"),
                      TOKEN_THRESHOLD_CPS))
    for units in (policy.min_frames - 1, policy.min_frames):
        frames = TEMPORAL_PATCH * units - (units == policy.min_frames)
        specs.append(MicrobatchSpec(((MERGE * PATCH,) * 2,) * frames, num_frames=(frames,),
                                    temporal_patch_size=TEMPORAL_PATCH, patch_dim=PATCH, seed=len(specs) + 1,
                                    name=f"{name}-frames-{units}"))
    if len(token_grids(policy.min_tokens)) >= policy.min_frames or policy.min_frames >= policy.min_tokens:
        raise ValueError(f"{name}: thresholds {policy} leave no microbatch on one side of one threshold and below "
                         f"the other")
    return tuple(specs) + (ragged_above_thresholds(name, policy.min_frames, len(specs) + 1),)


def ragged_above_thresholds(name: str, min_frames: int, seed: int) -> MicrobatchSpec:
    """One 6x6-patch image, then a video of ``min_frames`` one-token frame units: sharded by the frame count, with
    units of unequal cost. Each threshold microbatch's units are all alike, where any cost that grows with a unit's
    patches cuts the same runs; here p^2 and the declared p * (p + alpha) cut differently at every CP size, and
    p^2 leaves a rank a whole unit over the best partition (the partition-cost-squared mutant's kill)."""
    image = (MERGE * 3 * PATCH,) * 2
    frames = TEMPORAL_PATCH * min_frames
    return MicrobatchSpec((image,) + ((MERGE * PATCH,) * 2,) * frames, num_frames=(1, frames),
                          temporal_patch_size=TEMPORAL_PATCH, patch_dim=PATCH, seed=seed,
                          name=f"{name}-ragged-above-thresholds")


def token_grids(tokens: int, side: int = 16) -> list[tuple[int, int]]:
    """Merged-token grids (rows, cols) of images that hold ``tokens`` in all: side x side each, the rest in one
    image as close to square as its token count allows."""
    full, rest = divmod(tokens, side * side)
    grids = [(side, side)] * full
    if rest:
        rows = max(d for d in range(1, int(rest**0.5) + 1) if rest % d == 0)
        grids.append((rows, rest // rows))
    return grids


# Thresholds 0: every CP > 1 microbatch with a frame shards, so the whole matrix exercises the sharded path.
automodel = Automodel("automodel", min_tokens=0, min_frames=0)
# As released: below 2048 merged tokens and 32 frames it replicates (replicated() says where).
automodel_shipped = Automodel("automodel-shipped")
