"""The save folder a search replays first: a saved failure of the same configuration is run once, shown to
``on_run``, counted as drawn (not as shrinking), and reported as a finding from the folder that failed again,
with no search run; a stray or foreign file there, wherever it sorts, is skipped, not judged, and does not hide
the saved failures after it. A fake runner stands in for the ranks, so each search takes milliseconds."""

import json

from vdpcp.matrix.case import RankResult
from vdpcp.matrix.runner import CaseResult
from vdpcp.tools import fuzz
from vdpcp.tools.fuzz import Search, signature

WRONG_SHAPE = "outputs: shape (2, 48), expected (1, 48)"
SEARCH = Search(cp=2, budget=50)


def runner(case, backend=None, timeout=None, fault_grace=None) -> CaseResult:
    """Fails every spec of two or more media items with a wrong output shape."""
    rank = RankResult(0, 0, len(case.spec.images), 0, 4, backend="gloo")
    if len(case.spec.media_frames) >= 2:
        rank.failures.append(WRONG_SHAPE)
    return CaseResult(case, ranks=[rank], backend="gloo")


def _saved_failure(folder, monkeypatch):
    monkeypatch.setattr(fuzz, "run_case", runner)
    finding = fuzz.fuzz(SEARCH, folder).finding
    assert finding is not None and finding.path.parent == folder
    return finding


def test_a_saved_failure_is_replayed_first_shown_to_on_run_and_counted_as_drawn(tmp_path, monkeypatch):
    first = _saved_failure(tmp_path, monkeypatch)
    seen = []
    report = fuzz.fuzz(SEARCH, tmp_path, on_run=lambda report, spec, result: seen.append((report.replayed, spec, signature(result))))
    assert seen == [(1, first.spec, first.signature)], seen  # one run: the saved spec, no search after it
    assert (report.replayed, report.drawn, report.shrink_runs, report.runs) == (1, 1, 0, 1)
    finding = report.finding
    assert finding.from_saved and finding.reproduced and finding.path == first.path
    assert (finding.spec, finding.signature) == (first.spec, first.signature)


def test_a_stray_file_in_the_folder_is_skipped_and_the_saved_failure_after_it_still_replayed(tmp_path, monkeypatch):
    first = _saved_failure(tmp_path, monkeypatch)
    stray = {"a-notes.json": "not json at all", "a-plain-spec.json": json.dumps({"images": [[8, 8]]})}  # no CP size
    for name, text in stray.items():
        (tmp_path / name).write_text(text)
    assert sorted(p.name for p in tmp_path.iterdir())[-1] == first.path.name  # the stray files sort first
    report = fuzz.fuzz(SEARCH, tmp_path)
    assert report.replayed == 1 and report.finding.from_saved and report.finding.path == first.path
    assert {name: (tmp_path / name).read_text() for name in stray} == stray  # left as they were
