"""`vdpcp fuzz`: seeded draws around and below CP, failures judged by signature (never an unencodable spec),
the first one shrunk and saved with its replay command; nothing found with the feature as specified."""

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from vdpcp.cli import main
from vdpcp.feature.sharded import VisionDPConfig, plan_for
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.runner import CaseResult
from vdpcp.tools.fuzz import MAX_GRID, TUBELET_SIZES, Search, fuzz, microbatches, signature

REGRESSIONS = Path(__file__).resolve().parents[2] / "vdpcp" / "fixtures" / "regressions"
CP = 4


# --- what is drawn (no ranks) -----------------------------------------------------------------------------


def _draws(cp: int, n: int) -> list[MicrobatchSpec]:
    drawn = []

    # No deadline and no health checks: a loaded CI machine must not turn slow draws into failures.
    @settings(max_examples=n, database=None, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
    @given(microbatches(cp))
    def draw(spec):
        drawn.append(spec)

    draw()
    return drawn


def test_draws_are_valid_microbatches_around_and_below_cp():
    for spec in _draws(CP, 200):
        assert 1 <= len(spec.media_frames) <= 2 * CP and spec.temporal_patch_size in TUBELET_SIZES
        assert all(1 <= g <= MAX_GRID for grid in spec.grids for g in grid)
        assert len(plan_for(spec, VisionDPConfig(CP)).shards) == CP


def test_draws_cover_placeholders_odd_grids_mixed_sizes_and_tubelets():
    seen = Counter()
    for spec in _draws(CP, 300):
        units = spec.num_tubelets
        seen["placeholders" if units < CP else "exact" if units == CP else "more than cp"] += 1
        seen["odd grid" if any(g % 2 for grid in spec.grids for g in grid) else "all even"] += 1
        seen["mixed sizes"] += len(set(spec.images)) > 1
        seen[f"T={spec.temporal_patch_size}"] += 1
        seen["video"] += any(n > 1 for n in spec.media_frames)
        seen["short last tubelet"] += any(n % spec.temporal_patch_size for n in spec.media_frames if n > 1)
    wanted = ["placeholders", "exact", "more than cp", "odd grid", "all even", "mixed sizes", "T=1", "T=2", "T=4",
              "video", "short last tubelet"]
    assert all(seen[k] >= 10 for k in wanted), seen


# --- signatures (no ranks) ---------------------------------------------------------------------------------

CASE = Case(MicrobatchSpec(images=((8, 8),)), 4)
RAISED = """vdpcp.matrix.runner.rank_body (gloo, world size 4) failed on 2 of 4 ranks: rank 0 hung: still running 3 s after rank 2 raised ValueError: bad grid 1x1; rank 2 raised ValueError: bad grid 1x1

----- rank 0: hung: still running 3 s after rank 2 raised ValueError: bad grid 1x1 -----
Current thread (most recent call first):
  File "comm.py", line 34 in forward

----- rank 2: raised ValueError: bad grid 1x1 -----
Traceback (most recent call last):
ValueError: bad grid 1x1"""


@pytest.mark.parametrize("result, expected", [
    (CaseResult(CASE, ranks=[RankResult(0, 1, 0, 4)]), None),
    (CaseResult(CASE, ranks=[RankResult(0, 1, 0, 4, unsharded_error="ValueError: odd")]), None),
    (CaseResult(CASE, error=RAISED), "error: raised ValueError: bad grid #x#"),
    (CaseResult(CASE, error="----- rank 3: died: exit code -9 -----\n"), "error: died: exit code -#"),
    (CaseResult(CASE, ranks=[RankResult(0, 1, 0, 4), RankResult(1, 0, 1, 1, failures=[
        "outputs: shape (2, 48), expected (1, 48)", "param grads: Tensor-likes are not close! (max abs error 1.5e-03)"])]),
     "fail: outputs: shape (#), expected (#)"),
], ids=["pass", "unsharded-error", "raised", "died", "failed-check"])
def test_signature(result, expected):
    assert signature(result) == expected


# --- the search (on ranks) ----------------------------------------------------------------------------------


def _search_log(search: Search) -> tuple[list[dict], object]:
    log = []
    report = fuzz(search, on_run=lambda report, spec, result: log.append(spec.to_dict()))
    return log, report


def test_same_seed_same_search_and_nothing_found_as_specified():
    first, report = _search_log(Search(cp=2, budget=6, seed=5))
    again, _ = _search_log(Search(cp=2, budget=6, seed=5))
    other, _ = _search_log(Search(cp=2, budget=6, seed=6))
    assert first == again and first != other
    assert report.finding is None and report.drawn == len(first) == 6 == report.passed + report.unsharded_errors


def test_as_specified_finds_nothing(tmp_path, capsys):
    assert main(["fuzz", "--cp", str(CP), "--budget", "20", "--seed", "1", "--out", str(tmp_path)]) == 0
    assert f"fuzz cp={CP} as-specified seed=1: no failure in 20 microbatches" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


# (failure mode, its flags): each finds its saved regression again, shrunk to the same spec
MODES = [("no-even-pad", ["--no-even-pad"]), ("mutant-placeholder-drop-mismatch", ["--mutant", "placeholder-drop-mismatch"])]


@pytest.mark.parametrize("tag, flags", MODES, ids=[m[0] for m in MODES])
def test_a_failure_mode_is_found_shrunk_and_saved_with_its_replay_command(tmp_path, capsys, tag, flags):
    assert main(["fuzz", "--cp", str(CP), "--out", str(tmp_path), *flags]) == 1  # the default budget
    out = capsys.readouterr().out
    path = tmp_path / f"{tag}-cp{CP}.json"
    saved = json.loads(path.read_text())
    assert len(saved["images"]) <= 3
    assert saved == json.loads((REGRESSIONS / path.name).read_text())  # the fixture is this search's result
    assert f"replay: vdpcp replay {path}" in out.splitlines(), out  # the file carries the flags
    assert main(["replay", str(path)]) == 1  # and fails again with none retyped
    assert "the same as the saved signature" in capsys.readouterr().out


def test_a_search_replays_the_failures_its_configuration_saved_first(tmp_path, capsys):
    assert main(["fuzz", "--cp", str(CP), "--out", str(tmp_path), "--no-even-pad"]) == 1
    capsys.readouterr()
    assert main(["fuzz", "--cp", str(CP), "--out", str(tmp_path), "--no-even-pad", "--seed", "9"]) == 1
    out = capsys.readouterr().out
    assert f"the failure saved in {tmp_path / f'no-even-pad-cp{CP}.json'} still fails" in out, out
    assert "1 saved failure(s) replayed first, no search run" in out
    # another configuration ignores it: the specification as written has nothing to replay and finds nothing
    assert main(["fuzz", "--cp", str(CP), "--out", str(tmp_path), "--budget", "3"]) == 0


@pytest.mark.parametrize("args, expected", [
    (["--cp", "0"], "argument --cp: expected an integer >= 1, got '0'"),
    (["--cp", "2", "--budget", "0"], "argument --budget: expected an integer >= 1, got '0'"),
    (["--cp", "2", "--mutant", "nope"], "--mutant nope: unknown mutant"),
])
def test_bad_options_exit_2(capsys, args, expected):
    assert main(["fuzz", *args]) == 2
    assert expected in capsys.readouterr().err
