"""The one protocol an implementation of vision DP over CP meets to be held to vdpcp's matrix.

This module is the bottom of the house: it imports nothing of vdpcp's but the contract's sizing.py (the default
``build_model`` reaches the toy tower lazily), so the case, the oracle, the reference and every adapter can stand on it.

An implementation is an object (subclass ``Implementation``, or any object with ``name``, ``encode`` and
``encode_sharded``) that says:

- which model is under test: ``build_model(case, dtype, device)`` returns the vision tower + projector for a
  case's microbatch, at the case's tower size (``case.tower``: "toy" for CPU CI, "real" for the published size it
  stands for, or a size of its own, as ``towers`` lists them). The SAME model runs unsharded as the reference and
  sharded as the subject (by default the very same instance, its unsharded gradients set aside in between), so
  vdpcp's own toy tower is only the default (at the toy size it keeps the learned positions that case's
  microbatch needs; at the real size it is ViT-L/16, one model for every microbatch);
- how vdpcp's microbatch (``vdpcp.feature.spec.Microbatch``: ``patches`` [1, total patches, 3*P*P], ``imgs_sizes``,
  ``cu_seqlens``, and its ``spec``) becomes that model's input: ``inputs(batch)``. The patches are data, needing
  no gradient (unless ``pixel_grads``), and carry forward-mode tangents by which vdpcp sees, at the tower's
  inputs, which rows each rank's tower read (vdpcp.oracle.observe.reads): move them (slice, cat, cast, reshape, under no_grad
  or not) as a split does;
- the unsharded encode, ``encode(model, inputs)``: its outputs over the token rows, images in order;
- the sharded encode, ``encode_sharded(model, inputs, config, group)``: on every rank of the CP ``group``,
  the same outputs, gathered, in global image order. With ``config.shard_vision`` False (CP=1, or the
  opt-out) it must issue no collective and return the unsharded result; ``group`` is then still the case's
  CP group (one rank at CP=1). A configured ``context_parallel_size`` of 1 turns the feature off, whatever the
  group (the design: "it self-disables when context_parallel_size == 1 ... and reports no error"). A configured
  ``context_parallel_size`` above 1 that disagrees with the group must raise, on every rank and before any
  collective, the implementation's ``mismatch_error`` (by default ``check_group``'s: a GroupMismatchError whose
  text contains "vision_dp_over_cp does not match its process group" and names both sizes).

Outputs: one tensor [tokens, hidden], or several over the same token rows (a tuple, the first being the
main features, or a dict name -> tensor, e.g. merged features and DeepStack levels). Every output is compared
row for row and in its gradients, by name (``outputs_of``).

Optional parts:

- ``towers``: the sizes its tower comes in, each with the ``MediaAxes`` its tower takes at that size (default: the
  toy size alone, ``media``); ``model_key(case)``: what ``build_model`` reads of the case, so that a rank worker
  builds one model per key and reuses it for every case after (vdpcp.oracle.model_cache: gradients reset, weights proven
  unchanged); None, the default for a ``build_model`` of your own, builds one per case;
- ``subject_model(reference, case, dtype, device)``: the model the sharded encode runs, with the weights of
  ``reference`` (the unsharded model ``build_model`` returned). The default is ``reference`` itself. A tower
  that is parallel inside (``tensor_parallel``) is split here, from a copy of the
  plain reference, so the reference stays the plain tower and a tensor-parallel bug cannot cancel on both
  sides; a parameter that holds a part of the plain one marks it as MCore does (``tensor_model_parallel``,
  ``partition_dim``: the TP rank's chunk along that dimension), and its gradient is held to that part of the
  reference's (``vdpcp.feature.tensor_parallel.held_part``);
- ``plan(spec, config)``: which rank encodes which row (an ``Ownership``), for the per-rank checks and the
  plan-mismatch verdict; without one, ownership is inferred and the own-parameter check is left out;
- ``replicated(spec, config)``: a fallback policy, the reason this microbatch is encoded whole on every CP
  rank although ``config.shard_vision`` is on (e.g. below a size threshold), or None where it is sharded.
  The matrix then expects replication there and sharding elsewhere;
- ``known_limit(case, backend)``: a ``KnownLimit`` the case runs into on that backend (a strict xfail);
- ``splits``: the names of its partitions (``config.strategy``; any names: the matrix runs each and
  ``--split`` accepts them); ``media``: what its tower takes (``MediaAxes``), so the matrix draws
  microbatches that mean something to it; ``scenarios()``: microbatches of its own for the matrix (e.g. on
  both sides of a fallback threshold), each a MicrobatchSpec run at every CP size or a (spec, CP sizes) pair;
  ``preload``: modules the rank workers import once;
  ``tensor_parallel``: TP sizes its tower supports (``case.tp``; its TP group is
  ``vdpcp.feature.layout.groups(...).tp``), for the CP x TP layout cases; ``sizing``: a ``Sizing``
  (vdpcp.contract.sizing) with what its tower costs a case, where vdpcp's figures for its toy tower
  (vdpcp.matrix.budget) are wrong for its own: the bytes a patch costs one arm, its parameters, and its layers
  that attend over a whole image. Cases are sized with it before anything is built, and refused over the limit.

What it declares about itself, so the judge is fair to it (each default is the design's rule):

- ``mismatch_error``: a ``MismatchError(kind, text, names_sizes)``: the exception class name and a text its
  message contains, raised on every rank before any collective when the configured CP size (above 1) disagrees
  with the group. Default ``CHECK_GROUP_ERROR`` (``check_group``'s; ``names_sizes``: the message must also say
  "context_parallel_size=N" and "M ranks", which only ``check_group``'s wording promises);
- ``checks_cp1``: True where a configured CP of 1 on a larger group is an error to it too (it raises its
  ``mismatch_error``); by default CP 1 is the design's silent no-op: no error, every rank encodes everything, the
  outputs equal the unsharded ones;
- ``forward_only``: an inference engine's tower (its gather has no autograd, say): its cases check the outputs,
  which rank's tower read which row, and the plan; gradients are reported "not checked", never as errors;
- ``empty_rank_may_skip``: a rank with no real rows may skip its tower. The default is the design's rule (every
  rank runs its tower, placeholders and all: a tensor-parallel or FSDP peer inside it would hang otherwise); only
  a tower with no collective inside may say so;
- ``pixel_grads``: its path is differentiable in its pixels, so vdpcp hands them over requiring grad and holds
  their gradients too (summed over the ranks, on each row's owner, and in the regrouped run) wherever its sharded
  path carries them. The default: pixels are data, as a data loader yields them, and their gradients are not
  compared; a path that detaches them is never failed for it;
- ``loader_pixels``: how it takes pixels as a data loader hands them (float32, on the host: the matrix's ``loader``
  cases, vdpcp.feature.pixels). "device", the default: its framework's data step moves the whole batch to every rank's
  device before the model (Megatron's does), so the pixels arrive there in float32 and only its cast is its own;
  "host": it casts them and moves its own share to its device itself, and the bytes each rank copies are counted
  (vdpcp.oracle.observe.traffic: a rank that moves more than its share is not sharded); None: it takes pixels in its tower's
  dtype only, and its loader cases are left out of the matrix;
- ``has_opt_out``: False where it has no opt-out, by design: it shards at every CP above 1 whatever
  ``vision_dp_over_cp`` says. Its opt-out cases then check that it shards correctly (outputs, gradients, the
  split, its plan), as its sharded cases do, instead of failing it for the collectives the opt-out forbids;
- ``merges_copy``: its model's merges of the gathered outputs into the language model's stream copy them (an index
  assignment, ``masked_scatter``): a backward that writes into the gradient it was handed (an all-reduce in place)
  is then harmless there, and vdpcp says so in a note instead of the ``grad-written`` verdict. The default: the
  merge may be additive, or a hook or a retained grad may read that gradient after, so the write is a finding
  (docs/verdicts.md says why);
- ``media.even_grids`` (``MediaAxes``): its tower takes even patch grids only;
- ``balance(case)``: the objective its partition balances (a ``Balance``: each unit's cost from its patch grid,
  by name, "patches" or "attention" p*(p+alpha), or as a function, how many frames of a video make one unit, and
  whether each rank holds a contiguous run of units), or None, the default, for a partition that promises no
  balance (MCore's count split). vdpcp then measures each rank's load from what its tower read and holds the busiest
  rank to the best partition under that same objective (vdpcp.oracle.observe.declared_balance: the ``unbalanced`` verdict).

Nothing else in vdpcp branches on an implementation's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vdpcp.contract.sizing import SIZING_HOOKS, Sizing, sizing_of

if TYPE_CHECKING:
    import torch

GROUP_MISMATCH_TEXT = "vision_dp_over_cp does not match its process group"
MAIN_OUTPUT = "features"
# alpha of the attention cost p*(p+alpha), in tokens: three times the hidden size of the toy tower the configs default to.
TOY_TOWER_ALPHA = 96


@dataclass(frozen=True)
class VisionDPConfig:
    """The feature's switches as a VLM's config holds them; ``strategy`` names the implementation's split."""

    context_parallel_size: int = 1
    vision_dp_over_cp: bool = True  # on by default, as shipped; self-disables at CP=1
    strategy: str = "count"
    cost: str = "patches"
    alpha: int = TOY_TOWER_ALPHA

    @property
    def shard_vision(self) -> bool:
        return self.vision_dp_over_cp and self.context_parallel_size > 1


