"""Run one Case on its ranks and reduce the per-rank results to a verdict.

Shared by ``vdpcp check``, ``replay``, ``fuzz`` and ``mutants`` and by the pytest matrix, so every entry
point judges a case the same way. A case either passes (every rank's checks hold), fails (a check does
not hold on some rank), or errors (a rank raised, died or hung: the harness's RankFailure text is kept);
"unsharded-error" means the unsharded encoder raised on the spec too, so sharding is not to blame.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vdpcp import harness
from vdpcp.case import Case, RankResult, check_case
from vdpcp.harness import RankFailure, run_ranks
from vdpcp.harness import config as harness_config
from vdpcp.harness.config import resolve_backend

# What every case body imports. A rank worker forked after a faulted case would otherwise import
# megatron.core again (about 4 s a rank here); preloaded into the rank zygote, it starts in milliseconds.
RANK_PRELOAD = (
    "vdpcp.case",
    "vdpcp.mcore",
    "megatron.core.parallel_state",
    "megatron.core.models.multimodal.context_parallel",
    "megatron.core.packed_seq_params",
)


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
        if self.error is not None:
            return "error"
        if any(r.unsharded_error is not None for r in self.ranks):
            return "unsharded-error"  # the spec cannot be encoded even unsharded: not a sharding failure
        return "pass" if all(r.ok for r in self.ranks) else "fail"

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def failures(self) -> list[str]:
        if self.error is not None:
            return [self.error]
        unsharded = [f"rank {r.rank}: unsharded encoder raised {r.unsharded_error}" for r in self.ranks if r.unsharded_error]
        return unsharded + [f"rank {r.rank}: {msg}" for r in self.ranks for msg in r.failures]

    def max_err(self, attr: str) -> float:
        return max((getattr(r, attr) for r in self.ranks), default=float("nan"))

    def summary(self) -> str:
        """One paragraph: the case, what each rank encoded, and what failed."""
        lines = [f"{self.case.id}: {self.verdict} (on {self.backend or '?'}, {self.device})"]
        for r in self.ranks:
            lines.append(f"  rank {r.rank}: {r.images} images, {r.placeholders} placeholders, {r.patches} patches")
        lines += [f"  {msg}" for msg in self.failures]
        return "\n".join(lines)


def run_case(case: Case, backend: str | None = None, timeout: float | None = None,
             fault_grace: float | None = None) -> CaseResult:
    """Run ``case`` on ``case.cp`` ranks. Skips and xfails raised in a rank propagate to the caller.

    ``fault_grace``: seconds the other ranks get to finish once one rank raised (the harness's default is 3 s).
    A case expected to fail with one rank raising and the rest stuck in a collective (a known upstream
    limit) sets it short: the raising rank's error is all it needs, and the wait would be idle time.
    """
    chosen = resolve_backend(backend, case.cp)  # once: the expectation and the run use the same backend
    try:
        ranks = run_ranks(check_case, case.cp, case, backend=chosen, timeout=timeout, fault_grace=fault_grace)
    except RankFailure as failure:
        return CaseResult(case, error=str(failure), backend=chosen)
    strays = [f"rank {r.rank} ran on {r.backend}" for r in ranks if r.backend != chosen]
    if strays:  # a case asked for NCCL that ran on gloo tests something else than it says: never a pass
        return CaseResult(case, error=f"asked to run on {chosen}, but {', '.join(strays)}", backend=chosen)
    return CaseResult(case, ranks=ranks, backend=chosen)


def preload_case_modules() -> None:
    """Have the rank zygote preload RANK_PRELOAD, unless a preload is configured already or CUDA is visible
    (the zygote forks its workers, so nothing it imports may have touched CUDA; CPU-only is the safe case)."""
    if harness_config.default_preload() or harness_config.cuda_device_count() > 0:
        return
    harness.configure(preload=RANK_PRELOAD)
