"""MCore's gather on gloo, through vdpcp.oracle.observe.gloo_collectives: the cases its gather's backward used to stop there
(uneven token counts; a CP group of a CP x DP layout other than the first) now judge gradients, so the issue's
planted bugs that only gradients show (tests/impls/broken_mcore.py) are killed by them, on gloo, with the
check and the rank named; and each rank's report names the all_to_all that ran. The count over the whole sharded
matrix is scripts/mcore_mutant_kills.py's (docs/power.md)."""

import json
import xml.etree.ElementTree as ET

import pytest

from vdpcp.cli import main
from vdpcp.matrix import scenarios
from vdpcp.matrix.runner import run_judged
from vdpcp.oracle.observe import gloo_collectives

CASES = {case.id: case for case in scenarios.matrix(cps=(2,), impls=("mcore",))}
GATHER_BEFORE_PROJECT = "tests.impls.broken_mcore:gather_before_project"
SKIPS_TOWER = "tests.impls.broken_mcore:skips_tower"

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case_id", ["three-images-cp2-mcore-count", "three-images-cp2-dp2-mcore-count"])
def test_an_uneven_and_a_second_replica_case_judge_gradients_on_gloo_and_name_the_swap(case_id):
    judged = run_judged(CASES[case_id], backend="gloo")
    assert judged.verdict == "pass", judged.result.summary()
    assert judged.result.collectives == gloo_collectives.NOTE
    assert f"collectives: {gloo_collectives.NOTE}" in judged.result.summary()


@pytest.mark.parametrize("case_id", ["three-images-cp2-mcore-count", "three-images-cp2-dp2-mcore-count"])
def test_gather_before_project_is_killed_by_its_rank_alone_gradients(case_id):
    judged = run_judged(CASES[case_id].with_(impl=GATHER_BEFORE_PROJECT), backend="gloo")
    assert judged.verdict == "fail", judged.result.summary()
    assert "param grads (this rank alone): projector" in judged.result.failures[0]


def test_a_placeholder_rank_that_skips_its_tower_is_killed_by_the_execution_check():
    judged = run_judged(CASES["one-image-cp2-mcore-count"].with_(impl=SKIPS_TOWER), backend="gloo")
    assert judged.verdict == "fail", judged.result.summary()
    assert judged.result.failures[0].startswith("rank 1: execution: rank 1 (CP rank 1) read no row and ran no layer of its tower")


def test_an_implementation_that_never_calls_torch_distributed_nn_is_not_said_to_have():
    reference = scenarios.matrix(cps=(2,), impls=("reference",))
    (case,) = [c for c in reference if c.id == "three-images-cp2-reference-count"]
    judged = run_judged(case, backend="gloo")
    assert judged.verdict == "pass" and judged.result.collectives == ""


def test_check_names_it_in_the_json_per_case_and_rank_in_the_junit_and_under_the_table(tmp_path, capsys):
    assert main(["check", "--cp", "2", "--impl", "mcore", "-k", "three-images-cp2-mcore-count", "--backend", "gloo",
                 "--json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml")]) == 0
    assert "2 case(s) ran with " + gloo_collectives.NOTE in capsys.readouterr().out
    records = {r["id"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    sharded = ["three-images-cp2-mcore-count", "three-images-cp2-mcore-count-zigzag"]
    for case_id, record in records.items():  # the opt-out and the mismatched config issue no all_to_all
        said = gloo_collectives.NOTE if case_id in sharded else ""
        assert [record["collectives"]] + [r["collectives"] for r in record["ranks"]] == [said] * (1 + len(record["ranks"]))
    properties = ET.parse(tmp_path / "r.xml").getroot().findall("testcase/properties/property[@name='collectives']")
    assert [p.get("value") for p in properties] == [gloo_collectives.NOTE] * 2


def test_mcores_tubelet_give_up_fails_on_its_outputs_and_names_the_stale_plan_never_an_error_in_the_checker():
    """MCore's split gives up and keeps stale split points (docs/known-limits.md): its stated plan puts a rank's rows past
    the gathered outputs. The checks that compare them must say so, not raise inside vdpcp's regrouped run."""
    from pathlib import Path

    from vdpcp.cli.replay import load_case
    from vdpcp.matrix.runner import run_case

    case = load_case(Path(__file__).resolve().parents[2] / "docs" / "found" / "mcore-tubelet-give-up-cp4.json")
    result = run_case(case)
    assert result.verdict == "fail", result.summary()
    assert any(f.startswith("outputs: Tensor-likes are not close!") for f in result.ranks[0].failures), result.summary()
    assert any("past the 8 rows of the gathered outputs" in f for f in result.ranks[3].failures), result.summary()
