"""Run one Case on its ranks and judge it: the one path that check, replay, fuzz, mutants and pytest share.

The rank body resolves the case's implementation (by name or module:object, on the rank), builds the case's
layout groups, applies its mutant from outside the oracle, and runs the oracle. A case either passes (every
rank's checks hold), fails (a check does not hold on some rank), or errors (a rank raised, died or hung: the
harness's RankFailure text is kept); "unsharded-error" means the unsharded encoder raised on the spec too, so
sharding is not to blame; "resource" means a rank ran out of memory (vdpcp.matrix.expectations.resource_failure), which
says nothing about either. A case is sized before it runs and refused over the limit (vdpcp.matrix.budget.check).
``run_judged`` adds the expectation (vdpcp.matrix.expectations.judge).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vdpcp import harness, oracle
from vdpcp.feature import layout
from vdpcp.harness import RankFailure, run_ranks
from vdpcp.harness import config as harness_config
from vdpcp.harness.config import resolve_backend
from vdpcp.impls import resolve
from vdpcp.matrix import budget
from vdpcp.matrix.case import (
    FAILURE,
    GRAD_WRITTEN,
    LINES,
    NOT_SHARDED,
    NOTE,
    PLAN_MISMATCH,
    UNBALANCED,
    Case,
    RankResult,
)
from vdpcp.matrix.expectations import JUDGED, KNOWN_LIMIT_GRACE_S, PASSING, PRECEDENCE, judge, known_limit, resource_failure
from vdpcp.tools import mutants

# What every case body imports besides its implementation's own preload, torch.distributed.tensor included (the
# oracle's assert_close imports it at its first call): preloaded in the rank zygote, a fresh worker need not.
RANK_PRELOAD = ("vdpcp.matrix.runner", "torch.distributed.tensor")


CORRECT = ("pass", "replicated")  # verdicts of a run whose every check held
# The verdicts a run decides itself, in vdpcp.matrix.expectations.PRECEDENCE's order, by the RankResult field any one
# rank says it with; a finding's kind decides its verdict (FINDINGS), its lines (MESSAGES) are the case's messages.
RUN_VERDICTS = tuple(v for v in PRECEDENCE if v not in JUDGED)
FINDINGS = {"fail": FAILURE, "plan-mismatch": PLAN_MISMATCH, "grad-written": GRAD_WRITTEN, "not-sharded": NOT_SHARDED,
            "unbalanced": UNBALANCED}
MESSAGES = {verdict: next(name for name, of in LINES.items() if of == kind) for verdict, kind in FINDINGS.items()}
RANK_FLAGS = {"unsharded-error": "unsharded_error", **MESSAGES, "replicated": "replicated"}


@dataclass
class CaseResult:
    case: Case
    ranks: list[RankResult] = field(default_factory=list)
    error: str | None = None  # a rank raised, died or hung
    backend: str = ""  # the backend the case was run on ("gloo" or "nccl"), as resolved before it ran

    @property
    def device(self) -> str:
        return ",".join(sorted({r.device for r in self.ranks})) or "-"

    @property
    def verdict(self) -> str:
        """The first of RUN_VERDICTS that applies: resource (a rank could not allocate), error (a rank raised, died or
        hung: its ranks' results are not known), then what any rank says (RANK_FLAGS), else pass."""
        applies = {"resource": resource_failure(self) is not None, "error": self.error is not None, "pass": True}
        applies |= {verdict: any(getattr(r, attr) for r in self.ranks) for verdict, attr in RANK_FLAGS.items()}
        return next(verdict for verdict in RUN_VERDICTS if applies[verdict])

    @property
    def passed(self) -> bool:
        return self.verdict in CORRECT

    @property
    def failures(self) -> list[str]:
        """Every rank's messages, wrong results first, then plan mismatches, then work not distributed."""
        if self.error is not None:
            return [self.error]
        unsharded = [f"rank {r.rank}: unsharded encoder raised {r.unsharded_error}" for r in self.ranks if r.unsharded_error]
        return unsharded + [f"rank {r.rank}: {f.line}" for verdict in RUN_VERDICTS if verdict in FINDINGS
                            for r in self.ranks for f in r.findings if f.kind == FINDINGS[verdict]]

    @property
    def unchecked_grads(self) -> str | None:
        """Why this case's gradients were not checked although it asks for them (a forward-only implementation)."""
        return next((r.unchecked_grads for r in self.ranks if r.unchecked_grads), None)

    @property
    def notes(self) -> list[str]:
        """What the ranks saw and said without a verdict (a write into the handed gradient where merges copy)."""
        return [f"rank {r.rank}: {f.line}" for r in self.ranks for f in r.findings if f.kind == NOTE]

    @property
    def collectives(self) -> str:
        """What stood in for torch's collectives on any rank (vdpcp.oracle.observe.gloo_collectives), or nothing."""
        return "; ".join(sorted({r.collectives for r in self.ranks if r.collectives}))

    def max_err(self, attr: str) -> float:
        return max((getattr(r, attr) for r in self.ranks), default=float("nan"))

    def summary(self) -> str:
        """One paragraph: the case, where it ran, what each rank encoded, and what failed."""
        lines = [f"{self.case.id}: {self.verdict} (on {self.backend or '?'}, {self.device})"]
        replicated = next((r.replicated for r in self.ranks if r.replicated), None)
        if replicated:
            lines.append(f"  replicated by the implementation's policy: {replicated}")
        if self.collectives:
            lines.append(f"  collectives: {self.collectives}")
        for r in self.ranks:
            lines.append(f"  rank {r.rank}: {r.images} images, {r.placeholders} placeholders, {r.patches} patches"
                         + (f", its tower saw {r.encoded} rows" if r.encoded >= 0 else ""))
        if self.unchecked_grads:
            lines.append(f"  gradients not checked: {self.unchecked_grads}")
        pixels = next((r.input_grads for r in self.ranks if r.input_grads), "")
        if pixels:
            lines.append(f"  input gradients not compared: {pixels}")
        lines += [f"  {msg}" for msg in self.failures]
        lines += [f"  note: {msg}" for msg in self.notes]
        return "\n".join(lines)


@dataclass
class Judged:
    """A result with its verdict against the case's expectation (pass, fail, error, xfail, xpass, ...)."""

    result: CaseResult
    verdict: str
    why: str

    @property
    def passing(self) -> bool:
        return self.verdict in PASSING


def rank_body(ctx, case: Case) -> RankResult:
    """On every rank: the case's implementation, with its mutant if any, checked by the oracle."""
    impl = resolve(case.impl)
    groups = layout.groups(layout.Layout(case.cp, case.dp, case.tp))
    with mutants.applied(case.mutant, impl) as subject:
        result = oracle.check(ctx, case, subject, groups)
        result.telemetry.planted = mutants.planted(subject)
        return result


def run_case(case: Case, backend: str | None = None, timeout: float | None = None,
             fault_grace: float | None = None) -> CaseResult:
    """Run ``case`` on its ``case.world_size`` ranks. Skips and xfails raised in a rank propagate to the caller.

    ``fault_grace``: seconds the other ranks get to finish once one rank raised (None: the harness's default), or
    as long as that rank had run if longer.
    """
    chosen = resolve_backend(backend, case.world_size)  # once: the expectation and the run use the same backend
    budget.check(case, case.id, budget.device_for(chosen, case.world_size))  # SpecTooLarge before any rank builds a tensor
    try:
        ranks = run_ranks(rank_body, case.world_size, case, backend=chosen, timeout=timeout, fault_grace=fault_grace)
    except RankFailure as failure:
        return CaseResult(case, error=str(failure), backend=chosen)
    strays = [f"rank {r.rank} ran on {r.backend}" for r in ranks if r.backend != chosen]
    if strays:  # a case asked for NCCL that ran on gloo tests something else than it says: never a pass
        return CaseResult(case, error=f"asked to run on {chosen}, but {', '.join(strays)}", backend=chosen)
    return CaseResult(case, ranks=ranks, backend=chosen)


def run_judged(case: Case, backend: str | None = None, timeout: float | None = None,
               known_limits: bool = True) -> Judged:
    """run_case, then judge (``known_limits=False``: as if the implementation declared none, expectations.judge):
    a case expected to fail a known way gets a short fault grace."""
    chosen = resolve_backend(backend, case.world_size)
    grace = KNOWN_LIMIT_GRACE_S if known_limit(case, chosen) or case.mutant else None
    result = run_case(case, backend=chosen, timeout=timeout, fault_grace=grace)
    return Judged(result, *judge(result, known_limits))


def preload_case_modules(impls=(), extra=()) -> None:
    """Have the rank zygote preload case_preload(impls) and ``extra``, unless a preload is configured already. On GPUs too:
    with torch's NVML-based CUDA check (which the zygote sets) the only thread those imports
    leave is the CUDA driver's, and workers forked after it use CUDA, gloo and NCCL; the zygote proves that at each
    start. A faulted case then costs a fork, not the imports again (reports/gpu/README.md).
    Callers scope it (harness.config.configured)."""
    if harness_config.default_preload():
        return
    harness.configure(preload=(*case_preload(impls), *extra))


def case_preload(impls=()) -> tuple[str, ...]:
    """RANK_PRELOAD, the implementations' own preloads, and vdpcp's own adapter modules among them (the
    reference's tower, MCore's plan: a worker forked after a faulted case would import them in its first case). A
    user's module is preloaded only if it lists itself: it is theirs to say that it starts no thread at import."""
    resolved = [resolve(target) for target in impls]
    own = [type(impl).__module__ for impl in resolved if type(impl).__module__.startswith("vdpcp.")]
    return tuple(dict.fromkeys((*RANK_PRELOAD, *own, *(name for impl in resolved for name in impl.preload))))
