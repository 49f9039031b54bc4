"""One correctness case, as a record: a microbatch, a parallel layout, an implementation and how it runs.

The case is what check, replay, fuzz, mutants and pytest hand the runner, and what reports name. Its id reads
like a row of the matrix: ``<spec>-cp<N>[-dp<D>][-tp<T>]-<impl>-<split>[-<variations>]``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from vdpcp.contract.protocol import VisionDPConfig
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix.choices import DTYPES, LOSSES  # noqa: F401  (a case's choices, where callers read them)

# How a case's pixels reach the implementation (vdpcp.feature.pixels): in its tower's dtype on its device, or as a data loader
# hands them (float32, on the host), so that the implementation's own cast and move are what runs.
PIXELS = ("tower", "loader")


@dataclass(frozen=True)
class Case:
    spec: MicrobatchSpec
    cp: int  # size of each CP group
    impl: str = "reference"  # a registered implementation name or a module:object target (vdpcp.impls.resolve)
    split: str = "count"
    loss: str = "rank"
    vision_dp_over_cp: bool = True
    config_cp: int | None = None  # the configured context_parallel_size; None means cp
    dtype: str = "float64"
    even_pad: bool = True
    mutant: str | None = None  # a name in vdpcp.tools.mutants, applied by the runner on every rank
    grads: bool = True  # False checks the outputs only (no backward)
    dp: int = 1  # data-parallel replicas around the CP groups, each with its own microbatch
    tp: int = 1  # tensor-parallel ranks inside each CP rank's vision tower (an implementation that has TP)
    tower: str = "toy"  # a size the implementation's tower comes in (its ``towers``): "toy" for CPU CI, "real" as published
    pixels: str = "tower"  # PIXELS: "loader" hands them float32 on the host, whatever the tower's dtype and device

    @property
    def world_size(self) -> int:
        return self.cp * self.dp * self.tp

    @property
    def config(self) -> VisionDPConfig:
        return VisionDPConfig(
            context_parallel_size=self.cp if self.config_cp is None else self.config_cp,
            vision_dp_over_cp=self.vision_dp_over_cp,
            strategy=self.split,
        )

    @property
    def id(self) -> str:
        parts = [self.spec.name, f"cp{self.cp}"]
        parts += [f"{axis}{n}" for axis, n in (("dp", self.dp), ("tp", self.tp)) if n > 1]
        parts += [impl_label(self.impl), self.split]
        if self.loss != "rank":
            parts.append(self.loss)
        if not self.vision_dp_over_cp:
            parts.append("optout")
        if self.config_cp is not None:
            parts.append(f"config-cp{self.config_cp}")
        if self.dtype != "float64":
            parts.append(self.dtype)
        if self.pixels != "tower":
            parts.append(self.pixels)
        if not self.even_pad:
            parts.append("no-even-pad")
        if not self.grads:
            parts.append("outputs")
        if self.tower != "toy":
            parts.append(f"tower-{self.tower}")
        if self.mutant:
            parts.append(f"mutant-{self.mutant}")
        return "-".join(parts)

    def with_(self, **changes) -> Case:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["spec"] = self.spec.to_dict()
        return out


def impl_label(target: str) -> str:
    """A registered name as it is; a module:object target by the implementation's own name."""
    if ":" not in target:
        return target
    from vdpcp.impls import resolve

    return resolve(target).name


# What a rank's checks find, by kind; a kind other than NOTE keeps the case from passing (vdpcp.matrix.runner).
FAILURE = "failure"  # a check of outputs, gradients or execution did not hold
# Correct, but the work was not distributed where it should be (a rank encoded rows it does not own, the
# microbatch was encoded more than once): never a pass, and not a wrong result either.
NOT_SHARDED = "not-sharded"
PLAN_MISMATCH = "plan-mismatch"  # what ran contradicts the implementation's stated plan
# Every result right, but the backward wrote into the gradient vdpcp handed an output's backward: a consumer
# that reads that buffer after it (an additive merge) sees the sum (vdpcp.oracle.observe.handed).
GRAD_WRITTEN = "grad-written"
# Correct and distributed, but the busiest rank carries a whole unit more than the best partition under the
# implementation's own declared objective (vdpcp.oracle.observe.declared_balance): never a pass, nor a wrong result.
UNBALANCED = "unbalanced"
NOTE = "note"  # seen and said, no verdict: such a write where merges copy
# RankResult's list of each kind's lines, as its consumers read them.
LINES = {"failures": FAILURE, "not_sharded": NOT_SHARDED, "plan_mismatch": PLAN_MISMATCH,
         "grad_written": GRAD_WRITTEN, "unbalanced": UNBALANCED, "notes": NOTE}


@dataclass(frozen=True)
class Finding:
    """One line a check says of a rank's run, and of which kind."""

    kind: str  # one of LINES' kinds
    rank: int  # in the world
    line: str


