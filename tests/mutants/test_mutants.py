"""Proof of power: every named mutant of the sharded path is killed by a named case of the matrix.

Each mutant runs against its own kill set only (a few matrix cases, stopping at the first kill), so this
stays fast; `vdpcp mutants` falls back to the whole matrix for a survivor.
"""

import pytest

from tests.distributed.matrix_support import backend_for
from vdpcp import scenarios
from vdpcp.mutants import MUTANTS, hunt

MATRIX = {case.id: case for case in scenarios.matrix()}
NAMES = sorted(MUTANTS)


def test_there_are_at_least_ten_mutants():
    assert len(MUTANTS) >= 10, sorted(MUTANTS)


@pytest.mark.parametrize("name", NAMES)
def test_kill_set_is_named_matrix_cases_expected_to_pass(name):
    kills = MUTANTS[name].kills
    assert kills, f"{name} has no kill set"
    for case_id in kills:
        assert case_id in MATRIX, f"{name}: kill-set case {case_id} is not in the matrix"
        limit = scenarios.known_limit(MATRIX[case_id], backend_for(MATRIX[case_id]))
        assert limit is None, f"{name}: kill-set case {case_id} is expected to fail here anyway ({limit.name})"


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_mutant_is_killed_by_a_named_case(name):
    found = hunt(name, [MATRIX[case_id] for case_id in MUTANTS[name].kills])
    assert found.killed, f"{name} ({MUTANTS[name].bug}) survived its kill set {found.tried}"