class GroupMismatchError(ValueError):
    """The configured CP size disagrees with the process group the split would run on."""


@dataclass(frozen=True)
class MismatchError:
    """The error an implementation raises on every rank, before any collective, when the configured CP size
    disagrees with its process group: the exception's class name (``kind``), a ``text`` its message contains, and
    whether the message also names both sizes in vdpcp's words ("context_parallel_size=N", "M ranks")."""

    kind: str
    text: str
    names_sizes: bool = False


CHECK_GROUP_ERROR = MismatchError("GroupMismatchError", GROUP_MISMATCH_TEXT, names_sizes=True)


def check_group(config: VisionDPConfig, group_size: int, name: str) -> None:
    """Raise GroupMismatchError (locally, so every rank raises and none hangs) on a CP size mismatch. A configured
    CP of 1 is no mismatch: the feature is off, as the design says, and every rank encodes everything."""
    if config.context_parallel_size > 1 and config.context_parallel_size != group_size:
        raise GroupMismatchError(
            f"{name}: {GROUP_MISMATCH_TEXT}: "
            f"context_parallel_size={config.context_parallel_size} but the CP group has {group_size} ranks"
        )


@dataclass(frozen=True)
class KnownLimit:
    """An upstream limit: the case must fail, and its failure text must contain ``signature``.

    ``grads_only``: only the backward runs into it, so the matrix also checks the case's outputs alone.
    ``alternatives``: other texts that are this limit too, where ranks meet it in different ways and the case's
    failure is whichever rank raised first.
    """

    name: str
    reason: str
    signature: str
    grads_only: bool = False
    alternatives: tuple[str, ...] = ()

    def shows(self, failure: str) -> bool:
        """Whether ``failure`` is this limit's (an empty signature: any failure is)."""
        return any(text in failure for text in (self.signature, *self.alternatives))


