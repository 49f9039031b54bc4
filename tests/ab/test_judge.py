"""The A/B judge: arms that agree within the dtype's bound pass; a difference above it fails; a NaN or an
infinity in either arm, per step or in any rank's final-parameter figures, fails at every dtype.

Pure: the ranks' records are built by hand, no rank runs.
"""

import math

import pytest

from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.tools.ab.judge import PER_STEP, judge, tolerance_for
from vdpcp.tools.ab.stream import Draw
from vdpcp.tools.ab.train import ARMS, Run

STEPS = 3
DRAWS = [[Draw(MicrobatchSpec(images=((16, 16),) * 2, name=f"step{k}"), "even")] for k in range(STEPS)]
BAD = [math.nan, math.inf, -math.inf]
FINAL = ("max_param_diff", "param_diff_norm", "param_update_norm")  # what each rank records of its final parameters


def _run(dtype="float64"):
    return Run("reference", 2, STEPS, 1, dtype, "multi-image", "toy", 0)


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


def test_the_bound_is_the_dtypes_and_final_parameters_are_judged_at_float64_only():
    assert tolerance_for(_run()) == 1e-10
    for dtype, eps in (("float32", 2.0**-23), ("bfloat16", 2.0**-7)):
        assert tolerance_for(Run("reference", 2, 5, 2, dtype, "multi-image", "toy", 0)) == 2 * 5 * 2 * eps
    ranks = _ranks()
    ranks[1]["param_diff_norm"] = 1e-3  # far above float64's bound, rounding at float32's (reported, not judged)
    assert not judge(_run("float64"), DRAWS, ranks, 0.0).passed
    judged = judge(_run("float32"), DRAWS, ranks, 0.0)
    assert judged.passed and judged.param_diff == 1e-3 and not judged.params_judged


def test_a_zero_reference_value_is_compared_absolutely():
    ranks = _ranks()
    for r in ranks:
        for q in PER_STEP:
            r["arms"]["off"][q][0] = 0.0
            r["arms"]["on"][q][0] = 0.5e-10
    assert judge(_run(), DRAWS, ranks, 0.0).passed
    for r in ranks:
        r["arms"]["on"]["loss"][0] = 2e-10
    assert not judge(_run(), DRAWS, ranks, 0.0).passed


def test_failures_beyond_the_first_four_are_counted_not_listed():
    judged = judge(_run(), DRAWS, _ranks(scale=2.0), 0.0)  # every quantity of every step: 9 failures
    assert len(judged.failures) == 4 and judged.failures[-1].endswith("; and 5 more")
    assert judged.failures[0].startswith("step 1: loss 2 (on) vs 1 (off), relative difference 1.00e+00, above float64's")


def test_the_figures_shown_are_the_busiest_ranks_memory_and_the_slowest_ranks_steps_after_the_first():
    ranks = _ranks()
    for rank, r in enumerate(ranks):
        for arm in ARMS:
            r["arms"][arm]["peak_bytes"] = 100 * (rank + 1) + (arm == "on")
            r["arms"][arm]["step_s"] = [9.0, 1.0 + rank, 3.0 - rank]  # the first step (warm-up) left out
    judged = judge(_run(), DRAWS, ranks, 7.5)
    assert judged.peak_bytes == {"on": 201, "off": 200} and judged.step_s == {"on": 2.5, "off": 2.5}  # slowest: 2, then 3
    assert judged.seconds == 7.5 and judged.devices == ["cpu"] and judged.backend == "gloo"
    ranks[0]["arms"]["on"]["step_s"] = None  # off a GPU: not measured
    ranks[1]["arms"]["on"]["peak_bytes"] = None
    judged = judge(_run(), DRAWS, ranks, 0.0)
    assert judged.step_s["on"] is None and judged.peak_bytes["on"] == 101
    for r in ranks:
        r["arms"]["off"]["peak_bytes"] = None
        r["arms"]["off"]["step_s"] = [4.0]
    judged = judge(_run(), DRAWS, ranks, 0.0)
    assert judged.peak_bytes["off"] is None and judged.step_s["off"] == 4.0  # one step: it is all there is


def test_the_largest_parameter_gap_over_ranks_is_reported():
    ranks = _ranks()
    ranks[1]["max_param_diff"] = 3e-13
    assert judge(_run(), DRAWS, ranks, 0.0).max_param_diff == 3e-13


def test_a_difference_exactly_at_the_bound_passes():
    run = _run("float32")  # 2 x 3 steps x 1 x 2**-23: a dyadic bound, so 1 + bound is exact
    bound = tolerance_for(run)
    assert judge(run, DRAWS, _ranks(scale=1 + bound), 0.0).passed
    ranks = _ranks()
    for r in ranks:
        r["param_diff_norm"], r["param_update_norm"] = 1e-10, 1.0  # exactly float64's bound
    assert judge(_run(), DRAWS, ranks, 0.0).passed


def test_the_parameter_gap_is_relative_to_how_far_training_moved_them():
    ranks = _ranks()
    for r in ranks:
        r["param_diff_norm"], r["param_update_norm"] = 1e-12, 1e-3  # 1e-9 of the update: above float64's 1e-10
    judged = judge(_run(), DRAWS, ranks, 0.0)
    assert judged.param_diff == pytest.approx(1e-9) and not judged.passed
    for r in ranks:
        r["param_diff_norm"], r["param_update_norm"] = 5e-11, 0.0  # training did not move them: the gap itself
    judged = judge(_run(), DRAWS, ranks, 0.0)
    assert judged.param_diff == 5e-11 and judged.passed


def test_a_one_rank_ab_is_judged_from_its_only_rank():
    judged = judge(_run(), DRAWS, _ranks(cp=1), 0.0)
    assert judged.passed and judged.backend == "gloo" and [s.values["loss"]["on"] for s in judged.steps] == [1, 2, 3]


def test_exactly_four_failures_are_all_listed_and_nothing_is_counted():
    ranks = _ranks()
    for r in ranks:
        for step in (0, 1):
            for q in ("loss", "lm_grad_norm"):
                r["arms"]["on"][q][step] *= 2
    judged = judge(_run(), DRAWS, ranks, 0.0)
    assert len(judged.failures) == 4 and not any("more" in f for f in judged.failures), judged.failures
