"""vdpcp.oracle.compare.precision's figures, to the digit: the relative distances the slack is made of (at any magnitude, a tiny
gradient's too), the slack being twice them, and the messages that state both bounds."""

import math
from dataclasses import replace

import pytest
import torch

from vdpcp.oracle.compare import precision, rounding
from vdpcp.oracle.context import Arm

from .precision_runs import exact_copy, unsharded_run

TINY = 1e-6  # a gradient's magnitude far under 1: a relative figure must not depend on it


@pytest.mark.parametrize("scale", [1.0, TINY])
def test_relative_is_the_two_norm_of_the_difference_over_the_exact_ones_at_any_magnitude(scale):
    f64 = dict(dtype=torch.float64)
    exact = [torch.tensor([3.0, 0.0], **f64) * scale, torch.tensor([[4.0]], **f64) * scale]  # |exact| = 5 scale
    actual = [exact[0] + torch.tensor([0.0, 1.0], **f64) * scale, exact[1]]  # |difference| = scale
    assert precision.relative(actual, exact) == pytest.approx(0.2, rel=1e-12)
    assert precision.relative([None, exact[1]], exact) == pytest.approx(3 / 5, rel=1e-12)  # None: zeros
    assert precision.relative([None], [None]) == 0.0
    assert precision.relative(actual, [None, None]) > 1e290  # against nothing: as far as it gets, not a division error


@pytest.mark.parametrize("scale", [1.0, TINY])
def test_row_and_segment_relative_are_per_row_at_any_magnitude(scale):
    exact = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]], dtype=torch.float64) * scale
    actual = exact + torch.tensor([[0.5, 0.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64) * scale
    assert precision.row_relative(actual, exact).tolist() == pytest.approx([0.1, 0.0, 0.5], rel=1e-12)
    packed = lambda t: t.reshape(1, 3, 2)  # noqa: E731  three patches [1, N, D]; segments [0, 2) and [2, 3)
    got = precision.segment_relative(packed(actual), packed(exact), [0, 2, 3])
    assert got.tolist() == pytest.approx([0.5 / math.sqrt(26), 0.5], rel=1e-12)
    flat = precision.row_relative(torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64) * scale,
                                  torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64) * scale)
    assert flat.tolist() == pytest.approx([0.0, 0.0, 1.0], rel=1e-12)  # a vector: each element a row


def test_a_vector_within_rtol_plus_slack_passes_at_the_bound_and_the_message_states_both_bounds():
    rtol = precision.RTOL[torch.bfloat16]
    assert precision.compare_vector("param grads", (rtol + 0.1) ** 2, 1.0, torch.bfloat16, 0.1) is None  # at the bound
    said = precision.compare_vector("param grads", 4.0, 100.0, torch.bfloat16, 0.1)  # 2 / 10: 0.2 > 0.016 + 0.1
    assert said == ("param grads: relative 2-norm error 0.2 exceeds torch.bfloat16's rtol 0.016 + twice the unsharded "
                    "run's own rounding (0.05)"), said
    assert precision.compare_vector("p", 4.0, 100.0, torch.bfloat16, 0.0) == (
        "p: relative 2-norm error 0.2 exceeds torch.bfloat16's rtol 0.016")


def test_a_row_message_states_its_own_slack_halved_as_the_distance_it_measured():
    expected = torch.ones(2, 4, dtype=torch.bfloat16)
    actual = expected.clone()
    actual[1] *= 1.25
    said = precision.compare_rows("outputs", actual, expected, torch.tensor([0.0, 0.1]), "token")
    assert said == ("outputs: 1 of 2 tokens off; token 1: relative 2-norm error 0.25 exceeds torch.bfloat16's rtol "
                    "0.016 + twice the unsharded run's own rounding of that token (0.05)"), said


