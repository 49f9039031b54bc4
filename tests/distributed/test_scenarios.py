"""The scenario table says what the issue asks of the matrix, and its expectations are decided by shape.

Pure: no ranks run here (the matrix itself runs in test_matrix.py).
"""

import json

import pytest

from tests.oracle import subjects
from vdpcp.contract.protocol import GROUP_MISMATCH_TEXT
from vdpcp.feature.plan import STRATEGIES
from vdpcp.feature.spec import MicrobatchSpec, SpecError
from vdpcp.matrix import expectations, scenarios
from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.runner import CaseResult

MATRIX = scenarios.matrix()
FAMILIES = {"fewer-images", "exact-remainder", "multi-image", "tubelets", "dataset"}


def _cases(**where):
    return [c for c in MATRIX if all(getattr(c, k) == v for k, v in where.items())]


def test_at_least_150_distributed_cases_with_unique_ids():
    ids = [c.id for c in MATRIX]
    assert len(ids) >= 150
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_runs_every_cp_size_both_impls_and_zigzag_at_every_cp_size(family):
    cases = [c for c in MATRIX if scenarios.family_of(c) == family]
    assert {c.cp for c in cases} == {1, 2, 4, 8}
    assert {c.impl for c in cases} == {"reference", "mcore"}
    assert {c.cp for c in cases if c.loss == "zigzag"} == {1, 2, 4, 8}


@pytest.mark.parametrize("split", ["balanced", "packed"])
def test_other_splits_run_for_the_reference_only_and_where_they_differ_from_earlier_ones(split):
    cases = _cases(split=split)
    assert cases and all(c.impl == "reference" for c in cases)
    assert all(not scenarios._same_plan_as_an_earlier_split(c, STRATEGIES) for c in cases)


def test_the_issue_scenarios_are_there():
    names = {c.spec.name for c in MATRIX}
    assert {"one-image", "three-images", "eight-equal", "eleven-images", "mixed-sizes", "non-square", "video-t2-even",
            "video-t2-ragged", "video-t4-even", "video-t4-ragged", "few-tubelets-t2", "video-and-images",
            "doc-qa", "multi-image", "video", "empty"} <= names
    assert {c.cp for c in MATRIX if c.spec.name == "one-image"} >= {2, 4, 8}
    assert any(c.spec.name == "three-images" and c.cp == 4 for c in MATRIX)
    assert {c.cp for c in MATRIX if not c.vision_dp_over_cp} >= {2, 4, 8}
    assert {c.impl for c in MATRIX if expectations.expects_group_error(c)} == {"reference", "mcore"}
    assert {c.dp for c in MATRIX if expectations.expects_group_error(c)} == {1, 2}


def test_tensor_parallel_layouts_run_for_implementations_with_a_tp_tower():
    assert {(c.cp, c.tp, c.impl) for c in MATRIX if c.tp > 1} == {(cp, tp, "reference") for cp, tp in scenarios.TP_LAYOUTS}


def test_layouts_put_data_parallel_replicas_around_cp_for_both_impls():
    layouts = {(c.cp, c.dp, c.impl) for c in MATRIX if c.dp > 1}
    assert {(cp, dp) for cp, dp, _ in layouts} == set(scenarios.LAYOUTS)
    assert {impl for _, _, impl in layouts} == {"reference", "mcore"}


REFUSED = "tests.oracle.subjects:backward_refused"  # declares a limit of its backward alone on gloo


def test_every_case_whose_backward_alone_hits_a_limit_also_runs_outputs_only():
    matrix = scenarios.matrix(impls=(REFUSED,))
    limited = [c for c in matrix if c.loss == "rank" and c.grads
               and expectations.known_limit(c, "gloo") is subjects.BACKWARD_REFUSED]
    assert len(limited) >= 40
    for case in limited:  # a loader twin's forward, outputs only, is its tower case's
        assert case.with_(grads=False, pixels="tower") in matrix, case.id


def test_mcore_meets_no_limit_on_gloo_that_it_does_not_meet_on_nccl_and_has_no_outputs_only_cases():
    # Its gather's backward runs on gloo (vdpcp.oracle.observe.gloo_collectives): every gradient case is judged there.
    cases = _cases(impl="mcore")
    assert all(expectations.known_limit(c, "gloo") is expectations.known_limit(c, "nccl") for c in cases)
    assert all(c.grads for c in cases)


def _result(case, error=None, failures=(), backend="gloo"):
    ranks = [] if error else [RankResult(r, r, 1, 0, 4, failures=list(failures), backend=backend) for r in range(case.cp)]
    return CaseResult(case, ranks=ranks, error=error, backend=backend)


def test_judge_strict_xfail():
    case = Case(MicrobatchSpec(images=((16, 16),) * 3, name="u"), 2, REFUSED)
    limit = subjects.BACKWARD_REFUSED
    assert expectations.judge(_result(case, error=f"rank 0 raised RuntimeError: {limit.signature} at index 1"))[0] == "xfail"
    assert expectations.judge(_result(case))[0] == "xpass"  # the limit is gone: a failure
    assert expectations.judge(_result(case, error="rank 1 raised ValueError: something else"))[0] == "error"
    assert expectations.judge(_result(case, backend="nccl"))[0] == "pass"
    assert "xpass" not in expectations.PASSING


def test_judge_group_mismatch_needs_the_documented_error_from_every_rank():
    case = Case(MicrobatchSpec(images=((16, 16),), name="m"), 2, config_cp=4)
    message = f"reference: {GROUP_MISMATCH_TEXT}: context_parallel_size=4 but the CP group has 2 ranks"
    both = f"failed on 2 of 2 ranks: rank 0 raised GroupMismatchError: {message}; rank 1 raised GroupMismatchError: {message}"
    one = f"failed on 2 of 2 ranks: rank 0 raised GroupMismatchError: {message}; rank 1 hung: still running"
    assert expectations.judge(_result(case, error=both))[0] == "pass"
    verdict, why = expectations.judge(_result(case, error=one))
    assert verdict == "fail" and "rank 1 did not raise" in why and "a rank hung" in why
    assert expectations.judge(_result(case))[0] == "fail"  # no error at all


def test_every_json_under_fixtures_is_a_scenario_recursively(tmp_path):
    (tmp_path / "regressions" / "deep").mkdir(parents=True)
    (tmp_path / "a.json").write_text(json.dumps({"name": "a", "images": [[8, 8]]}))
    (tmp_path / "regressions" / "deep" / "b.json").write_text(json.dumps({"name": "b", "images": [[8, 8], [8, 16]]}))
    table = {s.spec.name: s for s in scenarios.scenarios(tmp_path)}
    assert table["a"].family == "fixture" and table["b"].family == "regressions/deep"
    assert {c.spec.name for c in scenarios.matrix(table=list(table.values()))} >= {"a", "b"}


def test_the_repository_fixtures_are_in_the_matrix():
    for path, spec in scenarios.fixture_specs():
        assert any(c.spec == spec for c in MATRIX), path


def test_a_bad_fixture_names_its_file_and_field(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"name": "bad", "images": [[8, 7]]}))
    with pytest.raises(SpecError, match=r"bad\.json.*'images'"):
        scenarios.scenarios(tmp_path)


def test_two_different_specs_with_one_name_are_rejected(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"name": "three-images", "images": [[8, 8]]}))
    with pytest.raises(SpecError, match="three-images"):
        scenarios.scenarios(tmp_path)
