"""vdpcp bench sensitivity says, beside its thresholds, what the exact check held on the rank it perturbs: on the H200
its gradients were not held (the backward did not repeat itself), and an "exact -" for a gradient bug reads only with
that said."""

import pytest

from vdpcp.bench.sensitivity import _verdict, bisect, chosen


@pytest.mark.distributed
def test_the_unperturbed_run_says_what_the_last_ranks_exact_check_held(on_the_cpu):
    case = chosen("reference", 2, "toy", "eight-equal", "float64", "gloo")
    verdict, failed, held = _verdict(case, timeout=None)
    assert (verdict, failed) == ("pass", set())
    assert held.startswith("outputs, input and parameter gradients bitwise") and held.endswith("(deterministic: cpu)"), held


@pytest.mark.distributed
def test_a_features_bug_far_below_float64s_tolerance_is_caught_by_the_exact_check_alone(on_the_cpu):
    case = chosen("reference", 2, "toy", "eight-equal", "float64", "gloo")
    row = bisect(case, "scale-rank-features", timeout=None)
    assert row["smallest"]["exact"] == 1e-12 and row["smallest"]["outputs"] > 1e-9, row


@pytest.mark.distributed
def test_a_grid_of_two_sizes_runs_those_two_alone(on_the_cpu):
    """--grid 1e-9 1e-3, as on the GPU: whether each check catches the target size, and the exact check's floor."""
    case = chosen("reference", 2, "toy", "eight-equal", "float64", "gloo")
    row = bisect(case, "scale-rank-features", timeout=None, grid=(1e-9, 1e-3))
    assert set(row["runs"]) == {"1e-09", "0.001"}, row["runs"]
    assert (row["smallest"]["exact"], row["smallest"]["outputs"], row["largest"]) == (1e-9, 1e-3, 1e-3), row
