"""The A/B judge: arms that agree within the dtype's bound pass; a difference above it fails; a NaN or an
infinity in either arm, per step or in any rank's final-parameter figures, fails at every dtype.

Pure: the ranks' records are built by hand, no rank runs.
"""

import math

import pytest

from vdpcp.ab.judge import PER_STEP, judge, tolerance_for
from vdpcp.ab.stream import Draw
from vdpcp.ab.train import ARMS, Run
from vdpcp.spec import MicrobatchSpec

STEPS = 3
DRAWS = [[Draw(MicrobatchSpec(images=((16, 16),) * 2, name=f"step{k}"), "even")] for k in range(STEPS)]
BAD = [math.nan, math.inf, -math.inf]
FINAL = ("max_param_diff", "param_diff_norm", "param_update_norm")  # what each rank records of its final parameters


def _run(dtype="float64"):
    return Run("reference", 2, STEPS, 1, dtype, "multi-image", "tiny", 0)


def _ranks(cp=2, scale=None):
    """Both arms equal on every rank: losses 1, 2, 3 and grad norms 10, 20, 30 (times ``scale`` in arm on)."""
    def arm(name):
        factor = 1.0 if scale is None or name == "off" else scale
        return {q: [factor * (k + 1) * (1 if q == "loss" else 10) for k in range(STEPS)] for q in PER_STEP} | {
            "peak_bytes": None, "step_s": None}

    return [{"device": "cpu", "backend": "gloo", "arms": {a: arm(a) for a in ARMS}, "max_param_diff": 0.0,
             "param_diff_norm": 0.0, "param_update_norm": 1.0} for _ in range(cp)]


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_equal_arms_pass_and_a_difference_above_the_dtypes_bound_fails(dtype):
    tolerance = tolerance_for(_run(dtype))
    assert judge(_run(dtype), DRAWS, _ranks(), 0.0).passed
    assert judge(_run(dtype), DRAWS, _ranks(scale=1 + tolerance / 2), 0.0).passed
    failed = judge(_run(dtype), DRAWS, _ranks(scale=1 + 2 * tolerance), 0.0)
    assert not failed.passed and "relative difference" in failed.failures[0]


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("quantity", PER_STEP)
def test_a_non_finite_value_in_either_arm_fails(quantity, arm, bad, dtype):
    ranks = _ranks()
    for r in ranks:  # all-reduced: every rank records the same
        r["arms"][arm][quantity][1] = bad
    judged = judge(_run(dtype), DRAWS, ranks, 0.0)
    assert not judged.passed
    assert any(f.startswith(f"step 2: {quantity.replace('_', ' ')}") and "not finite" in f for f in judged.failures)


@pytest.mark.parametrize("bad", BAD, ids=str)
def test_both_arms_blown_up_alike_fail(bad):
    ranks = _ranks()
    for r in ranks:
        for arm in ARMS:
            r["arms"][arm]["loss"][0] = bad
    assert not judge(_run(), DRAWS, ranks, 0.0).passed


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("key", FINAL)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_non_finite_final_parameter_figure_on_any_rank_fails_at_every_dtype(rank, key, dtype):
    ranks = _ranks()
    ranks[rank][key] = math.nan
    judged = judge(_run(dtype), DRAWS, ranks, 0.0)
    assert not judged.passed and any(f"rank {rank}'s {key} nan" in f for f in judged.failures), judged.failures


@pytest.mark.parametrize("rank", [0, 1])
def test_the_judged_parameter_gap_is_the_worst_ranks_nan_included(rank):
    ranks = _ranks()
    ranks[rank]["param_diff_norm"] = math.nan
    assert math.isnan(judge(_run(), DRAWS, ranks, 0.0).param_diff)
    ranks[rank]["param_diff_norm"] = 1.0  # finite, but far above float64's bound on one rank only
    judged = judge(_run(), DRAWS, ranks, 0.0)
    assert judged.param_diff == 1.0 and not judged.passed