@dataclass(frozen=True)
class Ownership:
    """Which CP rank encodes which microbatch row, as an implementation plans it.

    ``owner[row]``: the rank that encodes that image or frame row (every frame of a tubelet has its tubelet's
    rank). ``tokens[row]``: the output tokens the row contributes to the gathered features, which are in row
    order (a tubelet's tokens on its first frame, 0 on the others). ``placeholders[rank]``: placeholder images
    the rank encodes besides its real rows.
    """

    owner: tuple[int, ...]
    tokens: tuple[int, ...]
    placeholders: tuple[int, ...]

    def rows_of(self, rank: int) -> list[int]:
        return [row for row, r in enumerate(self.owner) if r == rank]

    def own_tokens(self, rank: int) -> list[bool]:
        """Per row of the gathered features (in row order), whether it comes from one of ``rank``'s rows."""
        return [owner == rank for owner, tokens in zip(self.owner, self.tokens) for _ in range(tokens)]


@dataclass(frozen=True)
class MediaAxes:
    """What an implementation's tower takes, so the matrix's microbatches mean something to it.

    ``patch_dim``: pixels per patch side (the matrix's sizes are scaled to it, patch grids unchanged);
    ``temporal_patch_sizes``: the spec's tubelet sizes T it encodes as such (None: any; a video scenario at
    another T runs at the largest of these not above it); ``min_grid``: the smallest patch-grid side an image
    may have; ``even_grids``: its unsharded tower takes even patch grids only (the matrix's images get even grids,
    while the split's placeholders stay as the split makes them, odd ones too); ``min_rows_per_rank``: patch rows
    per rank below which it takes another path (a local padding floor, say), so the matrix adds microbatches that
    give every rank more.
    """

    patch_dim: int = 4
    temporal_patch_sizes: tuple[int, ...] | None = None
    min_grid: int = 1
    min_rows_per_rank: int = 0
    even_grids: bool = False


