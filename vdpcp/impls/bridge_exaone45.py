"""Megatron-Bridge's released EXAONE 4.5 vision DP over CP, run as released: ``Exaone45Model.forward`` itself.

Code under test, called and never patched or copied: ``Exaone45Model.forward`` of the installed megatron-bridge
(``megatron/bridge/models/exaone/exaone45/modelling_exaone45/model.py``), imported by ``vdpcp.impls.bridge_release``
without the package ``__init__``s that need Transformer Engine. Its vision section is the release's own:
``reorganize_inputs``, at CP > 1 ``Exaone45_cp_split`` (each video cut into its temporal patches, whole images and
frames dealt by count, the remainder to the first ranks), ``get_vision_cp_data`` and ``collapse_thw``, the tower on
this rank's share, the empty embeddings a rank with no image makes instead (its dtype as the release writes it),
``AllGatherVisionEmbeddings.apply`` called as the release calls it, the merge into the text embeddings and the
language model's zigzag CP split.

EXAONE 4.5 has no switch for the feature: its forward shards the images whenever its CP group has more than one
rank. So the adapter hands Bridge's forward the case's CP group wherever the configured CP is above 1, the opt-out
included, and a group of this rank alone where the configured CP is 1 (Bridge's set-up builds the group from the
config, so a configured CP of 1 is a group of one).

The parts of the model that are vdpcp's, as in vdpcp.impls.bridge_qwen3_vl and for the same reason (Bridge's
``__init__`` builds its vision model from Transformer Engine's layer spec): the instance is built around the
attributes the forward reads; its ``vision_model`` is transformers' ``Exaone4_5_VisionModel`` (the tower Bridge's
converts from, Qwen2.5-VL's design: windowed attention, full attention in some blocks, a 2x2 merger), called as
Bridge calls its own (``vision_model(hidden_states=, grid_thw=)`` -> merged features); its ``config`` is Bridge's
``Exaone45TransformerConfig``; its ``language_model`` is vdpcp.impls.bridge_qwen3_vl's probe, which gathers what
Bridge hands its language model back over the CP group with vdpcp's own gather and un-zigzags it.

Bridge's provider builds the tower from ``Exaone4_5_VisionConfig()``'s defaults, so those are the real size. The
input is Qwen2.5-VL's transform (transformers registers Qwen2-VL's image and video processors for EXAONE 4.5), with
the token ids Bridge finds the media by (vdpcp.impls.bridge_qwen3_vl.token_ids).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vdpcp.contract.protocol import Implementation, MediaAxes, Ownership, check_group
from vdpcp.contract.sizing import Sizing
from vdpcp.impls import bridge_release
from vdpcp.impls.bridge_qwen3_vl import (
    IMAGE,
    ONE_RANK,
    VIDEO,
    VISION_START,
    VOCAB,
    BridgeInputs,
    LanguageProbe,
    forward_arguments,
    split_ownership,
    watching,
)
from vdpcp.impls.qwen2_5_vl import (
    CHANNELS,
    MERGE,
    TEMPORAL_PATCH,
    built,
    param_count,
    qwen2_5_vl,
    seed_of,
)

EXAONE45 = "megatron.bridge.models.exaone.exaone45.modelling_exaone45"
MODEL, UTILS = f"{EXAONE45}.model", f"{EXAONE45}.utils"
MODELING = "transformers.models.exaone4_5.modeling_exaone4_5"
PATCH = 4

# The toy tower (windows of 2x2 merged tokens, full attention in block 1, grouped-query attention as EXAONE's),
# and the size Bridge's provider builds (Exaone4_5_VisionConfig's defaults).
SIZES = {
    "toy": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_key_value_heads=1,
                out_hidden_size=48, window_size=2 * MERGE, fullatt_block_indexes=[1]),
    "real": None,
}
REAL_PATCH = 14


def tower_config(patch_dim: int, size: str = "toy"):
    from transformers.models.exaone4_5.configuration_exaone4_5 import Exaone4_5_VisionConfig

    if SIZES[size] is None:
        return Exaone4_5_VisionConfig()
    dims = dict(SIZES[size])
    window = dims.pop("window_size") * patch_dim  # in pixels, as the config takes it: patches x patch side
    return Exaone4_5_VisionConfig(patch_size=patch_dim, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH,
                                  in_channels=CHANNELS, window_size=window, **dims)


class ExaoneVisionModel(torch.nn.Module):
    """An EXAONE 4.5 tower called as Bridge calls its vision model: the merged features."""

    def __init__(self, tower: torch.nn.Module):
        super().__init__()
        self.tower = tower

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.tower(hidden_states, grid_thw=grid_thw, return_dict=True).pooler_output


def released_model(release, tower: torch.nn.Module, vision_config, dtype: torch.dtype) -> torch.nn.Module:
    """Bridge's ``Exaone45Model`` around ``tower`` and a language probe: the attributes its forward reads, set as its
    ``__init__`` sets them (which cannot run here: module docstring)."""
    from megatron.core.transformer import MegatronModule

    config = bridge_config(release, vision_config, dtype)
    cls = release[MODEL].Exaone45Model
    model = cls.__new__(cls)
    MegatronModule.__init__(model, config=config)
    model.pre_process = model.post_process = model.add_encoder = model.add_decoder = True
    model.encoder_hidden_state = None
    model.image_token_id, model.video_token_id = config.image_token_id, config.video_token_id
    model.vision_start_token_id = config.vision_start_token_id
    model.position_embedding_type = "rope"  # its provider's default (a field of the provider, not of this config)
    model.spatial_merge_size = vision_config.spatial_merge_size
    model.square_merge_size = vision_config.spatial_merge_size**2
    model.share_embeddings_and_output_weights = False
    model.vp_stage, model.vp_size = None, config.virtual_pipeline_model_parallel_size
    model.vision_model = ExaoneVisionModel(tower)
    model.language_model = LanguageProbe(config, levels=0)
    return model


def bridge_config(release, vision_config, dtype: torch.dtype):
    """Bridge's EXAONE 4.5 config for a language model as wide as the tower's output (one layer: it never runs)."""
    hidden = vision_config.out_hidden_size
    return release[f"{EXAONE45}.transformer_config"].Exaone45TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        vocab_size=VOCAB, patch_size=vision_config.patch_size, temporal_patch_size=vision_config.temporal_patch_size,
        spatial_merge_size=vision_config.spatial_merge_size, out_hidden_size=hidden, image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=VISION_START, calculate_per_token_loss=True)


class Exaone45Sizing(Sizing):
    """What the EXAONE 4.5 tower costs a case (vdpcp.matrix.budget), at the case's tower size."""

    def full_attention(self, case) -> tuple[int, int]:
        config = tower_config(case.spec.patch_dim, case.tower)
        return len(config.fullatt_block_indexes), config.num_heads

    def param_count(self, case) -> int:
        from transformers.models.exaone4_5.modeling_exaone4_5 import Exaone4_5_VisionModel

        return param_count(Exaone4_5_VisionModel, tower_config(case.spec.patch_dim, case.tower))

    def patch_bytes(self, case) -> int:
        """qwen2_5_vl's estimate (the same design of tower, the same input transform), at this tower's sizes."""
        itemsize = {"float64": 8, "float32": 4, "bfloat16": 2}[case.dtype]
        config = tower_config(case.spec.patch_dim, case.tower)
        blocks = config.depth * (13 * config.hidden_size + 4 * config.intermediate_size)
        return itemsize * (12 * CHANNELS * case.spec.patch_dim**2 + blocks)


