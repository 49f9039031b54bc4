"""The regrouped reference (vdpcp.oracle.compare.regrouped): each rank held bitwise to an unsharded encode of exactly its media.

A bug of 1e-9 relative on one rank's features (or on the gradient it hands back) is inside float64's assert_close
tolerance (rtol 1e-7), so the whole-microbatch checks pass it; the regrouped reference must fail it, naming the
rank. Correct runs stay green and say what was held (RankResult.exact).
"""

import pytest
import torch

from tests.oracle import subjects
from vdpcp import oracle
from vdpcp.feature import loss
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls import resolve
from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.runner import run_case
from vdpcp.matrix.scenarios import matrix
from vdpcp.oracle import unsharded
from vdpcp.oracle.compare import determinism, regrouped, rounding
from vdpcp.oracle.context import Arm

VIDEO = MicrobatchSpec(images=((8, 8),) * 5 + ((8, 12),) * 2, num_frames=(3, 1, 1, 2), temporal_patch_size=2, seed=3,
                       name="video")


def _case(case_id: str, **changes) -> Case:
    impl = next(name for name in ("qwen2_5_vl", "automodel", "mcore", "reference") if f"-{name}-" in case_id)
    return next(c for c in matrix(impls=(impl,)) if c.id == case_id).with_(**changes)


# --- pure parts ------------------------------------------------------------------------------------------------


def test_a_ranks_rows_become_a_microbatch_whose_media_keep_their_frames_together():
    cut = regrouped.sub_spec(VIDEO, [1, 2, 3, 5, 6])
    assert cut.images == tuple(VIDEO.images[r] for r in (1, 2, 3, 5, 6))
    assert cut.num_frames == (2, 1, 2)  # rows 1-2 of the first video, the still at row 3, the whole second video
    assert regrouped.sub_spec(MicrobatchSpec(images=((8, 8), (4, 8), (8, 4))), [0, 2]).num_frames is None