@dataclass(frozen=True)
class Balance:
    """The objective an implementation's partition balances, as it declares it (``Implementation.balance``).

    ``cost``: a unit's cost from its patch grid (rows, cols): "patches" (rows * cols), "attention" (p * (p +
    ``alpha``), p = rows * cols: attention inside a unit grows with the square of its patches), or a function of
    (rows, cols) returning an int. ``contiguous``: each rank holds one run of consecutive units (else any units).
    ``frames_per_unit``: a video's frames per unit (None: the spec's temporal patch size); an image is one unit.
    """

    cost: str | Callable[[int, int], int] = "patches"
    contiguous: bool = True
    alpha: int = TOY_TOWER_ALPHA
    frames_per_unit: int | None = None

    def unit_cost(self, grid: tuple[int, int]) -> int:
        p = grid[0] * grid[1]
        if self.cost == "patches":
            return p
        if self.cost == "attention":
            return p * (p + self.alpha)
        if callable(self.cost):
            return int(self.cost(*grid))
        raise ValueError(f"Balance.cost: {self.cost!r}; expected 'patches', 'attention' or a function of (rows, cols)")


class Implementation:
    """Defaults for the optional parts; ``build_model``, ``encode`` and ``encode_sharded`` are the subject's."""

    name: str = "unnamed"
    splits: tuple[str, ...] = ("count",)
    preload: tuple[str, ...] = ()
    tensor_parallel: tuple[int, ...] = ()  # TP sizes its build_model supports (case.tp), for the CP x TP layouts
    media: MediaAxes = MediaAxes()
    mismatch_error: MismatchError = CHECK_GROUP_ERROR
    checks_cp1: bool = False  # a configured CP of 1 on a larger group raises mismatch_error (default: the no-op)
    forward_only: bool = False  # an inference tower: gradients are not checked
    empty_rank_may_skip: bool = False  # its tower holds no collective, so a rank with no real rows may skip it
    pixel_grads: bool = False  # its path is differentiable in its pixels: their gradients are held too
    loader_pixels: str | None = "device"  # a loader's float32 pixels, moved to the device by the framework; it casts
    merges_copy: bool = False  # its model's merges copy the gathered outputs: a write into the handed gradient is a note
    has_opt_out: bool = True  # False: it shards at every CP above 1 by design, and its opt-out cases are held to that

    @property
    def towers(self) -> Mapping[str, MediaAxes]:
        """The sizes its tower comes in (``case.tower``), each with what its tower takes at that size."""
        return {"toy": self.media}

    def build_model(self, case, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        from vdpcp.feature.model import VisionModel

        # A real-size tower is drawn on the device it runs on; the toy one on the CPU, so its weights are alike everywhere.
        return VisionModel(toy_tower(case), device if case.tower != "toy" else None).to(device=device, dtype=dtype)

    def model_key(self, case):
        """What ``build_model`` reads of the case: cases with equal keys share one model in a rank worker (built
        once, gradients reset and weights checked between cases). None: built afresh for every case, which is
        what a build_model of your own gets until you say what it reads."""
        return toy_tower(case) if builds_toy_tower(self) else None

    def subject_model(self, reference, case, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        return reference  # the same weights: the oracle sets the unsharded arm's gradients aside before this arm

    def inputs(self, batch) -> Any:
        return batch

    def encode(self, model, inputs):
        raise NotImplementedError(f"{type(self).__name__}.encode")

    def encode_sharded(self, model, inputs, config: VisionDPConfig, group):
        raise NotImplementedError(f"{type(self).__name__}.encode_sharded")

    def plan(self, spec, config: VisionDPConfig) -> Ownership | None:
        return None

    def replicated(self, spec, config: VisionDPConfig) -> str | None:
        return None

    def media_tokens(self, spec) -> tuple[int, ...] | None:
        """The output rows each media item of ``spec`` gives, in order. Without a plan it lets the CP ranks share out
        the measurement of the unsharded run's rounding (vdpcp.oracle.compare.rounding.Share); None: every rank measures it whole."""
        return None

    def known_limit(self, case, backend: str) -> KnownLimit | None:
        return None

    def balance(self, case) -> Balance | None:
        return None  # its partition promises no balance: none is judged

    def scenarios(self) -> tuple:
        return ()

    @functools.cached_property
    def sizing(self) -> Sizing:
        """What its tower costs a case (vdpcp.matrix.budget reads it); a subject declares its own as ``sizing =
        MySizing()``, on its class or in ``__init__``. The default's figures are vdpcp's own; sizing hooks defined on
        the implementation itself, the older spelling, still count, with a DeprecationWarning."""
        return sizing_of(self)

    def __repr__(self) -> str:
        return f"<vdpcp implementation {self.name!r}>"


class Adapted(Implementation):
    """An object that is not an Implementation but has its required methods: the defaults fill the rest."""

    def __init__(self, subject):
        self._subject = subject
        self.name = str(subject.name)

    def __getattribute__(self, attr):
        subject = object.__getattribute__(self, "_subject")
        if (attr in PROTOCOL or attr in SIZING_HOOKS) and hasattr(subject, attr):
            return getattr(subject, attr)
        return object.__getattribute__(self, attr)


def builds_toy_tower(impl) -> bool:
    """Whether ``impl`` builds vdpcp's toy tower (it keeps Implementation's build_model)."""
    return getattr(impl.build_model, "__func__", None) is Implementation.build_model


def toy_tower(case):
    """vdpcp's toy tower for a case (vdpcp.feature.model.TowerConfig): at the toy size with the learned positions its
    microbatch needs and the spec's seed; at another size one model for every microbatch (seed 0, every position),
    as a checkpoint is."""
    from vdpcp.feature.model import TOWERS, TowerConfig, positions_needed

    if case.tower not in TOWERS:
        raise ValueError(f"tower size {case.tower!r}: vdpcp's toy tower comes in {', '.join(TOWERS)}")
    toy = case.tower == "toy"
    return TowerConfig(patch_dim=case.spec.patch_dim, temporal_patch_size=case.spec.temporal_patch_size,
                       pad_odd_grids=case.even_pad, seed=case.spec.seed if toy else 0,
                       positions=positions_needed(case.spec.grids) if toy else None, **TOWERS[case.tower])


REQUIRED = ("name", "encode", "encode_sharded")
PROTOCOL = REQUIRED + ("build_model", "model_key", "subject_model", "inputs", "plan", "replicated", "media_tokens",
                       "known_limit", "splits",
                       "media", "towers", "scenarios", "preload", "tensor_parallel", "sizing",
                       "mismatch_error", "checks_cp1", "forward_only", "empty_rank_may_skip",
                       "pixel_grads", "loader_pixels", "merges_copy", "has_opt_out", "balance")


class OutputsError(TypeError):
    """An encode that returned something other than tensors over shared token rows."""


def outputs_of(value, where: str) -> dict[str, torch.Tensor]:
    """An encode's outputs by name: a tensor is ``features``; a tuple's first is ``features``, then ``output1``,
    ...; a dict keeps its names. Every output must hold the same token rows (its leading dimension)."""
    import torch

    if isinstance(value, torch.Tensor):
        named = {MAIN_OUTPUT: value}
    elif isinstance(value, tuple | list) and value:
        named = {MAIN_OUTPUT if i == 0 else f"output{i}": v for i, v in enumerate(value)}
    elif isinstance(value, Mapping) and value:
        named = dict(value)
    else:
        raise OutputsError(f"{where} returned {type(value).__name__}; expected a tensor, a tuple of tensors or a "
                           f"dict of name -> tensor")
    for name, tensor in named.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
            raise OutputsError(f"{where}: output {name!r} is {type(tensor).__name__}; expected a tensor [tokens, ...] "
                               f"named by a string")
    rows = {name: t.shape[0] for name, t in named.items()}
    if len(set(rows.values())) > 1:
        raise OutputsError(f"{where}: outputs hold different token rows {rows}; expected every output over the same rows")
    return named