class BridgeExaone45(Implementation):
    """Bridge's ``Exaone45Model.forward`` of the installed release."""

    splits = ("count",)
    preload = (MODELING,)
    has_opt_out = False  # the release has no switch: it shards at every CP above 1
    loader_pixels = "device"  # Bridge's data step moves each batch to the device before the model
    empty_rank_may_skip = True  # Bridge skips the tower on a rank with no image; transformers' holds no collective
    sizing = Exaone45Sizing()
    towers = {size: MediaAxes(patch_dim=patch, temporal_patch_sizes=(1, TEMPORAL_PATCH), min_grid=MERGE,
                              even_grids=True)  # Qwen2-VL's processors resize images to whole merge windows
              for size, patch in (("toy", PATCH), ("real", REAL_PATCH))}
    media = towers["toy"]

    def __init__(self, name: str):
        self.name = name

    def release(self):
        return bridge_release.load(None, (MODEL, UTILS))

    def build_model(self, case, dtype, device):
        from transformers.models.exaone4_5.modeling_exaone4_5 import Exaone4_5_VisionModel

        vision_config = tower_config(case.spec.patch_dim, case.tower)
        tower = built(Exaone4_5_VisionModel, vision_config, seed_of(case), dtype, device, case.tower == "toy")
        return released_model(self.release(), tower, vision_config, dtype).to(device=device, dtype=dtype)

    def model_key(self, case):
        return case.tower, case.spec.patch_dim, seed_of(case)

    def inputs(self, batch) -> BridgeInputs:
        return BridgeInputs(qwen2_5_vl.inputs(batch), tuple(frames > 1 for frames in batch.spec.media_frames))

    def encode(self, model, inputs: BridgeInputs) -> dict[str, torch.Tensor]:
        return self._forward(model, inputs, ONE_RANK)

    def encode_sharded(self, model, inputs: BridgeInputs, config, group) -> dict[str, torch.Tensor]:
        if group is not None or config.context_parallel_size > 1:  # a mismatch raises even where sharding is off
            check_group(config, dist.get_world_size(group), self.name)
        if config.strategy not in self.splits:
            raise ValueError(f"{self.name}: split {config.strategy!r} is not Bridge's; expected one of {self.splits}")
        # No switch (module docstring): the CP group whenever the configured CP is above 1.
        return self._forward(model, inputs, group if config.context_parallel_size > 1 else ONE_RANK)

    def _forward(self, model, inputs: BridgeInputs, cp_group) -> dict[str, torch.Tensor]:
        args = forward_arguments(inputs, cp_group.size())
        with watching(model, cp_group, args["input_ids"][0]), self.release().running():
            return model(**args)

    def plan(self, spec, config) -> Ownership | None:
        """Bridge's own split (the release's ``Exaone45_cp_split``, a copy of Qwen3-VL's): ``split_ownership``."""
        if config.context_parallel_size == 1:
            return None
        return split_ownership(spec, config.context_parallel_size, self.release()[UTILS].Exaone45_cp_split)


# A regression fixture: vdpcp must report what the released forward does at CP > 1 (docs/known-limits.md).
bridge_exaone45 = BridgeExaone45("bridge-exaone45")
