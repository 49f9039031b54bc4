"""What a `vdpcp fuzz` run does unless told otherwise: it draws 100 microbatches, the default its --help states;
and each case gives the other ranks half a second once one raised (not the harness's 3 s: the raiser's error is
the signature, so waiting longer on the rest only slows the search). Fakes stand in for the search and for the
ranks, so nothing is drawn or run."""

import pytest

from vdpcp.cli import main
from vdpcp.harness.pool import FAULT_GRACE_S as HARNESS_GRACE_S
from vdpcp.matrix.case import RankResult
from vdpcp.matrix.runner import CaseResult
from vdpcp.tools import fuzz


class Passing:
    """A runner that passes every case and records the grace each was given."""

    def __init__(self):
        self.graces = []

    def __call__(self, case, backend=None, timeout=None, fault_grace=None) -> CaseResult:
        self.graces.append(fault_grace)
        return CaseResult(case, ranks=[RankResult(0, 0, len(case.spec.images), 0, 4, backend="gloo")], backend="gloo")


def test_a_search_draws_100_microbatches_by_default_as_its_help_says(tmp_path, monkeypatch, capsys):
    searched = []
    monkeypatch.setattr(fuzz, "fuzz", lambda search, out_dir, on_run=None: searched.append(search) or fuzz.FuzzReport(search))
    assert main(["fuzz", "--cp", "2", "--out", str(tmp_path)]) == 0
    assert [search.budget for search in searched] == [100]
    assert fuzz.Search(cp=2).budget == 100
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["fuzz", "--help"])
    assert "(default: 100)" in " ".join(capsys.readouterr().out.split())


def test_each_case_gives_the_other_ranks_half_a_second_once_one_raised(monkeypatch):
    runner = Passing()
    monkeypatch.setattr(fuzz, "run_case", runner)
    fuzz.fuzz(fuzz.Search(cp=2, budget=3))
    assert runner.graces == [0.5] * 3 and 0.5 < HARNESS_GRACE_S
