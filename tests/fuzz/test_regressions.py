"""Saved regressions (fixtures/regressions, shrunk by `vdpcp fuzz`): with their failure mode on, each fails the
same way on every run; with the feature as specified, each passes. The matrix also runs them as ordinary specs."""

from pathlib import Path

import pytest

from vdpcp.capture import cp_from_name
from vdpcp.case import Case
from vdpcp.fuzz import signature
from vdpcp.runner import run_case
from vdpcp.spec import MicrobatchSpec

REGRESSIONS = Path(__file__).resolve().parents[2] / "fixtures" / "regressions"
RUNS = 3

# (file, how the case departs from the feature as specified, the signature it must fail with)
SAVED = [
    ("no-even-pad-cp4.json", dict(even_pad=False), "error: raised ValueError: pixel shuffle needs an even patch grid, got #x#"),
    ("mutant-placeholder-drop-mismatch-cp4.json", dict(mutant="placeholder-drop-mismatch"),
     "fail: outputs: shape (#), expected (#)"),
]


def _case(file: str, **mode) -> Case:
    spec = MicrobatchSpec.load(REGRESSIONS / file)
    return Case(spec, cp_from_name(spec.name), **mode)


def test_every_saved_regression_has_a_row():
    assert sorted(p.name for p in REGRESSIONS.glob("*.json")) == sorted(row[0] for row in SAVED)


@pytest.mark.parametrize("file, mode, expected", SAVED, ids=[row[0] for row in SAVED])
def test_fails_the_same_way_every_run(file, mode, expected):
    assert [signature(run_case(_case(file, **mode))) for _ in range(RUNS)] == [expected] * RUNS


@pytest.mark.parametrize("file", [row[0] for row in SAVED])
def test_passes_as_specified(file):
    result = run_case(_case(file))
    assert result.passed, result.summary()
