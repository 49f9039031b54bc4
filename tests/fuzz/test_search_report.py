"""What a search reports: every run counted once, as drawn (up to and including the first failure) or as a
shrinking run (after it), so ``runs`` is their sum; passes, specs the unsharded encoder rejects and ranks out of
memory counted apart and never a finding; only other signatures in ``other_failures``; a finding that failed
again when rerun said to be reproduced, and one whose shrunk spec passed when hypothesis reran it (Flaky) still
reported and saved, but said not to be. A Search with no seed is the seed-0 search (the CLI's default), and
a Search is a value: hashable, its fields fixed. A fake runner stands in for the ranks: milliseconds a search."""

import dataclasses
import json

import pytest

from vdpcp.matrix.case import RankResult
from vdpcp.matrix.runner import CaseResult
from vdpcp.tools import fuzz
from vdpcp.tools.fuzz import Search, signature

WRONG_SHAPE = "outputs: shape (2, 48), expected (1, 48)"


def _result(case, failure=None, unsharded_error=None) -> CaseResult:
    rank = RankResult(0, 0, len(case.spec.images), 0, 4, backend="gloo", unsharded_error=unsharded_error)
    if failure:
        rank.failures.append(failure)
    return CaseResult(case, ranks=[rank], backend="gloo")


class Runner:
    """Fails every spec of two or more media items the same way (a wrong output shape); records each run."""

    def __init__(self):
        self.verdicts = []

    def __call__(self, case, backend=None, timeout=None, fault_grace=None) -> CaseResult:
        result = _result(case, WRONG_SHAPE if len(case.spec.media_frames) >= 2 else None)
        self.verdicts.append(result.verdict)
        return result


def test_runs_are_drawn_until_the_first_failure_then_shrinking_runs_each_counted_once(monkeypatch):
    runner = Runner()
    monkeypatch.setattr(fuzz, "run_case", runner)
    report = fuzz.fuzz(Search(cp=2, budget=50))
    assert report.finding is not None, "the fake fails every spec of two media items; the search found none"
    verdicts = runner.verdicts
    drawn = verdicts.index("fail") + 1
    assert (report.drawn, report.shrink_runs) == (drawn, len(verdicts) - drawn), verdicts
    assert report.shrink_runs > 0, "the first failure was not shrunk at all: nothing to count"
    assert report.runs == len(verdicts) == report.drawn + report.shrink_runs
    assert report.passed == verdicts.count("pass")
    assert (report.unsharded_errors, report.resource_failures) == (0, 0)
    assert report.other_failures == {}, "one way of failing only: no other signature, and a pass is none"
    assert report.finding.reproduced and not report.finding.from_saved


def test_the_figures_seen_while_running_grow_one_run_at_a_time(monkeypatch):
    monkeypatch.setattr(fuzz, "run_case", Runner())
    seen = []
    report = fuzz.fuzz(Search(cp=2, budget=50), on_run=lambda report, spec, result: seen.append(report.runs))
    assert seen == list(range(1, len(seen) + 1)) and report.runs == len(seen)


def test_a_search_that_finds_nothing_reports_every_draw_and_no_shrinking(monkeypatch):
    monkeypatch.setattr(fuzz, "run_case", lambda case, **kwargs: _result(case))
    report = fuzz.fuzz(Search(cp=2, budget=7))
    assert report.finding is None
    figures = (report.drawn, report.shrink_runs, report.runs, report.passed, report.unsharded_errors, report.resource_failures)
    assert figures == (7, 0, 7, 7, 0, 0), figures
    assert report.other_failures == {} and report.replayed == 0


def test_ranks_out_of_memory_and_unencodable_specs_are_counted_apart_and_never_a_finding(monkeypatch):
    verdicts = []

    def runner(case, **kwargs):  # by the drawn seed: out of memory, rejected by the unsharded encoder, or a pass
        error = {0: "MemoryError", 1: "ValueError: pixel shuffle needs an even patch grid, got 1x1"}.get(case.spec.seed % 4)
        result = _result(case, unsharded_error=error)
        verdicts.append(result.verdict)
        return result

    monkeypatch.setattr(fuzz, "run_case", runner)
    report = fuzz.fuzz(Search(cp=2, budget=30))
    assert report.finding is None and report.other_failures == {}
    assert {"resource", "unsharded-error", "pass"} <= set(verdicts), verdicts  # the draws met all three
    assert 2 * verdicts.count("resource") != len(verdicts), verdicts  # else counting the others would agree
    said = (report.resource_failures, report.unsharded_errors, report.passed, report.drawn)
    assert said == (verdicts.count("resource"), verdicts.count("unsharded-error"), verdicts.count("pass"), 30), said


def test_a_shrunk_failure_that_passes_when_rerun_is_still_saved_and_said_to_be_flaky(tmp_path, monkeypatch):
    run_before = set()

    def runner(case, **kwargs):  # a spec of two media items fails the first time it runs, never again
        key = json.dumps(case.spec.to_dict())
        first = key not in run_before
        run_before.add(key)
        return _result(case, WRONG_SHAPE if first and len(case.spec.media_frames) >= 2 else None)

    monkeypatch.setattr(fuzz, "run_case", runner)
    report = fuzz.fuzz(Search(cp=2, budget=50), tmp_path)
    finding = report.finding
    assert finding is not None, "a failure was met, then passed when rerun: it must still be reported"
    assert not finding.reproduced and not finding.from_saved
    assert finding.signature == signature(finding.result) == "fail: outputs: shape (#), expected (#)"
    assert json.loads(finding.path.read_text())["expect"]["signature"] == finding.signature


def _drawn(search: Search, monkeypatch) -> list[dict]:
    drawn = []

    def runner(case, **kwargs):
        drawn.append(case.spec.to_dict())
        return _result(case)

    monkeypatch.setattr(fuzz, "run_case", runner)
    fuzz.fuzz(search)
    return drawn


def test_a_search_without_a_seed_is_the_seed_0_search_that_vdpcp_fuzz_runs_by_default(monkeypatch):
    default = _drawn(Search(cp=2, budget=8), monkeypatch)
    assert default == _drawn(Search(cp=2, budget=8, seed=0), monkeypatch)
    assert default != _drawn(Search(cp=2, budget=8, seed=1), monkeypatch)  # the seed does pick the draws


def test_a_search_is_a_value_hashable_and_fixed():
    search = Search(cp=2, budget=8, seed=3)
    assert {search: "found"}[Search(cp=2, budget=8, seed=3)] == "found"
    with pytest.raises(dataclasses.FrozenInstanceError):
        search.seed = 4
