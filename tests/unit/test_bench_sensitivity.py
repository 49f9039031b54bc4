"""vdpcp bench sensitivity says, beside its thresholds, what the exact check held on the rank it perturbs: on the H200
its gradients were not held (the backward did not repeat itself), and an "exact -" for a gradient bug reads only with
that said."""

import pytest

from vdpcp.tools.bench.sensitivity import bisect, case_verdict, chosen, line


@pytest.mark.distributed
def test_the_unperturbed_run_says_what_the_last_ranks_exact_check_held(on_the_cpu):
    case = chosen("reference", 2, "toy", "eight-equal", "float64", "gloo")
    verdict, failed, held, planted = case_verdict(case, timeout=None)
    assert (verdict, failed, planted) == ("pass", set(), None)  # no mutant, no count
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


def test_automodel_shipped_is_measured_on_the_real_case_its_released_thresholds_shard():
    """Its released thresholds replicate multi-image at both sizes (no rank holds sharded features to perturb); at
    the real size the same -k finds multi-image-32, past them; at the toy size nothing with that name is sharded."""
    assert chosen("automodel-shipped", 2, "real", "multi-image", "bfloat16", "gloo").spec.name == "multi-image-32"
    assert chosen("automodel", 2, "real", "multi-image", "bfloat16", "gloo").spec.name == "multi-image"
    assert chosen("automodel-shipped", 2, "toy", "multi-image", "float64", "gloo") is None
    assert chosen("automodel-shipped", 2, "toy", "tokens-2048", "float64", "gloo").spec.name == "automodel-shipped-tokens-2048"


@pytest.mark.distributed
def test_a_subject_without_a_case_it_shards_is_said_and_a_k_matching_nothing_is_one_usage_error(capsys, on_the_cpu):
    from vdpcp.cli import main

    argv = ["bench", "sensitivity", "--impl", "reference", "automodel-shipped", "--mutant", "scale-rank-features",
            "--grid", "1e-3", "--backend", "gloo"]
    assert main([*argv, "-k", "eight-equal"]) == 0
    out = capsys.readouterr().out
    assert "automodel-shipped float64 toy CP 2: no plain case it shards has 'eight-equal' in its id" in out, out
    assert "reference float64 toy CP 2  scale-rank-features:" in out and "1 thresholds in" in out, out
    assert main([*argv, "-k", "no-such-case"]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error == ("vdpcp bench: -k no-such-case: no plain sharded case of reference, automodel-shipped at CP 2 "
                     "(toy tower) that the implementation shards has it in its id"), error


@pytest.mark.distributed
def test_each_size_says_how_many_elements_the_instrument_moved(on_the_cpu):
    """In bf16 an element moves with probability eps over the dtype's spacing: at 1e-9 none of a toy tower's few
    thousand gradient elements moves (nothing planted, nothing to catch), at 1e-3 a share does; in float64 every
    one moves at either size."""
    case = chosen("reference", 2, "toy", "eight-equal", "bfloat16", "gloo")
    row = bisect(case, "scale-rank-grad", timeout=None, grid=(1e-9, 1e-3))
    assert row["planted"]["1e-09"] == 0 and row["planted"]["0.001"] > 0, row
    assert row["smallest"]["exact"] == 1e-3, row
    assert line(row).endswith(f"(elements moved: 1e-09 0, 0.001 {row['planted']['0.001']:,})"), line(row)
    wide = bisect(chosen("reference", 2, "toy", "eight-equal", "float64", "gloo"), "scale-rank-grad", timeout=None,
                  grid=(1e-9, 1e-3))
    assert wide["planted"]["1e-09"] == wide["planted"]["0.001"] > 0, wide