@dataclass
class Telemetry:
    """What a rank ran on, encoded, measured and held: figures for the report, never a verdict."""

    images: int = 0  # real rows this rank encodes (by the rows its tower read, or the implementation's plan)
    placeholders: int = 0
    patches: int = 0  # patches of those real rows
    encoded: int = -1  # rows the tower's first layer really saw on this rank (-1: not measured)
    read: list[int] | None = None  # microbatch rows whose patches reached this rank's tower (None: not measured)
    out_err: float = 0.0
    input_grad_err: float = 0.0
    param_grad_err: float = 0.0
    host_copies: int | None = None  # bytes of host pixels it copied to its device (vdpcp.oracle.observe.traffic; None: not counted)
    backend: str = ""  # what this rank really ran on (the harness's RankContext), not what was asked for
    device: str = ""
    model: str = ""  # "built" for this case, or "reused" from an earlier one (vdpcp.oracle.model_cache)
    precision: str = ""  # the precision the arms ran in (vdpcp.oracle.compare.rounding.in_effect: TF32 on CUDA, say)
    collectives: str = ""  # what stood in for a collective of torch's in the sharded arm (vdpcp.oracle.observe.gloo_collectives)
    deterministic: str = ""  # whether its backward was deterministic (vdpcp.oracle.compare.determinism): cpu, on, off (why)
    exact: str = ""  # what the regrouped reference held bitwise on this rank, or why nothing (vdpcp.oracle.compare.regrouped)
    turns: bool = False  # this rank took its turn on a shared GPU for the unsharded arm (vdpcp.harness.turns)
    seconds: dict[str, float] = field(default_factory=dict)  # per phase: build, unsharded, sharded
    memory: dict[str, int] = field(default_factory=dict)  # bytes held (model, unsharded grads, ...) and the CUDA peak
    # Why the pixels' gradients were not compared on a case whose gradients were (vdpcp.oracle.pixel_grads): pixels
    # are data unless the implementation declares them differentiable, and a path that detaches them is not failed.
    input_grads: str = ""
    planted: int | None = None  # elements a sized mutant moved off their values on this rank (vdpcp.tools.mutants.sized)


class Lines(list):
    """One kind's lines of a RankResult's findings, as a list; a line appended to it is a finding of that kind."""

    def __init__(self, result: RankResult, kind: str):
        super().__init__(f.line for f in result.findings if f.kind == kind)
        self.result, self.kind = result, kind

    def append(self, line: str) -> None:
        super().append(line)
        self.result.findings.append(Finding(self.kind, self.result.rank, line))

    def extend(self, lines) -> None:
        for line in lines:
            self.append(line)

    def __reduce__(self):
        return list, (list(self),)  # sent to another process, the lines alone


@dataclass(init=False)
class RankResult:
    """One rank's result of a case: what its checks found (``findings``), what it ran on and measured
    (``telemetry``, its fields read and set on the result too), and the three things its arms said of the case.

    Built as ``RankResult(rank, cp_rank, images, placeholders, patches, failures=[...], backend=...)`` too: each
    kind's lines (LINES) become its findings, every other keyword a telemetry field."""

    rank: int  # in the world
    cp_rank: int
    findings: list[Finding]
    telemetry: Telemetry
    replicated: str | None  # the implementation's fallback policy encoded this microbatch whole, and why
    # The unsharded encoder itself raised (e.g. an odd real grid with even padding off): the spec cannot be
    # encoded at all, so the case says nothing about sharding and is neither a pass nor a sharding failure.
    unsharded_error: str | None
    # Why a case that asks for gradients did not check them: a forward-only implementation (Implementation.forward_only),
    # or unsharded outputs with no autograd graph. Not a verdict: outputs, who read what and the plan were checked.
    unchecked_grads: str | None

    def __init__(self, rank: int, cp_rank: int = 0, images: int = 0, placeholders: int = 0, patches: int = 0, *,
                 findings: list[Finding] | None = None, telemetry: Telemetry | None = None,
                 replicated: str | None = None, unsharded_error: str | None = None,
                 unchecked_grads: str | None = None, **given):
        lines = {name: given.pop(name) for name in LINES if name in given}
        self.rank, self.cp_rank = rank, cp_rank
        self.findings = list(findings or []) + [Finding(LINES[name], rank, line)
                                                for name, said in lines.items() for line in said]
        self.telemetry = telemetry if telemetry is not None else Telemetry(images, placeholders, patches, **given)
        self.replicated, self.unsharded_error, self.unchecked_grads = replicated, unsharded_error, unchecked_grads

    def add(self, findings: list[Finding] | None) -> None:
        """A check's findings, in the order it said them (None: it said nothing)."""
        self.findings.extend(findings or [])

    @property
    def ok(self) -> bool:
        return all(f.kind == NOTE for f in self.findings) and self.unsharded_error is None


def _lines(kind: str) -> property:
    return property(lambda self: Lines(self, kind), doc=f"The lines of this rank's {kind} findings.")


def _figure(name: str) -> property:
    return property(lambda self: getattr(self.telemetry, name),
                    lambda self, value: setattr(self.telemetry, name, value), doc=f"telemetry.{name}")


for _name, _kind in LINES.items():
    setattr(RankResult, _name, _lines(_kind))
for _name in (f.name for f in fields(Telemetry)):
    setattr(RankResult, _name, _figure(_name))
