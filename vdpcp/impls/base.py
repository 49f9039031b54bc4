"""The one protocol an implementation of vision DP over CP meets to be held to vdpcp's matrix.

An implementation is an object (subclass ``Implementation``, or any object with these attributes) that says:

- which model is under test: ``build_model(case, dtype, device)`` returns the vision tower + projector for a
  case's microbatch. The SAME model (two instances with equal weights) runs unsharded as the reference and
  sharded as the subject, so vdpcp's own toy tower is only the default;
- how vdpcp's microbatch becomes that model's input: ``inputs(batch)``, differentiably (the input gradients
  vdpcp checks are those of ``batch.patches``);
- the unsharded encode, ``encode(model, inputs)``: projected features [tokens, hidden], images in order;
- the sharded encode, ``encode_sharded(model, inputs, config, group)``: on every rank of the CP ``group``,
  the gathered projected features in global image order. With ``config.shard_vision`` False (CP=1, or the
  opt-out) it must issue no collective and return the unsharded result. A ``config.context_parallel_size``
  that disagrees with the group must raise, on every rank and before any collective, an error whose text
  contains "vision_dp_over_cp does not match its process group" (``check_group`` does exactly that);

and optionally:

- ``plan(spec, config)``: which rank encodes which row (an ``Ownership``), for the per-rank checks; without
  one, ownership is inferred from the input gradients and the own-parameter check is left out;
- ``known_limit(case, backend)``: a ``KnownLimit`` the case runs into on that backend (a strict xfail);
- ``splits``: the ``config.strategy`` values it implements (the matrix runs each); ``preload``: modules the
  rank workers import once; ``tensor_parallel``: TP sizes its tower supports (``case.tp``; its TP group is
  ``vdpcp.layout.groups(...).tp``), for the CP x TP layout cases.

Nothing else in vdpcp branches on an implementation's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vdpcp.case import Case
    from vdpcp.sharded import VisionDPConfig
    from vdpcp.spec import Microbatch, MicrobatchSpec

GROUP_MISMATCH_TEXT = "vision_dp_over_cp does not match its process group"


class GroupMismatchError(ValueError):
    """The configured CP size disagrees with the process group the split would run on."""


def check_group(config: VisionDPConfig, group_size: int, name: str) -> None:
    """Raise GroupMismatchError (locally, so every rank raises and none hangs) on a CP size mismatch."""
    if config.context_parallel_size != group_size:
        raise GroupMismatchError(
            f"{name}: {GROUP_MISMATCH_TEXT}: "
            f"context_parallel_size={config.context_parallel_size} but the CP group has {group_size} ranks"
        )


@dataclass(frozen=True)
class KnownLimit:
    """An upstream limit: the case must fail, and its failure text must contain ``signature``.

    ``grads_only``: only the backward runs into it, so the matrix also checks the case's outputs alone.
    """

    name: str
    reason: str
    signature: str
    grads_only: bool = False


# Measured here (torch 2.14): torch.distributed.nn.functional's all_to_all falls back on gloo to one scatter per
# rank and passes the group rank i as if it were the global rank of the source, so on any process group that is
# not ranks 0..n-1 (a CP group of the second DP replica) it raises. all_gather's backward goes through it too.
# Any implementation whose gather uses those autograd collectives meets it in a CP x DP layout on gloo.
GLOO_NN_SUBGROUP = KnownLimit(
    "gloo-nn-collective-subgroup",
    "torch.distributed.nn.functional's all_to_all (also all_gather's backward) on gloo scatters from group rank i "
    "passed as global rank i, so it raises on any CP group but the first (data parallelism around CP); it runs "
    "for real on NCCL",
    "is not part of group",
)


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


class Implementation:
    """Defaults for the optional parts; ``build_model``, ``encode`` and ``encode_sharded`` are the subject's."""

    name: str = "unnamed"
    splits: tuple[str, ...] = ("count",)
    preload: tuple[str, ...] = ()
    tensor_parallel: tuple[int, ...] = ()  # TP sizes its build_model supports (case.tp), for the CP x TP layouts

    def build_model(self, case: Case, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        from vdpcp.model import TOWERS, TowerConfig, VisionModel

        tower = TowerConfig(patch_dim=case.spec.patch_dim, temporal_patch_size=case.spec.temporal_patch_size,
                            pad_odd_grids=case.even_pad, seed=case.spec.seed, **TOWERS[case.tower])
        return VisionModel(tower).to(device=device, dtype=dtype)

    def inputs(self, batch: Microbatch) -> Any:
        return batch

    def encode(self, model, inputs) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.encode")

    def encode_sharded(self, model, inputs, config: VisionDPConfig, group) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.encode_sharded")

    def plan(self, spec: MicrobatchSpec, config: VisionDPConfig) -> Ownership | None:
        return None

    def known_limit(self, case: Case, backend: str) -> KnownLimit | None:
        return None

    def __repr__(self) -> str:
        return f"<vdpcp implementation {self.name!r}>"


class Adapted(Implementation):
    """An object that is not an Implementation but has its required methods: the defaults fill the rest."""

    def __init__(self, subject):
        self._subject = subject
        self.name = str(subject.name)

    def __getattribute__(self, attr):
        subject = object.__getattribute__(self, "_subject")
        if attr in PROTOCOL and hasattr(subject, attr):
            return getattr(subject, attr)
        return object.__getattribute__(self, attr)


REQUIRED = ("name", "encode", "encode_sharded")
PROTOCOL = REQUIRED + ("build_model", "inputs", "plan", "known_limit", "splits", "preload", "tensor_parallel")
