"""Megatron-Bridge's released Qwen3-VL vision DP over CP, run as released: ``Qwen3VLModel.forward`` itself.

Code under test, called and never patched or copied: ``Qwen3VLModel.forward`` of the installed megatron-bridge
(``megatron/bridge/models/qwen_vl/modelling_qwen3_vl/model.py``; requirements/no-deps.txt pins 0.6.2), imported by
``vdpcp.impls.bridge_release`` without the package ``__init__``s that need Transformer Engine. Every line of its
vision section is the release's own: ``reorganize_inputs``, with ``vision_dp_when_cp`` at CP > 1
``qwen3vl_cp_split`` (each video cut into its temporal patches, whole images and frames dealt by count, the
remainder to the first ranks), ``get_vision_cp_data`` and ``collapse_thw``, the tower on this rank's share, the
empty embeddings a rank with no image makes instead (its dtype as the release writes it),
``ensure_requires_grad_for_cp_collective`` where the release has it, ``AllGatherVisionEmbeddings.apply`` (called as
the release calls it), the merge into the text embeddings, the language model's zigzag CP split and
``split_deepstack_embs``.

Which parts of the model are vdpcp's, and why:

- the instance is built around the parts the forward reads (``forward`` is not ``__init__``): Bridge's
  ``__init__`` builds its own MCore vision model from Transformer Engine's layer spec
  (``get_vit_layer_with_transformer_engine_spec``, ``TENorm``, ``TEColumnParallelLinear``), which raises without
  Transformer Engine (tests/impls/test_bridge_qwen3_vl.py shows it), and a whole MCore language model;
- its ``vision_model`` is transformers' ``Qwen3VLVisionModel`` (the Qwen3-VL tower vdpcp.impls.automodel holds,
  at its toy size and at Qwen3-VL-8B's), called as Bridge calls its own: ``vision_model(hidden_states=,
  grid_thw=)`` -> (merged features, DeepStack levels);
- its ``config`` is Bridge's ``Qwen3VLTransformerConfig`` (``vision_dp_when_cp``, ``params_dtype`` the case's);
- its ``language_model`` is a probe (``LanguageProbe``): its ``embedding`` gives the text stream (zeros), and
  its forward receives what Bridge hands its language model (this rank's zigzag shard of the merged embeddings,
  and this rank's DeepStack rows with their positions), gathers them back over the CP group with vdpcp's own
  autograd gather (vdpcp.feature.comm: its backward sums the gradient over the ranks, as the language model's loss on
  each rank reads its own shard) and un-zigzags them: the vision rows in global order are the outputs
  (``features``, ``deepstack0``...). Its gather is the observation, never Bridge's.

With the feature off (a configured CP of 1, or the opt-out) Bridge's model is handed a CP group of this rank alone
(``ONE_RANK``): its vision section runs the very lines it runs at any CP size with the feature off (the split and
the gather sit behind ``cp_size > 1 and vision_dp_when_cp``), no collective is issued, as the design asks of a
disabled feature. Bridge's language model would still be CP-split at the opt-out, but that split is the language
model's, not the vision section's; through it each rank's tower would get gradients only from the tokens its own
shard holds, where vdpcp's opt-out holds each rank to its own loss over every output.

A mismatched config: Bridge's forward reads the CP size from its process group alone and checks nothing against
its config; Bridge's set-up builds the group from the config (MCore's ``initialize_model_parallel``), so they
agree by construction. The adapter stands in for that set-up, so it raises ``check_group``'s documented error, on
every rank and before any collective, where the configured CP (above 1) disagrees with the group handed in.

The tower's input is vdpcp.impls.qwen2_5_vl's transform (Qwen3-VL's processors pack patches the same way), split
as Bridge takes it: images (one frame) into ``pixel_values``, videos into ``pixel_values_videos``, and the token
ids Bridge finds them by (``input_ids``): per image, and per temporal patch of a video, a vision-start token, its
merged tokens and a vision-end token, in the microbatch's media order, text up to a multiple of 2 x CP.

``torch.cuda.nvtx`` marks the forward's phases: a CUDA build of torch is needed (on a CPU-only build it raises),
as it is for Bridge itself.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vdpcp.contract.protocol import MAIN_OUTPUT, Implementation, MediaAxes, Ownership, check_group
from vdpcp.feature import comm
from vdpcp.feature.layout import zigzag_positions
from vdpcp.impls import automodel, bridge_release
from vdpcp.impls.qwen2_5_vl import MERGE, TEMPORAL_PATCH, TowerInputs, built, media_items, qwen2_5_vl, seed_of

MODEL, UTILS = bridge_release.QWEN3_VL_MODULES
# The token ids of the probe's vocabulary (Bridge's config takes any ids).
TEXT, VISION_START, VISION_END, IMAGE, VIDEO = range(5)
VOCAB = 5


class OneRank:
    """A process group of this rank alone, for Bridge's forward with the feature off: it asks a group its size and
    this rank's place in it, and issues no collective on a group of one."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


