"""The oracle's sketched sum of parameter gradients over real gloo ranks (vdpcp.oracle.compare.gradients._check_sketched_param_grads):
the ranks' count sketches sum to the sketch of their gradients' sum, so a correct sum passes on every rank and one
off fails on every rank. The toy towers sum their gradients as they are, so this is where the CPU suite runs the
sketch across processes; the real-size towers take it on the GPU (reports/gpu/README.md)."""

import math
import re

import pytest
import torch

from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.scenarios import SCENARIOS
from vdpcp.oracle.compare import gradients, precision, rounding, sketch
from vdpcp.oracle.context import Arm


def _grads(rank: int):
    torch.manual_seed(0)  # the same weights on every rank, its own input
    model = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 1)).to(torch.bfloat16)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(rank + 1)).to(torch.bfloat16)
    model(x).sum().backward()
    return model


def sketched_sum(ctx, off: float):
    model = _grads(ctx.rank)
    every = [[p.grad.double() for p in _grads(r).parameters()] for r in range(ctx.world_size)]
    expected = [(sum(parts) * (1 + off)).to(torch.bfloat16) for parts in zip(*every)]
    width = sketch.WIDTH
    sketch.WIDTH = 1024  # the model's 1681 parameters take the sketch; restored before the worker's next case
    try:
        result = RankResult(ctx.rank)
        extra = torch.full((2,), float(ctx.rank + 1), dtype=torch.bfloat16)
        arm = Arm(model=model, dtype=torch.bfloat16, rank=ctx.rank, telemetry=result.telemetry)
        (summed,), said = gradients.check_param_grads(arm, expected, [extra], 0.0)
        result.add(said)
    finally:
        sketch.WIDTH = width
    return result.failures, summed.tolist(), result.param_grad_err != result.param_grad_err


@pytest.mark.distributed
@pytest.mark.parametrize("off", [0.0, 0.05, 1.0])
def test_the_ranks_sketches_sum_to_the_sketch_of_the_summed_gradients(run_ranks, off):
    """The figure is the sketched |sum - expected| over the expected gradients' own norm: expected = (1 + off) x the
    sum, so off / (1 + off), within the sketch's deviation at this width (sqrt(2 / 1024) of the squared norm; five
    of them). At off = 1, 0.5: over the summed sketch's norm (nearly the sum's) it would read 1."""
    got = run_ranks(sketched_sum, 2, off)
    for failures, summed, not_measured in got:
        assert summed == [3.0, 3.0] and not_measured  # the extra tensors summed as ever; no element-wise figure
        _assert_figure(failures, off, rel=5 * math.sqrt(2 / 1024) / 2)


def _assert_figure(failures: list[str], off: float, rel: float) -> None:
    """No failure at off = 0; else the one failure, whose figure is off / (1 + off) within ``rel``."""
    if off == 0:
        assert failures == [], failures
        return
    (said,) = failures
    figure = re.fullmatch(r"param grads \(summed over ranks\): relative 2-norm error (\S+) exceeds "
                          r"torch.bfloat16's rtol 0.016", said)
    assert figure, said
    assert float(figure.group(1)) == pytest.approx(off / (1 + off), rel=rel), said


def sketched_shares(ctx, off: float):
    """Each rank's own share of the expected gradients, (1 + off) x its own gradients: the expected sum is the
    shares' sum, which no rank holds (vdpcp.oracle.unsharded._sum_split)."""
    model = _grads(ctx.rank)
    shares = [(p.grad.double() * (1 + off)).to(torch.bfloat16) for p in model.parameters()]
    width = sketch.WIDTH
    sketch.WIDTH = 1024
    try:
        result = RankResult(ctx.rank)
        arm = Arm(model=model, dtype=torch.bfloat16, rank=ctx.rank, telemetry=result.telemetry)
        result.add(gradients.check_param_grads(arm, None, [], 0.0, shares)[1])
    finally:
        sketch.WIDTH = width
    return result.failures


@pytest.mark.distributed
@pytest.mark.parametrize("off", [0.0, 0.05])
def test_where_each_rank_holds_its_own_share_the_shares_sketches_are_summed_too(run_ranks, off):
    """No rank holds the expected sum: its sketch is the shares' sketches summed in the same collective, and its
    norm the figure's scale (an estimate, within the sketch's deviation, as the difference is)."""
    for failures in run_ranks(sketched_shares, 2, off):
        _assert_figure(failures, off, rel=5 * math.sqrt(2 / 1024))  # both norms estimated: twice the deviation


def _summed_figure(ctx, case, reuse: bool):
    """The summed check's sketched figure and the case's failures, with the exact run's sketch of this rank's own
    share taken as the expected one (``reuse``) or drawn again, and how many gradient elements were sketched."""
    from vdpcp.matrix import runner

    saved = (sketch.WIDTH, precision.compare_vector, sketch.sketch, rounding.Shared.share_sketch)
    figures, drawn = [], []

    def compared(what, diff_sq, scale_sq, *rest):
        if what == "param grads (summed over ranks)":
            figures.append((diff_sq, scale_sq))
        return saved[1](what, diff_sq, scale_sq, *rest)

    def counted(pairs, device):
        pairs = list(pairs)
        drawn.append(sum(t.numel() for pair in pairs for t in pair if t is not None))
        return saved[2](pairs, device)

    sketch.WIDTH, precision.compare_vector, sketch.sketch = 1 << 12, compared, counted
    if not reuse:
        rounding.Shared.share_sketch = lambda self: None
    try:
        failures = runner.rank_body(ctx, case).failures
    finally:  # a warm worker runs the next case with the real ones
        sketch.WIDTH, precision.compare_vector, sketch.sketch, rounding.Shared.share_sketch = saved
    return figures, failures, sum(drawn)


@pytest.mark.distributed
def test_the_summed_check_takes_the_exact_runs_sketch_of_the_own_share_and_reads_the_same_figure(run_ranks):
    """Where the exact run is shared out and sketched each rank's own share already, the summed check's expected
    sketch is that one: the same figure bit for bit on the CPU (the same hash, drawn on the same device), with three
    sketches of a tower's gradients a rank where there were four (the exact run's own share and its exact
    counterpart, the sharded gradients, the own share again)."""
    case = Case(next(s.spec for s in SCENARIOS if s.spec.name == "three-images"), 2, dtype="bfloat16")
    again, reused = run_ranks(_summed_figure, 2, case, False), run_ranks(_summed_figure, 2, case, True)
    for (figures, failures, drawn), (figures_reused, failures_reused, drawn_reused) in zip(again, reused):
        assert failures == failures_reused == [] and len(figures) == 1 and figures[0][1] > 0
        assert figures_reused == figures
        tower = drawn - drawn_reused  # the own share's elements, sketched once, not twice: a tower's worth
        assert (drawn, drawn_reused) == (4 * tower, 3 * tower), (drawn, drawn_reused)


@pytest.mark.distributed
def test_under_tensor_parallelism_the_summed_check_draws_the_shares_sketch_itself(run_ranks):
    """At TP 2 a rank holds parts of the tower's parameters, whose sketch hashes other elements than the exact run's
    sketch of the whole tower: the summed check draws its own, and a correct case passes with the same figures."""
    case = Case(next(s.spec for s in SCENARIOS if s.spec.name == "three-images"), 2, dtype="bfloat16").with_(tp=2)
    again, reused = (run_ranks(_summed_figure, case.world_size, case, reuse) for reuse in (False, True))
    for (figures, failures, _), (figures_reused, failures_reused, _) in zip(again, reused):
        assert failures == failures_reused == [] and len(figures) == 1
        assert figures_reused == figures
