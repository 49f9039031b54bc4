"""What the arms and their checks share, passed as one: the arm a rank runs (Arm) and, after the sharded encode,
what it was seen to run (Sharded). Both frozen: a check reads them and returns its findings; only the figures it
measures go into the arm's telemetry."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vdpcp.matrix.case import Case, Telemetry


@dataclass(frozen=True)
class Arm:
    """One arm of a case on this rank: the implementation, the model it encodes with (the sharded arm's is the
    subject's split of it), the dtype and device of its tower, and this rank's place in its CP group."""

    impl: object = None
    case: Case | None = None
    model: torch.nn.Module | None = None
    dtype: torch.dtype = torch.float64
    device: torch.device = torch.device("cpu")  # the tower's: a loader's pixels may be on the host
    rank: int = 0  # in the world
    cp_rank: int = 0
    cp_group: object = None  # None: this rank alone
    tp_rank: int = 0
    clock: object = None  # vdpcp.oracle.observe.telemetry.Clock, or None where phases are not timed
    telemetry: Telemetry = field(default_factory=Telemetry)  # where its figures go (the rank's RankResult's)

    @property
    def whose(self) -> str:
        return f"rank {self.rank} (CP rank {self.cp_rank})"

    def lap(self, phase: str) -> None:
        if self.clock is not None:
            self.clock.lap(phase)


@dataclass(frozen=True)
class Sharded:
    """The sharded arm's encode and what it was seen to run: what every check after it reads."""

    arm: Arm  # on the subject model
    ref: object  # the vdpcp.oracle.unsharded.Unsharded it is held to
    batch: object  # the microbatch it encoded, on fresh pixels
    prompt: object  # the prompt tables, embedded before the encode (vdpcp.feature.loss)
    out: dict[str, torch.Tensor]
    ran: object  # the vdpcp.oracle.observe.execution.Execution that watched it
    copies: object  # traffic.Copies where the implementation moves the pixels, else a null context
    read: torch.Tensor | None = None  # the read table: [CP ranks, rows] (vdpcp.oracle.observe.split.read_table)
    replicated_run: bool = False  # every CP rank's tower read every row
    plan: object = None  # the implementation's plan, None where it is not what ran
    rank_alone: bool = False  # this rank's own gradients are held to its own share
    owned: bool = False  # sharding is on and the run was not replicated: each row has one owner
    may_skip: bool = False  # a rank with no real rows whose implementation says it may skip its tower
    required: set[str] | None = None  # the layers this rank must have run (required_layers)
