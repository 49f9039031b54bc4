"""The precision model's parts (vdpcp.oracle.compare.precision): the exact run's switches, its chunks, and the comparisons."""

import math
from dataclasses import replace

import pytest
import torch

from vdpcp.oracle.compare import precision, rounding
from vdpcp.oracle.context import Arm

from .precision_runs import SPECS, exact_copy, unsharded_run


@pytest.mark.skipif(hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="torch >= 2.9: the exact run sets torch's own switches (tests/unit/test_precision_figures.py)")
def test_the_exact_run_turns_tf32_off_and_puts_every_switch_back():
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())
    cudnn.allow_tf32 = True  # torch's default: TF32 in cuDNN convolutions
    try:
        with rounding.highest_precision():
            assert not matmul.allow_tf32 and not cudnn.allow_tf32
            assert torch.get_float32_matmul_precision() == "highest"
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (saved[0], True)
        assert torch.get_float32_matmul_precision() == saved[2]
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


@pytest.mark.parametrize("chunk, groups", [(10**9, [(0, 5)]), (1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
                                           (100, [(0, 1), (1, 2), (2, 5)])])
def test_chunks_are_whole_media_items_in_order_each_as_small_as_the_chunk_allows(chunk, groups):
    spec = SPECS["video-and-images"]  # media of 1, 4, 1, 5, 1 frames: 16, 96, 12, 40, 16 patches
    batch = spec.tensors()
    subs = list(rounding.media_chunks(batch, chunk))
    starts = [0]
    for n in spec.media_frames:
        starts.append(starts[-1] + n)
    assert len(subs) == len(groups)
    rows = [len(sub.spec.images) for sub in subs]
    assert rows == [starts[b] - starts[a] for a, b in groups]
    assert torch.equal(torch.cat([sub.patches for sub in subs], dim=1), batch.patches)
    assert all(int(sub.cu_seqlens[-1]) == sub.patches.shape[1] and int(sub.cu_seqlens[0]) == 0 for sub in subs)


def test_the_exact_run_in_chunks_measures_what_it_measures_whole():
    """A tower encodes each image on its own, so the exact run may go a few images at a time: the same figures."""
    run = unsharded_run("video-and-images", seed=0)
    impl, model, batch, out, grads, weights = run.impl, run.model, run.batch, run.out, run.grads, run.weights
    ref = rounding.Reference(batch, out, grads, None, weights, None, True)
    whole, chunked = (rounding.measure(Arm(impl, model=model), ref, chunk=c) for c in (10**9, 1))
    assert whole.params == pytest.approx(chunked.params, rel=1e-6)
    assert torch.allclose(whole.input, chunked.input, rtol=1e-6)
    assert torch.allclose(whole.outputs["features"], chunked.outputs["features"], rtol=1e-6)
    assert 0 < whole.params < 1e-5 and float(whole.outputs["features"].max()) < 1e-5  # float32 against float64


@pytest.mark.parametrize("chunk", [10**9, 1])
def test_the_exact_runs_own_share_is_its_own_losss_gradient_and_leaves_the_summed_figures_as_they_were(chunk):
    """The rank-alone expectation's exact figure accumulates over chunks apart from the rest of the summed loss's
    gradients, and own + rest is the summed loss's gradient: its figures as without a share, to float64's rounding
    (a share counted twice, or left out of the input's gradient, would move them by its whole size)."""
    run = unsharded_run("video-and-images", seed=0)
    impl, model, batch, out, grads = run.impl, run.model, run.batch, run.out, run.grads
    weights, own_weights, exact = run.weights, run.own_weights, exact_copy(run)
    own_exact = torch.autograd.grad((impl.encode(exact, replace(batch, patches=batch.patches.detach().double()))
                                     * own_weights["features"].double()).sum(), list(exact.parameters()), allow_unused=True)
    own_exact = [torch.zeros_like(p) if g is None else g for p, g in zip(exact.parameters(), own_exact)]
    arm = Arm(impl, model=model)
    alone = rounding.measure(arm, rounding.Reference(batch, out, grads, own_exact, weights, own_weights, True),
                             chunk=chunk)
    without = rounding.measure(arm, rounding.Reference(batch, out, grads, None, weights, None, True), chunk=chunk)
    assert alone.own_params < 1e-12  # the same float64 gradient, summed over chunks
    assert torch.allclose(alone.input, without.input, rtol=1e-9) and alone.params == pytest.approx(without.params, rel=1e-9)


def _share(run, media: set[int]) -> dict:
    """The summed weights on the token rows of ``media`` (its images, by item), zero elsewhere: a rank's own share."""
    spec, tokens = run.batch.spec, run.impl.plan(run.batch.spec, run.case.config).tokens
    rows = [m for m in range(len(spec.media_frames)) for _ in range(spec.media_rows[m], spec.media_rows[m + 1])]
    mask = torch.tensor([rows[r] in media for r, n in enumerate(tokens) for _ in range(n)])
    return {name: w * mask.unsqueeze(-1) for name, w in run.weights.items()}


def _backwards(monkeypatch) -> list:
    calls, backward = [], torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: calls.append(1) or backward(self, *a, **k))
    return calls


