"""Saved regressions (vdpcp/fixtures/regressions, shrunk and saved by `vdpcp fuzz`): each file says how it runs and
how it failed, and fails that same way on every run; with the feature as specified (the file's failure mode
dropped), each passes. The matrix also runs them as ordinary specs."""

from pathlib import Path

import pytest

from vdpcp.matrix import saved
from vdpcp.matrix.runner import run_case
from vdpcp.tools.fuzz import FAULT_GRACE_S, signature

REGRESSIONS = sorted((Path(__file__).resolve().parents[2] / "vdpcp" / "fixtures" / "regressions").glob("*.json"))
RUNS = 2


def test_every_saved_regression_describes_its_case_and_failure():
    assert REGRESSIONS
    for path in REGRESSIONS:
        found = saved.load(path)
        assert "cp" in found.case and found.signature, path


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_fails_the_same_way_every_run(path):
    found = saved.load(path)
    runs = [run_case(found.to_case(), fault_grace=FAULT_GRACE_S) for _ in range(RUNS)]  # as fuzz ran it
    assert [signature(result) for result in runs] == [found.signature] * RUNS


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_passes_as_specified(path):
    found = saved.load(path)
    result = run_case(found.to_case().with_(even_pad=True, mutant=None))
    assert result.passed, result.summary()