ONE_RANK = OneRank()


@dataclass(frozen=True)
class BridgeInputs:
    """The tower's input in media order, and which media items are videos (more than one frame)."""

    tower: TowerInputs
    videos: tuple[bool, ...]


class BridgeVisionModel(torch.nn.Module):
    """A Qwen3-VL tower called as Bridge calls its vision model: (merged features, DeepStack levels)."""

    def __init__(self, tower: torch.nn.Module):
        super().__init__()
        self.tower = tower

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor):
        out = self.tower(hidden_states, grid_thw=grid_thw, return_dict=True)
        return out.pooler_output, list(out.deepstack_features or [])


@dataclass(frozen=True)
class Watch:
    """What the probe needs to put a call's shards back in order: the group Bridge split over, and the global
    sequence's vision positions."""

    group: object
    vision: torch.Tensor  # [sequence] bool


class LanguageProbe(torch.nn.Module):
    """Stands where Bridge's language model stands: text embeddings in, and what Bridge hands it, gathered back."""

    def __init__(self, config, levels: int):
        super().__init__()
        self.config = config  # Bridge reads its hidden size for a rank's empty DeepStack levels
        self.rotary_pos_emb = SimpleNamespace(is_thd_format=False)  # Bridge sets its layout flag
        self.levels = levels
        self.register_buffer("text", torch.zeros(VOCAB, config.hidden_size), persistent=False)  # the tower's dtype
        self.watch: Watch | None = None

    def embedding(self, input_ids: torch.Tensor, position_ids=None) -> torch.Tensor:
        return F.embedding(input_ids, self.text).transpose(0, 1)  # [sequence, batch, hidden], as MCore's

    def forward(self, *, decoder_input, visual_pos_masks=None, deepstack_visual_embeds=None, **_) -> dict:
        watch = self.watch
        merged = self._whole(decoder_input[:, 0], watch)
        out = {MAIN_OUTPUT: merged[watch.vision]}
        levels = deepstack_visual_embeds or [merged.new_zeros(0, merged.shape[-1])] * self.levels
        for k, level in enumerate(levels):
            out[f"deepstack{k}"] = self._vision_rows(level, watch)
        return out

    @staticmethod
    def _whole(shard: torch.Tensor, watch: Watch) -> torch.Tensor:
        """The merged embeddings of the whole sequence, from every rank's zigzag shard."""
        cp = watch.group.size()
        if cp == 1:
            return shard
        length = watch.vision.numel()
        gathered = comm.gather_features(shard, [length // cp] * cp, watch.group)
        return gathered[_rank_order(length, cp).argsort().to(gathered.device)]

    @staticmethod
    def _vision_rows(rows: torch.Tensor, watch: Watch) -> torch.Tensor:
        """One DeepStack level's vision rows in sequence order, from each rank's rows at its own positions."""
        cp = watch.group.size()
        if cp == 1:
            return rows
        length, vision = watch.vision.numel(), watch.vision
        held = [zigzag_positions(length, cp, r).to(vision.device) & vision for r in range(cp)]  # positions on the CPU
        gathered = comm.gather_features(rows, [int(h.sum()) for h in held], watch.group)
        index = vision.cumsum(0) - 1  # a vision position's row among the vision rows
        return gathered[torch.cat([index[h] for h in held]).argsort()]


def _rank_order(length: int, cp: int) -> torch.Tensor:
    """The sequence positions in the order the ranks' zigzag shards hold them, rank after rank."""
    return torch.cat([zigzag_positions(length, cp, r).nonzero().flatten() for r in range(cp)])


def released_model(release, tower: torch.nn.Module, vision_config, dtype: torch.dtype) -> torch.nn.Module:
    """Bridge's ``Qwen3VLModel`` of ``release`` around ``tower`` and a language probe: the attributes its forward
    reads, set as its ``__init__`` sets them (which cannot run here: module docstring)."""
    from megatron.core.transformer import MegatronModule

    config = bridge_config(release, vision_config, dtype)
    cls = release[MODEL].Qwen3VLModel
    model = cls.__new__(cls)
    MegatronModule.__init__(model, config=config)
    model.vision_transformer_config = vision_config
    model.pre_process = model.post_process = model.add_encoder = model.add_decoder = True
    model.encoder_hidden_state = None
    model.image_token_id, model.video_token_id = config.image_token_id, config.video_token_id
    model.vision_start_token_id = config.vision_start_token_id
    model.square_merge_size = vision_config.spatial_merge_size**2
    model.share_embeddings_and_output_weights = False
    model.use_dist_train = False
    model.vp_stage, model.vp_size = None, config.virtual_pipeline_model_parallel_size
    _set_groups(model, ONE_RANK)
    model.vision_model = BridgeVisionModel(tower)
    model.language_model = LanguageProbe(config, len(vision_config.deepstack_visual_indexes))
    return model


def bridge_config(release, vision_config, dtype: torch.dtype):
    """Bridge's Qwen3-VL config for a language model as wide as the tower's output (one layer: it never runs)."""
    hidden = vision_config.out_hidden_size
    return release[MODEL].Qwen3VLTransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        vocab_size=VOCAB, patch_size=vision_config.patch_size, temporal_patch_size=vision_config.temporal_patch_size,
        spatial_merge_size=vision_config.spatial_merge_size, out_hidden_size=hidden,
        deepstack_visual_indexes=list(vision_config.deepstack_visual_indexes), image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_dp_when_cp=True,
        calculate_per_token_loss=True)  # Bridge's __init__ asserts it for CP > 1


def _set_groups(model, cp_group) -> None:
    """Bridge's process groups, as its ``__init__`` keeps them: CP the one given, tensor and pipeline of one rank."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    model.pg_collection = ProcessGroupCollection(cp=cp_group, tp=ONE_RANK, pp=ONE_RANK, embd=None)
    model.cp_group, model.tp_group, model.pp_group, model.embd_group = cp_group, ONE_RANK, ONE_RANK, None


def token_ids(inputs: BridgeInputs, cp: int, device) -> torch.Tensor:
    """[1, sequence]: per image and per temporal patch of a video, vision-start, its merged tokens, vision-end; text
    after, up to a multiple of 2 x ``cp`` (Bridge's zigzag split takes 2 x CP equal chunks)."""
    ids = []
    for (t, h, w), video in zip(inputs.tower.grid_thw.tolist(), inputs.videos):
        for _ in range(t):
            ids += [VISION_START] + [VIDEO if video else IMAGE] * (h * w // MERGE**2) + [VISION_END]
    ids += [TEXT] * (-len(ids) % (2 * cp))
    return torch.tensor([ids], dtype=torch.long, device=device)


def forward_arguments(inputs: BridgeInputs, cp: int) -> dict:
    """Bridge's forward arguments: token ids, and the images' and the videos' patches and grids apart."""
    pixels, grids = inputs.tower.pixel_values, inputs.tower.grid_thw
    offsets = inputs.tower.patch_offsets()
    args = {"input_ids": token_ids(inputs, cp, pixels.device)}
    for kind, video in (("", False), ("_videos", True)):
        items = [m for m, v in enumerate(inputs.videos) if v == video]
        if items:
            args[f"pixel_values{kind}"] = torch.cat([pixels[offsets[m] : offsets[m + 1]] for m in items])
            args["video_grid_thw" if video else "image_grid_thw"] = grids[items]
    return args


class BridgeQwen3VL(Implementation):
    """Bridge's ``Qwen3VLModel.forward`` of one release (``version`` None: the installed one)."""

    splits = ("count",)
    preload = (automodel.MODELING,)
    loader_pixels = "device"  # Bridge's data step moves each batch to the device before the model
    empty_rank_may_skip = True  # Bridge skips the tower on a rank with no image; transformers' holds no collective
    # Automodel's tower and input transform; the merged embeddings Bridge adds are a few rows of the language model's
    # width per token, within its estimate.
    sizing = automodel.Qwen3VLSizing()
    towers = {size: MediaAxes(patch_dim=patch, temporal_patch_sizes=(1, TEMPORAL_PATCH), min_grid=MERGE,
                              even_grids=True)  # Qwen3-VL's processors resize images to whole merge windows
              for size, patch in (("toy", automodel.PATCH), ("real", automodel.REAL_PATCH))}
    media = towers["toy"]

    def __init__(self, name: str, version: str | None = None):
        self.name, self.version = name, version

    def release(self):
        return bridge_release.load(self.version)

    def build_model(self, case, dtype, device):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        vision_config = automodel.tower_config(case.spec.patch_dim, case.tower)
        tower = built(Qwen3VLVisionModel, vision_config, seed_of(case), dtype, device, case.tower == "toy")
        return released_model(self.release(), tower, vision_config, dtype).to(device=device, dtype=dtype)

    def model_key(self, case):
        return case.tower, case.spec.patch_dim, seed_of(case)

    def inputs(self, batch) -> BridgeInputs:
        return BridgeInputs(qwen2_5_vl.inputs(batch), tuple(frames > 1 for frames in batch.spec.media_frames))

    def encode(self, model, inputs: BridgeInputs) -> dict[str, torch.Tensor]:
        return self._forward(model, inputs, ONE_RANK, vision_dp_when_cp=False)

    def encode_sharded(self, model, inputs: BridgeInputs, config, group) -> dict[str, torch.Tensor]:
        if group is not None or config.shard_vision:  # a mismatch raises even where sharding is off
            check_group(config, dist.get_world_size(group), self.name)
        if config.strategy not in self.splits:
            raise ValueError(f"{self.name}: split {config.strategy!r} is not Bridge's; expected one of {self.splits}")
        cp_group = group if config.shard_vision else ONE_RANK  # module docstring: the feature off
        return self._forward(model, inputs, cp_group, vision_dp_when_cp=config.vision_dp_over_cp)

    def _forward(self, model, inputs: BridgeInputs, cp_group, vision_dp_when_cp: bool) -> dict[str, torch.Tensor]:
        args = forward_arguments(inputs, cp_group.size())
        model.config.vision_dp_when_cp = vision_dp_when_cp
        with watching(model, cp_group, args["input_ids"][0]), self.release().running():
            return model(**args)

    def plan(self, spec, config) -> Ownership | None:
        """Bridge's own split (the release's ``qwen3vl_cp_split``): ``split_ownership``."""
        if not config.shard_vision:
            return None
        return split_ownership(spec, config.context_parallel_size, self.release()[UTILS].qwen3vl_cp_split)


def split_ownership(spec, cp: int, cp_split) -> Ownership:
    """Whose each microbatch row is under one of Bridge's CP splits (``cp_split``: the release's ``qwen3vl_cp_split``
    or a model's copy of it, called on the microbatch's grids): how many images and temporal patches each rank takes,
    in order; every frame of a temporal patch goes with it."""
    items = media_items(spec)
    units = [(m, k) for m in items for k in range(m.grid_thw[0])]  # (media item, temporal patch)
    if not units:  # Bridge splits nothing: no rank has an image
        return Ownership((), (), (0,) * cp)
    grids = torch.tensor([m.grid_thw for m in items], dtype=torch.long)
    patches = torch.zeros(int(grids.prod(dim=1).sum()), 1)
    _, _, per_rank, _ = cp_split(cp, patches, grids)
    owner, tokens = [0] * len(spec.images), [0] * len(spec.images)
    ranks = [rank for rank, n in enumerate(per_rank) for _ in range(n)]
    for (m, k), rank in zip(units, ranks):
        first = m.first_row + k * TEMPORAL_PATCH
        frames = range(first, min(first + TEMPORAL_PATCH, m.first_row + m.frames))
        owner[frames.start : frames.stop] = [rank] * len(frames)
        tokens[first] = m.tokens // m.grid_thw[0]
    return Ownership(tuple(owner), tuple(tokens), (0,) * cp)


@contextmanager
def watching(model, cp_group, input_ids: torch.Tensor):
    """Bridge's groups and the probe's watch for one call; after it the model holds no live process group (a model
    holding one cannot be copied: the exact run's float64 copy)."""
    _set_groups(model, cp_group)
    model.language_model.watch = Watch(cp_group, (input_ids == IMAGE) | (input_ids == VIDEO))
    try:
        yield
    finally:
        model.language_model.watch = None
        _set_groups(model, ONE_RANK)


bridge_qwen3_vl = BridgeQwen3VL("bridge-qwen3-vl")
# The released 0.5.0, a regression fixture (requirements/releases.txt): vdpcp must report its two shipped bugs.
bridge_qwen3_vl_0_5_0 = BridgeQwen3VL("bridge-qwen3-vl-0.5.0", "0.5.0")
