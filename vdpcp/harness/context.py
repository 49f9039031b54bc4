"""What a case body receives on each rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed


@dataclass(frozen=True)
class RankContext:
    """This rank's place in the case: ``fn(ctx, *args, **kwargs)`` is called with one of these."""

    rank: int
    world_size: int
    group: torch.distributed.ProcessGroup  # spans the case's world_size ranks (the default group)
    backend: str  # "nccl" or "gloo"
    device: torch.device  # cuda:<local rank> on nccl, else cpu (or a GPU shared by gloo ranks: VDPCP_DEVICE=cuda)
    shares_device: bool = False  # other ranks of this world use the same GPU (vdpcp.harness.turns)
