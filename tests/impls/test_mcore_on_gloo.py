"""MCore's gather on gloo, through vdpcp.gloo_collectives: the cases its gather's backward used to stop there
(uneven token counts; a CP group of a CP x DP layout other than the first) now judge gradients, so the issue's
planted bugs that only gradients show (tests/impls/broken_mcore.py) are killed by them, on gloo, with the
check and the rank named; and each rank's report names the all_to_all that ran. The count over the whole sharded
matrix is scripts/mcore_mutant_kills.py's (docs/power.md)."""

import pytest

from vdpcp import gloo_collectives, scenarios
from vdpcp.runner import run_judged

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
    assert judged.result.failures[0].startswith("rank 1: execution: rank 1 (CP rank 1) did not run its tower")


def test_an_implementation_that_never_calls_torch_distributed_nn_is_not_said_to_have():
    reference = scenarios.matrix(cps=(2,), impls=("reference",))
    (case,) = [c for c in reference if c.id == "three-images-cp2-reference-count"]
    judged = run_judged(case, backend="gloo")
    assert judged.verdict == "pass" and judged.result.collectives == ""