def test_a_sub_batch_holds_exactly_those_rows_patches_as_a_leaf_of_its_own():
    batch = VIDEO.tensors()
    sub = regrouped.sub_batch(batch, [3, 5])
    cu = batch.cu_seqlens.tolist()
    assert torch.equal(sub.patches[0], torch.cat([batch.patches[0, cu[3]:cu[4]], batch.patches[0, cu[5]:cu[6]]]))
    assert sub.patches.is_leaf and not sub.patches.requires_grad  # pixels are data, as the batch's
    batch.patches.requires_grad_(True)
    assert regrouped.sub_batch(batch, [3, 5]).patches.requires_grad  # where the batch's pixels need a gradient
    assert sub.cu_seqlens.tolist() == [0, cu[4] - cu[3], cu[4] - cu[3] + cu[6] - cu[5]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_fingerprint_tells_one_flipped_bit_and_matches_equal_bits(dtype):
    t = torch.randn(40, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    flipped = t.clone()
    flipped.view(regrouped.BITS[t.element_size()]).view(-1)[517] ^= 1  # the last bit of one element's mantissa
    signed = t.clone()
    signed.view(-1)[3] = -signed.view(-1)[3]  # the top bit (float64's is above the 48 the print keeps whole)
    assert regrouped.fingerprint(t) == regrouped.fingerprint(t.clone()) < 2**48
    assert regrouped.fingerprint(flipped) != regrouped.fingerprint(t) != regrouped.fingerprint(signed)


def test_loss_weights_sum_over_eight_ranks_exactly_in_bf16_in_any_order():
    draws = [loss.sixteenths(torch.randn(4096, generator=torch.Generator().manual_seed(r), dtype=torch.float64))
             for r in range(8)]
    assert all(((w * 16) % 2 == 1).all() and w.abs().max() < 2 for w in draws)  # odd sixteenths, never zero
    exact = sum(draws)
    for order in (range(8), reversed(range(8)), (3, 0, 7, 1, 6, 2, 5, 4)):
        total = torch.zeros(4096, dtype=torch.bfloat16)
        for r in order:
            total = total + draws[r].bfloat16()
        assert torch.equal(total.double(), exact)


def _flags() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def test_strict_deterministic_algorithms_are_turned_on_on_cuda_only_where_cublas_allows_and_restored(monkeypatch):
    cuda, before, model = torch.device("cuda"), _flags(), torch.nn.Linear(2, 2)
    result = RankResult(0)
    with determinism.deterministic(torch.device("cpu"), result, model):
        assert _flags() == before
    assert result.deterministic == "cpu" and determinism.exact_grads(result)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with determinism.deterministic(cuda, result, model):
        assert _flags() == before
    assert result.deterministic.startswith("off") and not determinism.exact_grads(result)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with pytest.raises(KeyError), determinism.deterministic(cuda, result, model):  # restored even when the case raises
        assert _flags() == (True, False)  # strict: under warn_only torch keeps flash attention's backward atomic
        raise KeyError("a case that raised")
    assert _flags() == before and result.deterministic == "on"


@pytest.mark.parametrize("subject", ["no_deterministic_forward", "no_deterministic_backward"])
def test_an_op_with_no_deterministic_kernel_reruns_the_unsharded_arm_under_warn_only_and_says_so(monkeypatch, subject):
    """Strict mode refuses the op (in the forward, or the backward as bilinear interpolation's on CUDA): the
    unsharded arm runs again under warn_only, the case goes on with its gradients not held exactly, and the model's
    later cases start under warn_only. Strict mode is CUDA's; turned on here on the CPU, where put_ is refused too."""
    monkeypatch.setattr(determinism, "STRICT", ("cuda", "cpu"))
    impl, cpu, before = getattr(subjects, subject), torch.device("cpu"), _flags()
    case = _case("eight-equal-cp2-reference-count").with_(impl=f"tests.oracle.subjects:{subject}")
    model, spec = impl.build_model(case, torch.float64, cpu), oracle.replica_spec(case, 0)
    result = RankResult(0)
    with determinism.deterministic(cpu, result, model):
        assert _flags() == (True, False)
        ref = unsharded.run_unsharded(Arm(impl, case, model, torch.float64, cpu, clock=oracle.Clock(result),
                                          telemetry=result.telemetry), spec)
        assert _flags() == (True, True)
    assert _flags() == before
    assert ref is not None  # an unsharded error would have raised unsharded.Unencodable
    assert result.deterministic == "on, but put_ has none" and not determinism.exact_grads(result)
    plain = unsharded.run_unsharded(Arm(impl, case, model, torch.float64, cpu), spec)
    assert all(torch.equal(a, b) for a, b in zip(ref.grads, plain.grads))  # no gradient left over from the refusal
    later = RankResult(0)
    with determinism.deterministic(cpu, later, model):
        assert _flags() == (True, True)
    assert later.deterministic == "on, but put_ has none"


def test_relaxed_turns_deterministic_algorithms_off_for_its_stretch_and_gives_back_the_cases_setting():
    before = _flags()
    try:
        for setting in [(True, False), (True, True)]:
            torch.use_deterministic_algorithms(setting[0], warn_only=setting[1])
            with pytest.raises(KeyError), determinism.relaxed():
                assert _flags() == (False, False)
                raise KeyError("a check that raised")
            assert _flags() == setting
        torch.use_deterministic_algorithms(False)
        with determinism.relaxed():
            assert _flags() == (False, False)
        assert _flags() == (False, False)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_the_rounding_measurement_runs_outside_deterministic_algorithms_and_the_arms_inside(monkeypatch):
    """The exact run that measures rounding is held to nothing bit for bit: it leaves deterministic algorithms off
    (in float32 at the real size they cost attention's fast backward), and the arms after it get them back."""
    monkeypatch.setattr(determinism, "STRICT", ("cuda", "cpu"))
    measured, measure = [], rounding.measure

    def watched(*args, **kwargs):
        measured.append(_flags())
        return measure(*args, **kwargs)

    monkeypatch.setattr(rounding, "measure", watched)
    case = _case("eight-equal-cp2-reference-count", dtype="float32")
    impl, cpu = resolve(case.impl), torch.device("cpu")
    model, spec, result = impl.build_model(case, torch.float32, cpu), oracle.replica_spec(case, 0), RankResult(0)
    with determinism.deterministic(cpu, result, model):
        ref = unsharded.run_unsharded(Arm(impl, case, model, torch.float32, cpu, clock=oracle.Clock(result),
                                          telemetry=result.telemetry), spec)
        assert _flags() == (True, False)
    assert ref is not None and measured == [(False, False)], measured
    assert result.deterministic == "on"


# --- on ranks ----------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("case_id", ["eight-equal-cp2-reference-count", "video-and-images-cp2-reference-packed",
                                     "eight-equal-cp2-qwen2_5_vl-count", "mixed-sizes-cp2-automodel-contiguous-balanced"])
def test_a_correct_run_is_bitwise_its_ranks_regrouped_runs(case_id):
    result = run_case(_case(case_id))
    assert result.passed, result.summary()
    assert all(r.exact.startswith("outputs, input and parameter gradients") for r in result.ranks), \
        [r.exact for r in result.ranks]


@pytest.mark.distributed
@pytest.mark.parametrize("mutant", ["scale-rank-features@1e-9", "scale-rank-grad@1e-9", "nudge-token@1e-9"])
@pytest.mark.parametrize("case_id", ["eight-equal-cp2-reference-count", "eight-equal-cp2-qwen2_5_vl-count"])
def test_a_bug_inside_float64s_tolerance_fails_only_the_exact_check(mutant, case_id):
    result = run_case(_case(case_id, mutant=mutant))
    assert result.verdict == "fail", result.summary()
    assert all("exact (regrouped)" in f for f in result.failures), result.summary()  # assert_close absorbed it


@pytest.mark.distributed
def test_a_backward_that_does_not_repeat_itself_is_not_held_bitwise_and_says_so():
    result = run_case(_case("eight-equal-cp2-reference-count").with_(impl="tests.oracle.subjects:jittery_backward"))
    assert result.passed, result.summary()  # a false alarm of the exact check before the backward was run twice
    assert all(r.exact.startswith("outputs bitwise") and "did not repeat itself" in r.deterministic
               for r in result.ranks), [(r.exact, r.deterministic) for r in result.ranks]
