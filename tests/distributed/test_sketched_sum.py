"""The oracle's sketched sum of parameter gradients over real gloo ranks (vdpcp.oracle.gradients._check_sketched_param_grads):
the ranks' count sketches sum to the sketch of their gradients' sum, so a correct sum passes on every rank and one
off fails on every rank. The toy towers sum their gradients as they are, so this is where the CPU suite runs the
sketch across processes; the real-size towers take it on the GPU (reports/gpu/README.md)."""

import math
import re

import pytest
import torch

from vdpcp import sketch
from vdpcp.case import RankResult
from vdpcp.oracle import gradients


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
        (summed,) = gradients._check_param_grads(result, model, expected, None, [extra], torch.bfloat16, 0.0)
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
        gradients._check_param_grads(result, model, None, None, [], torch.bfloat16, 0.0, shares)
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
