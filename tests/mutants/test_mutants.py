"""Proof of power: every named mutant of the sharded path is killed by a named case of the matrix.

Each mutant runs against its own kill set only (a few matrix cases, stopping at the first kill), so this
stays fast; `vdpcp mutants` falls back to the whole matrix for a survivor.
"""

import pytest

from vdpcp.feature import tensor_parallel
from vdpcp.harness import RankFailure, run_ranks
from vdpcp.matrix import scenarios
from vdpcp.matrix.expectations import known_limit
from vdpcp.matrix.runner import rank_body, run_case
from vdpcp.testing import backend_for
from vdpcp.tools.mutants import MUTANTS
from vdpcp.tools.mutants.hunt import hunt

MATRIX = {case.id: case for case in scenarios.matrix()}
NAMES = sorted(MUTANTS)
# Killed, and named, by its own test below (it waits out a TP all-reduce's timeout, shortened there: once is enough).
# The secondary-output mutant needs a second output, which the reference does not have: its own tests below.
# The partition's cost applies to Automodel's frame sharding only, and the partition bugs must be unbalanced, not
# merely killed: their own tests below.
BALANCE = ("balanced-cut-one-unit-late", "split-cost-squared")
HUNTED = [name for name in NAMES if name not in ("tp-peer-skips-placeholder-tower", "secondary-output-rolled-on-last-rank",
                                                 "partition-cost-squared", *BALANCE)]


def test_there_are_at_least_ten_mutants():
    assert len(MUTANTS) >= 10, sorted(MUTANTS)


@pytest.mark.parametrize("name", NAMES)
def test_kill_set_is_named_matrix_cases_expected_to_pass(name):
    kills = MUTANTS[name].kills
    assert kills, f"{name} has no kill set"
    for case_id in kills:
        assert case_id in MATRIX, f"{name}: kill-set case {case_id} is not in the matrix"
        limit = known_limit(MATRIX[case_id], backend_for(MATRIX[case_id]))
        assert limit is None, f"{name}: kill-set case {case_id} is expected to fail here anyway ({limit.name})"


@pytest.mark.distributed
@pytest.mark.parametrize("name", HUNTED)
def test_mutant_is_killed_by_a_named_case(name):
    found = hunt(name, [MATRIX[case_id] for case_id in MUTANTS[name].kills])
    assert found.killed, f"{name} ({MUTANTS[name].bug}) survived its kill set {found.tried}"


# Rank-asymmetric bugs: wrong on one non-zero rank only. A checker that looked at rank 0 alone would pass them.
ASYMMETRIC = [("features-rolled-on-last-rank", "eight-equal-cp2-reference-count", "rank 1: outputs"),
              ("grad-dropped-on-rank-1", "eleven-images-cp2-reference-count", "input grads (summed over ranks)"),
              ("placeholder-rank-skips-tower", "three-images-cp4-reference-count", "rank 3: execution")]


@pytest.mark.distributed
@pytest.mark.parametrize("name, case_id, names", ASYMMETRIC, ids=[a[0] for a in ASYMMETRIC])
def test_a_bug_on_one_non_zero_rank_fails_and_the_report_names_it(name, case_id, names):
    result = run_case(MATRIX[case_id].with_(mutant=name))
    assert result.verdict == "fail", result.summary()
    assert any(names in failure for failure in result.failures), result.summary()


@pytest.mark.distributed
def test_outputs_wrong_on_the_last_rank_alone_fail_the_case():
    result = run_case(MATRIX["eight-equal-cp2-reference-count"].with_(mutant="features-rolled-on-last-rank", grads=False))
    assert result.verdict == "fail"
    assert {f.split(":")[0] for f in result.failures} == {"rank 1"}, result.summary()  # rank 1 alone is blamed


SHORT_TP_WAIT_S = 2.0  # the wait itself is what is tested, not its length: the shipped 10 s would idle a worker


def with_a_short_tp_wait(ctx, case):
    """The case's rank body, its TP all-reduces giving up after SHORT_TP_WAIT_S."""
    waited = tensor_parallel.TP_WAIT_S
    tensor_parallel.TP_WAIT_S = SHORT_TP_WAIT_S
    try:
        return rank_body(ctx, case)
    finally:
        tensor_parallel.TP_WAIT_S = waited


