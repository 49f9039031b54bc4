"""bf16 and float32: the sharded encoder against the unsharded one in the precisions GPUs train in.

Gradients in these dtypes are compared as vectors (vdpcp.oracle._compare_norm): splitting a sum over tokens
differently moves single elements near cancellation, never the whole tensor, while a sharding bug moves the whole
tensor. These cases check both halves of that claim: the feature passes, and bugs are still caught, in each dtype.
"""

import pytest

from vdpcp.matrix.runner import run_case
from vdpcp.matrix.scenarios import matrix

DTYPES = ("bfloat16", "float32")
CASES = ("eleven-images-cp4-reference-count", "mixed-sizes-cp4-reference-balanced",
         "video-t2-ragged-cp4-reference-balanced", "three-images-cp4-reference-count-zigzag",
         # the TP tower's MLP sums split over TP ranks, so its outputs round apart from the plain reference's
         # element-wise: they compare as vectors with the measured rounding
         "three-images-cp2-tp2-reference-count")
# float32's element-wise tolerances failed these correct runs (the unsharded float32 gradient is itself 2e-5 off
# float64's): as vectors they pass.
FLOAT32_CASES = ("mixed-sizes-cp4-qwen2_5_vl-count", "mixed-sizes-cp8-qwen2_5_vl-count")
# Pixels as a loader hands them (float32, on the host where the subject moves its own) into a bf16 tower: its own
# cast runs, and an empty rank's placeholder that follows the pixels comes out float32 where the tower's is bf16.
LOADER_CASES = ("three-images-cp4-reference-count-loader", "mixed-sizes-cp2-qwen2_5_vl-count-loader")
KILLS = (("grad-not-summed", "eight-equal-cp2-reference-count"),
         ("grad-averaged", "eight-equal-cp2-reference-count"),
         ("gather-before-project", "eight-equal-cp2-reference-count"),
         ("replicated-loss", "eight-equal-cp2-reference-count"))


def _case(case_id, dtype):
    impl = "qwen2_5_vl" if "qwen2_5_vl" in case_id else "reference"
    return next(c for c in matrix(impls=(impl,)) if c.id == case_id).with_(dtype=dtype)


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_id", CASES)
def test_sharded_matches_unsharded_in_low_precision(case_id, dtype):
    result = run_case(_case(case_id, dtype))
    assert result.passed, result.summary()


@pytest.mark.distributed
@pytest.mark.parametrize("case_id, dtype", [(c, "float32") for c in FLOAT32_CASES] + [(c, "bfloat16") for c in LOADER_CASES])
def test_a_third_party_tower_in_float32_and_a_loaders_pixels_in_bf16_pass(case_id, dtype):
    result = run_case(_case(case_id, dtype))
    assert result.passed, result.summary()


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mutant,case_id", KILLS)
def test_gradient_bugs_are_caught_in_low_precision(mutant, case_id, dtype):
    result = run_case(_case(case_id, dtype).with_(mutant=mutant))
    assert result.verdict == "fail", result.summary()
    assert any("grads" in f for f in result.failures), result.summary()


@pytest.mark.distributed
def test_a_placeholder_in_the_pixels_dtype_fails_a_bf16_tower():
    case = _case("one-image-cp2-reference-count-loader", "bfloat16").with_(mutant="placeholder-takes-pixels-dtype")
    result = run_case(case)
    assert result.verdict == "fail", result.summary()
    assert any("torch.float32 on cpu, where the unsharded encode's are torch.bfloat16" in f for f in result.failures)