def test_the_slack_of_every_quantity_is_twice_its_distance_from_the_exact_run():
    run = unsharded_run("three-images", seed=3, own=True)
    impl, batch, out, grads, own = run.impl, run.batch, run.out, run.grads, run.own
    measured = rounding.measure(Arm(impl, model=run.model),
                                rounding.Reference(batch, out, grads, own, run.weights, run.own_weights, True))

    exact = exact_copy(run)
    weights, own_weights = run.weights, run.own_weights
    patches = batch.patches.detach().double().requires_grad_(True)
    features = impl.encode(exact, replace(batch, patches=patches))
    own_exact = torch.autograd.grad((features * own_weights["features"].double()).sum(), list(exact.parameters()),
                                    retain_graph=True)
    (features * weights["features"].double()).sum().backward()
    assert measured.params == pytest.approx(2 * precision.relative(grads, [p.grad for p in exact.parameters()]), rel=1e-6)
    assert measured.own_params == pytest.approx(2 * precision.relative(own, own_exact), rel=1e-6)
    assert torch.allclose(measured.input, 2 * precision.segment_relative(batch.patches.grad, patches.grad,
                                                                         batch.cu_seqlens), rtol=1e-6)
    assert torch.allclose(measured.outputs["features"], 2 * precision.row_relative(out["features"], features), rtol=1e-6)
    assert 0 < measured.params < 1e-5 and 0 < measured.own_params < 1e-5


NEW_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")


@pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no fp32_precision (the legacy flags: tests/unit/test_precision.py)")
@pytest.mark.parametrize("stack", ["new", "legacy"])
def test_the_exact_run_sets_torchs_own_switches_to_ieee_and_back_whichever_api_the_stack_used(stack):
    """A training stack that set TF32 through torch >= 2.9's switches cannot read the legacy flags (torch raises on
    the mix): the exact run must neither read them nor leave either API changed."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision, torch.get_float32_matmul_precision())
    try:
        if stack == "new":
            matmul.fp32_precision, conv.fp32_precision = "tf32", "tf32"
        else:
            matmul.allow_tf32 = True
        before = (matmul.fp32_precision, conv.fp32_precision)
        assert rounding.in_effect(torch.float32, torch.device("cuda")) == \
            "float32, TF32 on in convolutions, on in matmuls"
        with rounding.highest_precision():
            assert all(api.fp32_precision == "ieee" for api in rounding._fp32_switches())
            assert rounding.in_effect(torch.float32, torch.device("cuda")) == \
                "float32, TF32 off in convolutions, off in matmuls"
        assert (matmul.fp32_precision, conv.fp32_precision) == before
        if stack == "legacy":
            assert matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # the legacy flags read as they were
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved[:2]
        torch.set_float32_matmul_precision(saved[2])
        matmul.fp32_precision = saved[0]


def test_a_zero_row_off_is_named_with_its_error_over_nothing_and_empty_tensors_differ_by_nothing():
    expected = torch.zeros(2, 3, dtype=torch.float32)
    expected[0] = 1.0
    actual = expected.clone()
    actual[1, 0] = 0.5  # the zero row 1 is off, over the floor of ZERO_ROW x rtol x the largest row
    said = precision.compare_rows("outputs", actual, expected, None, "token")
    assert said.startswith("outputs: 1 of 2 tokens off; token 1: relative 2-norm error 5e+299 exceeds"), said
    empty = torch.zeros(0, 4)
    assert precision.max_abs(empty, empty) == 0.0 and precision.max_abs(empty, torch.zeros(0, 5)) == math.inf


def test_relative_skips_only_a_pair_both_none_and_goes_on_with_the_rest():
    e = [torch.tensor([3.0, 4.0], dtype=torch.float64)]
    a = [e[0] + torch.tensor([0.0, 0.5], dtype=torch.float64)]
    assert precision.relative([None] + a, [None] + e) == precision.relative(a, e) == pytest.approx(0.1, rel=1e-12)


def test_relative_figures_against_a_zero_row_are_huge_and_finite_never_inf_or_nan():
    exact = torch.zeros(2, 2, dtype=torch.float64)
    exact[0, 0] = 1.0
    actual = exact.clone()
    actual[1, 1] = 1e-3
    rows = precision.row_relative(actual, exact)
    assert rows[0] == 0.0 and 1e290 < rows[1] < math.inf
    assert precision.row_relative(exact, exact).tolist() == [0.0, 0.0]  # zero against zero: 0, not nan
    segments = precision.segment_relative(actual.reshape(1, 2, 2), exact.reshape(1, 2, 2), [0, 1, 2])
    assert segments[0] == 0.0 and 1e290 < segments[1] < math.inf
    assert precision.segment_relative(exact.reshape(1, 2, 2), exact.reshape(1, 2, 2), [0, 1, 2]).tolist() == [0.0, 0.0]


def test_a_vector_message_states_the_relative_error_whatever_the_scale():
    said = precision.compare_vector("p", 1e-6, 1e-4, torch.bfloat16, 0.0)  # 0.001 / 0.01 = 0.1
    assert said == "p: relative 2-norm error 0.1 exceeds torch.bfloat16's rtol 0.016", said
    said = precision.compare_vector("p", 4.0, 0.0, torch.bfloat16, 0.0)  # against nothing
    assert said == "p: relative 2-norm error 2e+300 exceeds torch.bfloat16's rtol 0.016", said


def test_max_abs_is_the_largest_absolute_difference():
    a = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    e = torch.tensor([[1.5, -2.0], [0.5, 1.0]])
    assert precision.max_abs(a, e) == 3.0 and precision.max_abs(a, a) == 0.0


def test_the_zero_row_floor_is_a_share_of_the_largest_rows_rtol():
    rtol = precision.RTOL[torch.float32]
    expected = torch.zeros(2, 4, dtype=torch.float64)
    expected[0] = 5.0  # the largest row: norm 10
    floor = precision.ZERO_ROW * rtol * 10.0
    for off, passes in ((0.5 * floor, True), (2 * floor, False)):
        actual = expected.clone()
        actual[1, 0] = off  # the zero row, off by less or more than the floor
        said = precision.compare_rows("outputs", actual.float(), expected.float(), None, "token")
        assert (said is None) == passes, (off, said)
    nothing = torch.zeros(3, 4)
    assert precision.compare_rows("outputs", nothing, nothing, None) is None  # no error is never over the bound


def test_the_row_named_is_the_one_furthest_over_its_own_bound():
    rtol = precision.RTOL[torch.float32]
    expected = torch.zeros(2, 1, dtype=torch.float64)
    expected[:, 0] = torch.tensor([100.0, 1.0])
    floor = precision.ZERO_ROW * rtol * 100.0
    actual = expected.clone()
    actual[0, 0] += 3.2 * (rtol * 100.0 + floor)  # 3.2 times its bound, the larger error
    actual[1, 0] += 3.5 * (rtol * 1.0 + floor)  # 3.5 times its bound: the worst
    said = precision.compare_rows("outputs", actual.float(), expected.float(), None, "token")
    assert said.startswith("outputs: 2 of 2 tokens off; token 1: "), said


@pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no fp32_precision (the legacy flags: tests/unit/test_precision.py)")
@pytest.mark.parametrize("dtype, device, tf32", [(torch.bfloat16, "cuda", True), (torch.float16, "cuda", False),
                                                 (torch.float32, "cuda", False), (torch.bfloat16, "cpu", False)])
def test_the_exact_run_takes_tf32_only_where_it_is_finer_than_the_arms_and_on_cuda(dtype, device, tf32):
    """A bf16 case's exact run on a GPU may run on TF32's tensor cores (11 significant bits against the arms' 8); a
    float16 or float32 case's may not (TF32 is no finer), nor anything on the CPU, whose kernels have no TF32."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision)
    try:
        matmul.fp32_precision, conv.fp32_precision = "ieee", "tf32"  # the stack's: neither is what the run wants
        with rounding.exact_math(dtype, torch.device(device)):
            assert {api.fp32_precision for api in rounding._fp32_switches()} == {"tf32" if tf32 else "ieee"}
        assert (matmul.fp32_precision, conv.fp32_precision) == ("ieee", "tf32")
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved
