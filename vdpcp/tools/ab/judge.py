"""Pass or fail of an A/B, from what the ranks recorded, and the tolerance it is held to.

The arms are one training run computed two ways: the gathered features are the unsharded ones row for row,
and the gradients differ only in the order their sums are taken in (per-rank partial sums, then the CP
reduction, against one sum). Every difference is rounding, so the bound is the dtype's (``tolerance``):

- float64: 1e-10 relative, on the loss and the grad norms (vision tower + projector, LM) of every step and on
  the final parameters: far above the rounding gaps of correct runs, far below the quietest gradient bug.
- float32 and bfloat16: ``2 x steps x accumulate x eps`` relative on the loss and the grad norms of every step,
  as each microbatch's gradient sum is rounded its own way in each arm; the final parameters are reported, not
  judged, since AdamW turns a rounding-noise gradient into a whole step.

The measured gaps behind both bounds: docs/ab.md.

At every dtype, a NaN or an infinity in either arm fails the A/B on its own (a relative difference of NaN must
never read as "within tolerance"), and so does one in any rank's final-parameter figures, judged or not: an
arm that blew up is a result, not rounding.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from vdpcp.oracle import TORCH_DTYPES
from vdpcp.tools.ab.stream import Draw
from vdpcp.tools.ab.train import ARMS, Run

FLOAT64_TOLERANCE = 1e-10
PER_STEP = ("loss", "vision_grad_norm", "lm_grad_norm")
FINAL = ("max_param_diff", "param_diff_norm", "param_update_norm")  # each rank's, over the final parameters
SHOWN = 4  # failures listed in full; the rest are counted


@dataclass(frozen=True)
class Step:
    index: int  # from 1
    draws: tuple[Draw, ...]
    values: dict[str, dict[str, float]]  # quantity -> arm -> value (the same on every rank: all-reduced)

    def rel(self, quantity: str) -> float:
        on, off = self.values[quantity]["on"], self.values[quantity]["off"]
        return abs(on - off) / abs(off) if off else abs(on - off)


@dataclass
class Judged:
    run: Run
    tolerance: float
    params_judged: bool
    steps: list[Step]
    max_param_diff: float  # the largest |on - off| over every parameter element, over ranks
    param_diff: float  # ||on - off|| / ||off - initial|| (judged at float64)
    peak_bytes: dict[str, int | None]  # arm -> the busiest rank's peak allocated memory (None: not on a GPU)
    step_s: dict[str, float | None]  # arm -> mean step time of the slowest rank, the first step left out
    devices: list[str]
    backend: str
    seconds: float
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def judge(run: Run, draws: list[list[Draw]], ranks: list[dict], seconds: float) -> Judged:
    steps = [Step(k + 1, tuple(step), {q: {arm: ranks[0]["arms"][arm][q][k] for arm in ARMS} for q in PER_STEP})
             for k, step in enumerate(draws)]
    tolerance = tolerance_for(run)
    judged = Judged(
        run, tolerance, run.dtype == "float64", steps,
        max_param_diff=_worst(r["max_param_diff"] for r in ranks),
        param_diff=_worst(r["param_diff_norm"] / r["param_update_norm"] if r["param_update_norm"] else r["param_diff_norm"]
                          for r in ranks),
        peak_bytes={arm: _busiest(r["arms"][arm]["peak_bytes"] for r in ranks) for arm in ARMS},
        step_s={arm: _step_time([r["arms"][arm]["step_s"] for r in ranks]) for arm in ARMS},
        devices=sorted({r["device"] for r in ranks}), backend=ranks[0]["backend"], seconds=seconds,
    )
    above = f", above {run.dtype}'s {tolerance:.2g}"
    wrong = []
    for s in steps:
        for q in PER_STEP:
            on, off = s.values[q]["on"], s.values[q]["off"]
            said = f"step {s.index}: {q.replace('_', ' ')} {on:.10g} (on) vs {off:.10g} (off)"
            if not (math.isfinite(on) and math.isfinite(off)):
                wrong.append(f"{said}: not finite")
            elif not s.rel(q) <= tolerance:
                wrong.append(f"{said}, relative difference {s.rel(q):.2e}{above}")
    for rank, r in enumerate(ranks):
        blown = [key for key in FINAL if not math.isfinite(r[key])]
        if blown:
            wrong.append(f"final parameters: rank {rank}'s {', '.join(f'{k} {r[k]}' for k in blown)}: not finite")
    if judged.params_judged and math.isfinite(judged.param_diff) and not judged.param_diff <= tolerance:
        wrong.append(f"final parameters: ||on - off|| is {judged.param_diff:.2e} of how far training moved them{above}")
    if wrong:
        more = f"; and {len(wrong) - SHOWN} more" if len(wrong) > SHOWN else ""
        judged.failures = wrong[:SHOWN]
        judged.failures[-1] += more
    return judged


def tolerance_for(run: Run) -> float:
    """The relative bound of ``run``'s dtype (the module docstring says why)."""
    if run.dtype == "float64":
        return FLOAT64_TOLERANCE
    return 2 * run.steps * run.accumulate * torch.finfo(TORCH_DTYPES[run.dtype]).eps


def _worst(values) -> float:
    """The largest value, NaN where any is NaN (Python's max keeps or drops a NaN by where it stands)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _busiest(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _step_time(per_rank: list[list[float] | None]) -> float | None:
    """Mean over steps of the slowest rank's step time; the first step (allocator and kernel warm-up) left out
    where there are more."""
    if any(times is None for times in per_rank):
        return None
    slowest = [max(times) for times in zip(*per_rank)]
    return statistics.mean(slowest[1:] or slowest)