@pytest.mark.distributed
def test_a_rank_that_skips_its_tensor_parallel_tower_is_named_not_hung():
    case = MATRIX["three-images-cp4-tp2-reference-count"].with_(mutant="tp-peer-skips-placeholder-tower")
    with pytest.raises(RankFailure) as failure:
        run_ranks(with_a_short_tp_wait, case.world_size, case, backend=backend_for(case), timeout=60)
    headline = str(failure.value).splitlines()[0]
    assert "timeout" not in headline, failure.value  # named within the case timeout
    # the first rank to give up is the skipper's TP peer, and every other rank's report points at it
    assert ("rank 6 raised vdpcp.feature.tensor_parallel.TPPeerMissing: rank 6: TP MLP of block 0 all-reduce waited "
            f"{SHORT_TP_WAIT_S:g} s: TP peer rank(s) [7] never entered it") in headline, headline


@pytest.mark.distributed
def test_the_secondary_output_mutant_does_not_apply_to_one_output_and_says_why():
    found = hunt("secondary-output-rolled-on-last-rank", [MATRIX["three-images-cp4-reference-count"]])
    assert not found.killed and not found.survived, found
    assert found.not_applicable.startswith("mutant does not apply: reference returns one output"), found


@pytest.mark.distributed
def test_the_secondary_output_mutant_is_killed_where_there_is_a_second_output():
    target = "tests.oracle.subjects:two_outputs"
    cases = [MATRIX[k].with_(impl=target) for k in MUTANTS["secondary-output-rolled-on-last-rank"].kills]
    clean = run_case(cases[0])
    assert clean.verdict == "pass", clean.summary()
    found = hunt("secondary-output-rolled-on-last-rank", cases)
    assert found.killed, found
    result = run_case(cases[0].with_(mutant="secondary-output-rolled-on-last-rank"))
    assert any("outputs 'deepstack0'" in f for f in result.failures), result.summary()
    assert not any("outputs 'features'" in f for f in result.failures), result.summary()


@pytest.mark.distributed
@pytest.mark.parametrize("name", BALANCE)
def test_a_partition_bug_of_vdpcps_own_splits_is_unbalanced_with_every_output_right(name):
    """The off-by-one cut on the contiguous balanced split, the squared cost on it and on the greedy packed one:
    outputs and gradients stay right, so only the balance judged from what each tower read can kill them."""
    for case_id in MUTANTS[name].kills:
        result = run_case(MATRIX[case_id].with_(mutant=name))
        assert result.verdict == "unbalanced", result.summary()
        assert not any(r.failures for r in result.ranks), result.summary()


@pytest.mark.distributed
def test_a_partition_balanced_by_p_squared_is_unbalanced_on_automodels_own_code():
    case = MATRIX["video-t4-ragged-cp4-reference-count"].with_(impl="automodel", split="contiguous-balanced")
    result = run_case(case.with_(mutant="partition-cost-squared"))
    assert result.verdict == "unbalanced", result.summary()
    assert run_case(case).verdict == "pass"


@pytest.mark.distributed
@pytest.mark.parametrize("cp", (2, 4, 8))
def test_as_shipped_a_partition_balanced_by_p_squared_is_unbalanced_above_its_thresholds(cp):
    """Automodel's released thresholds replicate every microbatch of the shared matrix; its own matrix's ragged frame
    units above them are where p^2 cuts other runs than the declared cost, and a correct partition passes."""
    by_id = {case.id: case for case in scenarios.matrix(cps=(cp,), impls=("automodel-shipped",))}
    case = by_id[f"automodel-shipped-ragged-above-thresholds-cp{cp}-automodel-shipped-contiguous-balanced"]
    result = run_case(case.with_(mutant="partition-cost-squared"))
    assert result.verdict == "unbalanced", result.summary()
    assert not any(r.failures for r in result.ranks), result.summary()
    assert run_case(case).verdict == "pass"