def test_chunks_kept_to_one_owner_take_one_backward_each_and_measure_what_mixed_ones_do(monkeypatch):
    """With the media's owners as kinds, no chunk mixes the rank's own items with others': one backward a chunk
    where mixed chunks take two, and the same figures (the share's gradient and the summed loss's)."""
    run = unsharded_run("video-and-images", seed=0)  # five media items
    share = _share(run, {1, 2})
    kinds = ("other", "own", "own", "other", "other")
    exact = exact_copy(run)
    features = run.impl.encode(exact, replace(run.batch, patches=run.batch.patches.detach().double()))
    own_exact = torch.autograd.grad((features * share["features"].double()).sum(), list(exact.parameters()))
    figures = {}
    for hint in (None, kinds):
        calls = _backwards(monkeypatch)
        ref = rounding.Reference(run.batch, run.out, run.grads, list(own_exact), run.weights, share, True)
        figures[hint] = rounding.measure(Arm(run.impl, model=run.model), ref, chunk=10**9, kinds=hint)
        monkeypatch.undo()
        figures[hint, "backwards"] = len(calls)
    assert (figures[None, "backwards"], figures[kinds, "backwards"]) == (2, 3)  # one mixed chunk; three unmixed
    assert figures[kinds].own_params < 1e-12 and figures[None].own_params < 1e-12
    assert figures[kinds].params == pytest.approx(figures[None].params, rel=1e-9)
    assert torch.allclose(figures[kinds].input, figures[None].input, rtol=1e-9)


def test_media_groups_never_put_two_kinds_in_one_group():
    spec = SPECS["video-and-images"]
    assert spec.media_groups(10**9, ("a", "a", "b", "b", "a")) == [(0, 2), (2, 4), (4, 5)]
    assert spec.media_groups(100, ("a",) * 5) == spec.media_groups(100) == [(0, 1), (1, 2), (2, 5)]


def test_rows_compare_each_within_rtol_and_its_own_slack_and_the_worst_is_named():
    expected = torch.ones(4, 8, dtype=torch.bfloat16)
    actual = expected.clone()
    actual[2] *= 1.05  # 5% off: over rtol 1.6%, within rtol + 4% of its own slack
    slack = torch.tensor([0.0, 0.0, 0.04, 0.0])
    assert precision.compare_rows("outputs", actual, expected, slack, "token") is None
    said = precision.compare_rows("outputs", actual, expected, None, "token", names=["a", "b", "c", "d"])
    assert said == ("outputs: 1 of 4 tokens off; token c: relative 2-norm error 0.0469 exceeds torch.bfloat16's rtol "
                    "0.016"), said


def test_images_compare_per_microbatch_row_of_packed_patches():
    expected = torch.ones(1, 6, 2, dtype=torch.float32)
    actual = expected.clone()
    actual[0, 4:] *= 1.001  # the last image (patches 4 and 5) off
    said = precision.compare_rows("input grads", actual, expected, None, "image", cu_seqlens=[0, 2, 4, 6])
    assert said.startswith("input grads: 1 of 3 images off; image 2: relative 2-norm error 0.001"), said


def test_the_report_says_what_precision_ran():
    assert rounding.in_effect(torch.bfloat16, torch.device("cpu")) == "bfloat16"
    assert rounding.EXACT[torch.bfloat16] == torch.float32 and rounding.EXACT[torch.float32] == torch.float64
    assert not precision.low(torch.float64) and precision.low(torch.float32)


def test_a_batch_without_rows_is_one_chunk():
    empty = replace(SPECS["three-images"], images=(), name="none")
    assert len(list(rounding.media_chunks(empty.tensors(), 1))) == 1


