"""What the oracle records per rank besides its verdict, as the report shows it: the images, placeholders and
patches each rank encodes (from the plan, or inferred from the input gradients without one), the rows its tower
saw, and the largest errors, which are rounding on a passing case and the bug's size on a failing one."""

import pytest

from tests.unit.test_duck_parts import Full
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix import scenarios
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_case

MATRIX = {case.id: case for case in scenarios.matrix(cps=(2, 4), special=False, layouts=False)}
ROUNDING = 1e-12  # float64: the sharded and unsharded sums differ by a few units in the last place, never more


class NoPlan:
    """Full's parts but no plan at all: the oracle infers who encodes what from the input gradients."""

    name = "no-plan-duck"
    build_model, subject_model, inputs = Full.build_model, Full.subject_model, Full.inputs
    encode, encode_sharded = Full.encode, Full.encode_sharded


def _figures(result):
    return [(r.images, r.placeholders, r.patches, r.encoded) for r in result.ranks]


@pytest.mark.distributed
def test_a_passing_case_records_each_ranks_share_and_errors_of_rounding_only():
    result = run_case(MATRIX["three-images-cp4-reference-count"])
    assert result.verdict == "pass", result.summary()
    spec = result.case.spec
    # count split of three images over four ranks: one each on ranks 0-2, a placeholder (one patch) on rank 3
    assert _figures(result) == [(1, 0, p, p) for p in spec.row_patches] + [(0, 1, 0, 1)], result.summary()
    assert all(type(n) is int for figures in _figures(result) for n in figures)  # counts, as the JSON report shows them
    for attr in ("out_err", "input_grad_err", "param_grad_err"):
        assert 0 <= result.max_err(attr) < ROUNDING, (attr, result.max_err(attr))


@pytest.mark.distributed
def test_without_a_plan_each_ranks_share_is_inferred_from_its_input_gradients():
    spec = MicrobatchSpec(images=((16, 16), (8, 24), (24, 8)), seed=2, name="three")
    planned = run_case(Case(spec, 2, "tests.unit.test_duck_parts:Full"))
    inferred = run_case(Case(spec, 2, "tests.distributed.test_oracle_figures:NoPlan"))
    assert planned.verdict == inferred.verdict == "pass", inferred.summary()
    assert [f[:3] for f in _figures(inferred)] == [(1, 0, 16), (2, 0, 24)] == [f[:3] for f in _figures(planned)]


@pytest.mark.distributed
@pytest.mark.parametrize("mutant, attr", [("features-rolled-on-last-rank", "out_err"),
                                          ("grad-not-summed", "input_grad_err")])
def test_a_failing_case_records_the_size_of_its_error_on_the_rank_it_is_on(mutant, attr):
    result = run_case(MATRIX["eight-equal-cp2-reference-count"].with_(mutant=mutant))
    assert result.verdict == "fail", result.summary()
    assert result.max_err(attr) > 1e-3, result.summary()
    if attr == "out_err":  # the last rank's copy alone is rolled, and the failure says how, in assert_close's words
        assert result.ranks[0].out_err < ROUNDING < result.ranks[1].out_err
        assert any(f.startswith("rank 1: outputs: Tensor-likes are not close! (max abs error ") for f in result.failures)


@pytest.mark.distributed
def test_a_rank_that_skipped_its_tower_is_reported_as_having_seen_no_rows_and_names_its_layers():
    result = run_case(MATRIX["three-images-cp4-reference-count"].with_(mutant="placeholder-rank-skips-tower"))
    assert result.verdict == "fail" and [r.encoded for r in result.ranks][3] == 0, result.summary()
    assert all(r.encoded > 0 for r in result.ranks[:3]), result.summary()
    assert any("rank 3" in f and "layers never run: " in f and "blocks." in f for f in result.failures), result.summary()


@pytest.mark.distributed
def test_gathered_features_of_the_wrong_shape_fail_the_case_they_do_not_crash_it():
    result = run_case(MATRIX["three-images-cp4-reference-count"].with_(mutant="placeholders-not-dropped"))
    assert result.verdict == "fail", result.summary()  # every rank stops at the outputs: no backward, no hang
    assert all(any(f.startswith("outputs: shape (") for f in r.failures) for r in result.ranks), result.summary()
    assert all(r.input_grad_err == 0.0 == r.param_grad_err for r in result.ranks)
