"""How the oracle compares parameter gradients (vdpcp.oracle.compare.gradients.check_param_grads): summed over the CP group in buckets
of at most precision.BUCKET elements (a larger parameter alone), in float64 element by element, the first parameter
off named once, not every one after it; below float64, a tower with more parameters than vdpcp.oracle.compare.sketch.WIDTH as the
sum of the ranks' count sketches; and the gradient handed to each output's backward (vdpcp.oracle.observe.handed): a write
into it seen row by row, and a text-stream difference that is exactly the write not said twice."""

import math

import pytest
import torch

from vdpcp.matrix.case import RankResult
from vdpcp.oracle.compare import gradients, precision, sketch
from vdpcp.oracle.context import Arm


@pytest.mark.parametrize("width", [sketch.WIDTH, 16])  # float64 sums the gradients themselves at any size
def test_float64_parameter_gradients_off_name_the_first_parameter_off_once(monkeypatch, one_rank_sums, width):
    monkeypatch.setattr(sketch, "WIDTH", width)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)).double()
    model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    expected[1] += 1.0  # 0.bias and 1.weight are off
    expected[2] += 1.0
    result = RankResult(0)
    extra = torch.ones(2, dtype=torch.float64)
    (summed,), said = gradients.check_param_grads(Arm(model=model, telemetry=result.telemetry), expected, [extra], 0.0)
    result.add(said)
    assert torch.equal(summed, extra)
    (said,) = result.failures
    assert said.startswith("param grads (summed over ranks): 0.bias: Tensor-likes are not close!"), said
    assert result.param_grad_err == 1.0


def test_parameters_go_in_runs_of_at_most_a_bucket_and_a_larger_one_alone():
    bucket = precision.BUCKET
    params = [torch.empty(1).expand(n) for n in (bucket // 2, bucket // 2, 1, 2 * bucket, 3)]  # sizes, no memory
    assert gradients._buckets(params) == [[0, 1], [2], [3], [4]]
    assert gradients._buckets([]) == []


def _bf16_grads():
    model = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 1)).to(torch.bfloat16)
    model(torch.randn(8, 40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)).sum().backward()
    return model, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("off", [0.0, 0.8, 1.25])
def test_a_tower_larger_than_the_sketch_is_summed_as_a_sketch_held_to_the_same_bound(monkeypatch, one_rank_sums, off):
    monkeypatch.setattr(sketch, "WIDTH", 1024)  # the model's 1681 parameters take the sketch
    model, grads = _bf16_grads()
    gen = torch.Generator().manual_seed(1)
    noise = [torch.randn(g.shape, generator=gen, dtype=torch.float64) for g in grads]
    scale = off * precision.RTOL[torch.bfloat16] * precision.relative(grads, [torch.zeros_like(g) for g in grads]) / \
        precision.relative(noise, [torch.zeros_like(n) for n in noise])
    expected = [(g.double() + scale * n).to(torch.bfloat16) for g, n in zip(grads, noise)]
    true = precision.relative(grads, expected) / precision.RTOL[torch.bfloat16]  # what an exact sum would measure
    result = RankResult(0)
    extra = torch.ones(3, dtype=torch.bfloat16)
    arm = Arm(model=model, dtype=torch.bfloat16, telemetry=result.telemetry)
    (summed,), said = gradients.check_param_grads(arm, expected, [extra], 0.0)
    result.add(said)
    assert torch.equal(summed, extra) and math.isnan(result.param_grad_err)  # no element-wise figure: not measured
    assert abs(true - off) < 0.1
    if off <= 1:
        assert result.failures == []
    else:
        (said,) = result.failures
        assert said.startswith("param grads (summed over ranks): relative 2-norm error "), said
        assert said.endswith("exceeds torch.bfloat16's rtol 0.016"), said


def test_a_tower_no_larger_than_the_sketch_sums_its_gradients_as_they_are(monkeypatch, one_rank_sums):
    monkeypatch.setattr(sketch, "WIDTH", 1681)
    model, grads = _bf16_grads()
    result = RankResult(0)
    result.add(gradients.check_param_grads(Arm(model=model, dtype=torch.bfloat16, telemetry=result.telemetry), grads,
                                           [], 0.0)[1])
    assert result.failures == [] and result.param_grad_err == 0.0  # measured element by element: none off


# --- the gradient handed to each output's backward (vdpcp.oracle.observe.handed) -------------------------------------


class _DoublesInPlace(torch.autograd.Function):
    """The identity, whose backward doubles the gradient it is handed in that very buffer, rows 1 and 2 only."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad[1:3].mul_(2)
        return grad


def _merged_backward(write: bool):
    """Two outputs merged into their prompts by vdpcp's loss, the first through a backward that writes if asked."""
    from vdpcp.feature import loss
    from vdpcp.feature.spec import MicrobatchSpec
    from vdpcp.matrix.case import Case
    from vdpcp.oracle.observe import handed

    case = Case(MicrobatchSpec(images=((4, 4),), name="one"), 2)
    losses = loss.case_loss(case, case.spec, {"features": (4, 2), "deepstack0": (4, 2)}, torch.float64, "cpu")
    prompt = losses.prompt()  # before the encode, as the oracle embeds it (vdpcp.feature.loss: why it matters)
    x = torch.ones(4, 2, dtype=torch.float64, requires_grad=True)
    out = {"features": _DoublesInPlace.apply(x * 1) if write else x * 1, "deepstack0": x * 2}
    with handed.Handed(out) as kept:
        loss.rank_loss(out, losses, prompt, 0).backward()
    return kept.written(), losses, prompt


def test_a_backward_that_writes_into_the_gradient_it_is_handed_is_seen_row_by_row_and_one_that_does_not_is_not():
    from vdpcp.oracle.observe import handed

    written, _, _ = _merged_backward(write=True)
    assert list(written) == ["features"] and (written["features"].rows, written["features"].of) == (2, 4)
    assert written["features"].delta[[0, 3]].eq(0).all() and written["features"].delta[1:3].ne(0).all()
    line = handed.line(RankResult(3, 1), written)
    assert line.startswith("gradient written: rank 3 (CP rank 1), output 'features' (2 of 4 rows changed): ")
    assert handed.WROTE in line and handed.DOCS in line
    assert _merged_backward(write=False)[0] == {}


def test_a_text_stream_difference_that_is_exactly_the_write_is_not_said_again_and_any_other_is():
    from vdpcp.oracle.observe import handed

    written, losses, prompt = _merged_backward(write=True)
    got, want, wrote = prompt.grads(), losses.table_grads(0), handed.in_tables(written, losses)
    result = RankResult(0)
    result.add(gradients.check_text(Arm(), got, want, losses.tokens, "this rank alone"))
    assert len(result.failures) == 1 and "text grads 'features' (this rank alone)" in result.failures[0]
    result = RankResult(0)
    result.add(gradients.check_text(Arm(), got, want, losses.tokens, "this rank alone", wrote))
    assert result.failures == []  # the write explains it
    got["deepstack0"] = got["deepstack0"] + 1.0  # a difference no write explains
    result.add(gradients.check_text(Arm(), got, want, losses.tokens, "this rank alone", wrote))
    assert len(result.failures) == 1 and "text grads 'deepstack0' (this rank alone)" in result.failures[0]