@pytest.fixture
def cuda_switches():
    """torch's precision switches as they were, put back after the test (they can be read and set without a GPU)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32, matmul.allow_bf16_reduced_precision_reduction,
             matmul.allow_fp16_reduced_precision_reduction, torch.get_float32_matmul_precision())
    yield matmul, cudnn
    (matmul.allow_tf32, cudnn.allow_tf32, matmul.allow_bf16_reduced_precision_reduction,
     matmul.allow_fp16_reduced_precision_reduction) = saved[:4]
    torch.set_float32_matmul_precision(saved[4])


@pytest.mark.parametrize("convolutions, matmuls", [(True, False), (False, True)])
def test_on_cuda_the_report_says_where_tf32_was_on_for_float32(cuda_switches, convolutions, matmuls):
    matmul, cudnn = cuda_switches
    cudnn.allow_tf32, matmul.allow_tf32 = convolutions, matmuls
    said = rounding.in_effect(torch.float32, torch.device("cuda", 0))
    on = {True: "on", False: "off"}
    assert said == f"float32, TF32 {on[convolutions]} in convolutions, {on[matmuls]} in matmuls", said


@pytest.mark.parametrize("dtype, flag", [(torch.bfloat16, "allow_bf16_reduced_precision_reduction"),
                                         (torch.float16, "allow_fp16_reduced_precision_reduction")])
def test_on_cuda_the_report_says_whether_reductions_ran_in_the_half_precision_itself(cuda_switches, dtype, flag):
    matmul, _ = cuda_switches
    other = ({"allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"} - {flag}).pop()
    name = str(dtype).removeprefix("torch.")
    for reduced in (True, False):
        setattr(matmul, flag, reduced)
        setattr(matmul, other, not reduced)  # the other half precision's switch says nothing of this one
        assert rounding.in_effect(dtype, torch.device("cuda")) == \
            f"{name}, reduced-precision reductions {'on' if reduced else 'off'}"
    assert rounding.in_effect(torch.float64, torch.device("cuda")) == "float64"


def test_float16_compares_with_its_own_rtol():
    expected = torch.ones(2, 4, dtype=torch.float16)
    said = precision.compare_rows("outputs", expected * 1.01, expected, None, "token")
    assert said == ("outputs: 2 of 2 tokens off; token 0: relative 2-norm error 0.00977 exceeds torch.float16's rtol "
                    "0.001"), said


def _pairs(n=6, size=5, dtype=torch.float64):
    torch.manual_seed(3)
    return [(f"p{i}", torch.randn(size, dtype=dtype), None) for i in range(n)]


@pytest.mark.parametrize("end_to_end", [precision.END_TO_END, 7])
def test_compare_each_names_the_first_pair_off_inside_a_run_laid_end_to_end(monkeypatch, end_to_end):
    """7 elements a run: the pairs are split over runs (a 5-element one each); the default: all in one run."""
    monkeypatch.setattr(precision, "END_TO_END", end_to_end)
    pairs = [(name, a, a.clone()) for name, a, _ in _pairs()]
    assert precision.compare_each("grads", pairs) is None
    pairs[4][1][2] += 1e-3
    pairs[5][1][0] += 1e-3
    why = precision.compare_each("grads", pairs)
    assert why is not None and why.startswith("grads: p4: Tensor-likes are not close!"), why


def test_compare_each_tells_a_pair_whose_dtype_differs_where_laying_them_end_to_end_would_promote_it():
    pairs = [(name, a, a.clone()) for name, a, _ in _pairs()]
    pairs[2] = ("p2", pairs[2][1], pairs[2][2].float())
    why = precision.compare_each("grads", pairs)
    assert why is not None and why.startswith("grads: p2: The values for attribute 'dtype' do not match"), why


@pytest.mark.parametrize("end_to_end", [precision.END_TO_END, 7])
def test_max_abs_each_and_the_one_pass_figures_are_the_pairs_figures(monkeypatch, end_to_end):
    monkeypatch.setattr(precision, "END_TO_END", end_to_end)
    pairs = [(name, a, a + 0.01 * torch.randn_like(a)) for name, a, _ in _pairs(n=5)] + [
        ("odd", torch.ones(3, dtype=torch.float32), torch.zeros(3, dtype=torch.float64))]
    peak = max(precision.max_abs(a, e) for _, a, e in pairs)
    assert precision.max_abs_each(pairs) == peak
    one_pass, diff_sq, scale_sq = precision.peak_and_norms(pairs)
    assert one_pass == peak
    alike = pairs[:-1]  # without the pair of two dtypes, whose 1.0 would be the peak of any run
    assert precision.max_abs_each(alike) == precision.peak_and_norms(alike)[0] == max(
        precision.max_abs(a, e) for _, a, e in alike) < 1
    assert diff_sq == pytest.approx(sum((a.double() - e).square().sum().item() for _, a, e in pairs), rel=1e-12)
    assert scale_sq == pytest.approx(sum(e.double().square().sum().item() for _, _, e in pairs), rel=1e-12)
    assert precision.max_abs_each([]) == 0.0 and precision.peak_and_norms([]) == (0.0, 0.0, 0.0)


def test_one_pass_tells_a_pair_whose_shapes_differ_as_infinitely_far_or_fails_as_the_difference_would():
    ones, zeros = torch.ones(4, 2), torch.zeros(2, 4)
    assert precision.peak_and_norms([("same count", ones, zeros)])[0] == math.inf
    assert precision.max_abs_each([("same count", ones, zeros)]) == math.inf  # never laid end to end, as equals
    with pytest.raises(RuntimeError):
        precision.peak_and_norms([("other count", ones, torch.zeros(3))])


def test_a_parameter_with_no_elements_is_no_error_at_all():
    empty = [("empty", torch.zeros(0), torch.zeros(0))]
    assert precision.max_abs_each(empty) == 0.0 and precision.peak_and_norms(empty) == (0.0, 0.0, 0.0)
    assert precision._peak(torch.zeros(0, 3), torch.zeros(0, 3)) == 0.0


def test_a_run_is_laid_end_to_end_only_where_every_pair_shares_one_dtype_device_and_shape():
    a = torch.ones(3)
    assert precision._uniform([("p", a, a), ("q", a.clone(), a.clone())])
    assert not precision._uniform([("p", a, a), ("q", a.double(), a.double())])  # dtypes of two pairs
    assert not precision._uniform([("p", a, a.double())])  # the two sides of one pair
    assert not precision._uniform([("p", a, a.reshape(3, 1))])
    assert not precision._uniform([("p", a, a), ("q", a.to("meta"), a.to("meta"))])  # devices of two pairs
    assert not precision._uniform([("p", a, a.to("meta"))])  # the two sides of one pair


def test_close_hands_a_tensor_of_another_layout_to_assert_close():
    dense = torch.eye(3)
    assert precision.close(dense, dense.clone())
    assert not precision.close(dense.to_sparse(), dense) and not precision.close(dense, dense.to_sparse())


def test_no_more_than_end_to_end_elements_are_laid_end_to_end_but_a_larger_tensor_alone(monkeypatch):
    """The bound on what laying pairs end to end copies: a real-size tower's gradients are never copied whole."""
    monkeypatch.setattr(precision, "END_TO_END", 7)
    pairs = [(n, torch.zeros(k), None) for n, k in [("a", 3), ("b", 4), ("c", 1), ("d", 9), ("e", 2), ("f", 5)]]
    assert [[name for name, _, _ in run] for run in precision._runs(pairs)] == [["a", "b"], ["c"], ["d"], ["e", "f"]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_close_passes_exactly_what_assert_close_passes(dtype):
    """Pairs drawn across each dtype's tolerances (just inside, just outside, tiny values under atol), with NaN and
    infinities among them: close() says pass where assert_close does, and never where it would raise."""
    gen = torch.Generator().manual_seed(3)
    rtol, atol = precision.CLOSE[dtype]
    expected = (torch.randn(4000, generator=gen, dtype=torch.float64) * torch.logspace(-9, 2, 4000, dtype=torch.float64))
    verdicts = set()
    for scale in (0.5, 0.99, 1.01, 2.0):
        for i in range(40):
            bound = (atol + rtol * expected.abs()) * scale
            actual = expected + bound * torch.where(torch.rand(4000, generator=gen) < 0.5, -1.0, 1.0).double()
            if i % 4:  # one to three elements NaN or infinite in three of four pairs
                actual[torch.randperm(4000, generator=gen)[: i % 4]] = (float("nan"), float("inf"), -float("inf"))[i % 3]
            a, e = actual.to(dtype), expected.to(dtype)
            try:
                torch.testing.assert_close(a, e)
                passes = True
            except AssertionError:
                passes = False
            assert precision.close(a, e) == passes
            verdicts.add(passes)
    assert verdicts == {True, False}  # both verdicts reached, so the agreement means something
    assert not precision.close(torch.zeros(3), torch.zeros(3, dtype=torch.float64))  # left to assert_close
    assert not precision.close(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
