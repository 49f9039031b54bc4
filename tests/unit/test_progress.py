"""vdpcp.matrix.progress: the per-case log line, --maxfail, reports replaced atomically, SIGTERM as an orderly stop.
The CLI's use of them, on real ranks, is tested in tests/distributed/test_progress_cli.py."""

import io
import os
import signal
from types import SimpleNamespace

import pytest

from vdpcp.cli import main
from vdpcp.matrix import progress
from vdpcp.tools.mutants.hunt import Hunt


def _result(backend="gloo", devices=("cpu", "cpu"), failures=()):
    return SimpleNamespace(backend=backend, device=",".join(sorted(set(devices))) or "-", failures=list(failures))


def _judged(verdict, why="", **result):
    return SimpleNamespace(verdict=verdict, why=why, result=_result(**result))


def test_a_pass_is_its_position_id_verdict_seconds_and_where_it_ran():
    done = progress.Finished.of("three-images-cp2-reference-count", _judged("pass"), 0.4249)
    assert progress.line(done, "[ 3/17]") == "[ 3/17]  three-images-cp2-reference-count  pass  0.42 s  gloo/cpu"


def test_a_non_pass_adds_its_why_or_else_the_first_failure_on_one_line():
    xfail = progress.Finished.of("c", _judged("xfail", why="mcore-empty-microbatch: MCore pads ..."), 1)
    assert progress.line(xfail).endswith("xfail  1.00 s  gloo/cpu  mcore-empty-microbatch: MCore pads ...")
    error = _judged("error", backend="nccl", devices=(), failures=["\nrank 1 raised ImportError: cannot import name 'x'\n  tb"])
    assert progress.line(progress.Finished.of("c", error, 9)) == "c  error  9.00 s  nccl  rank 1 raised ImportError: cannot import name 'x'"
    long = progress.line(progress.Finished.of("c", _judged("fail", why="a\nb " + "x" * 1000), 1))
    assert "\n" not in long and long.endswith("…") and len(long.split("  ")[-1]) == progress.REASON_WIDTH


def test_a_passing_verdict_other_than_pass_still_says_why():
    """Whatever verdicts the judge has (nothing here lists them), only "pass" goes without a reason."""
    done = progress.Finished.of("c", _judged("some-new-verdict", why="because"), 1)
    assert progress.line(done).endswith("some-new-verdict  1.00 s  gloo/cpu  because")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_off_a_terminal_every_finished_case_is_a_line_at_once_and_on_one_the_bar_alone():
    log, err = io.StringIO(), io.StringIO()
    with progress.CaseProgress("check", 2, out=log, err=err) as shown:
        shown.start("a")
        shown.finish(progress.Finished("a", "pass", 0.1, "gloo/cpu"))
        assert log.getvalue() == "[1/2]  a  pass  0.10 s  gloo/cpu\n"  # before the run ends
        shown.finish(text="b  killed by c")
    assert log.getvalue().splitlines()[1] == "[2/2]  b  killed by c"
    screen, bar = _Terminal(), _Terminal()
    with progress.CaseProgress("check", 1, out=screen, err=bar) as shown:
        shown.finish(progress.Finished("a", "pass", 0.1, "gloo/cpu"))
        shown.say("a note")
    assert screen.getvalue() == ""


def test_maxfail_stops_at_the_nth_case_that_did_not_pass_and_0_never_stops():
    three = progress.MaxFail(3)
    assert [three.count(passing) for passing in (False, True, False, True, False)] == [False] * 4 + [True]
    assert three.reason() == "--maxfail 3: stopped after 3 case(s) that did not pass"
    assert not any(progress.MaxFail(0).count(False) for _ in range(10))


@pytest.mark.parametrize("command", [["check", "--cp", "2"], ["mutants"]])
@pytest.mark.parametrize("value", ["-1", "two"])
def test_a_bad_maxfail_exits_2_with_one_clear_message(capsys, command, value):
    assert main([*command, "--maxfail", value]) == 2
    err = capsys.readouterr().err
    assert f"argument --maxfail: expected an integer >= 0, got {value!r}" in err and len(err.strip().splitlines()) == 1, err


def test_mutants_with_x_stop_at_the_first_survivor_and_say_so(tmp_path, capsys, monkeypatch):
    """The hunt is replaced, so no rank runs: the first mutant survives its kill set and the whole matrix."""
    hunted = []

    def survives(name, cases, backend=None, timeout=None, on_case=None):
        hunted.append(name)
        return Hunt(name, tried=[c.id for c in cases])

    monkeypatch.setattr("vdpcp.tools.mutants.hunt.hunt", survives)
    code = main(["mutants", "replicated-loss", "grad-not-summed", "-x", "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert code == 1 and hunted == ["replicated-loss", "replicated-loss"], out  # kill set, then the matrix
    assert "[1/2]  replicated-loss  SURVIVED" in out
    assert "--maxfail 1: stopped after 1 mutant(s) that survived; 1 of 2 mutants ran" in out
    import json

    written = json.loads((tmp_path / "m.json").read_text())
    assert [r["mutant"] for r in written["results"]] == ["replicated-loss"]
    assert written["complete"] is False and written["stopped"].startswith("--maxfail 1")


def test_a_report_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    progress.write_atomically(path, "old")
    progress.write_atomically(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["r.json"]

    def crash(src, dst):
        raise KeyboardInterrupt  # the job stopped between writing and renaming

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        progress.write_atomically(path, "half")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_report_says_how_far_its_run_got():
    assert progress.run_state(5, None, final=False) == {"selected": 5, "complete": False}
    assert progress.run_state(5, None, final=True) == {"selected": 5, "complete": True}
    assert progress.run_state(5, "stopped by SIGTERM", final=True) == {"selected": 5, "complete": False,
                                                                       "stopped": "stopped by SIGTERM"}


def _run(total, maxfail=0, saved=None):
    return progress.Run("check", total, maxfail, write=None if saved is None else saved.append, out=io.StringIO(),
                        err=io.StringIO())


def test_a_run_writes_its_reports_before_each_line_and_once_more_at_the_end():
    saved = []
    with _run(2, saved=saved) as run:
        assert saved == [{"selected": 2, "complete": False}]  # before any case: a bad path fails at once
        assert not run.finish(progress.Finished("a", "fail", 1, "gloo/cpu", "why"), passing=False)
        assert len(saved) == 2 and run.shown.out.getvalue().startswith("[1/2]  a  fail")
        assert not run.finish(progress.Finished("b", "pass", 1, "gloo/cpu"), passing=True)
    assert saved[-1] == {"selected": 2, "complete": True} and len(saved) == 4
    assert run.exit_code(all_passed=False) == 1 and run.exit_code(all_passed=True) == 0 and run.summary() == ""


def test_a_run_stopped_by_maxfail_or_a_signal_says_so_and_its_last_report_is_not_complete():
    saved = []
    with _run(3, maxfail=1, saved=saved) as run:
        assert run.finish(progress.Finished("a", "error", 1, "gloo"), passing=False)
    assert saved[-1] == {"selected": 3, "complete": False, "stopped": "--maxfail 1: stopped after 1 case(s) that did not pass"}
    assert run.shown.out.getvalue().splitlines()[-1] == "--maxfail 1: stopped after 1 case(s) that did not pass; 1 of 3 cases ran"
    assert run.summary() == " (--maxfail 1: stopped after 1 case(s) that did not pass: 2 of 3 cases not run)"
    assert run.exit_code(all_passed=True) == 1
    saved = []
    with _run(3, saved=saved) as run:
        run.finish(progress.Finished("a", "pass", 1, "gloo"), passing=True)
        raise progress.Stopped(signal.SIGTERM)
    assert saved[-1]["stopped"] == "stopped by SIGTERM" and saved[-1]["complete"] is False
    assert run.shown.out.getvalue().splitlines()[-1] == "stopped by SIGTERM; 1 of 3 cases ran"
    assert run.exit_code(all_passed=True) == 143


def test_a_run_lets_any_other_error_through_unwritten():
    saved = []
    with pytest.raises(ValueError):
        with _run(2, saved=saved):
            raise ValueError("a harness bug")
    assert len(saved) == 1


def test_sigterm_while_cases_run_is_an_orderly_stop_and_the_handler_is_put_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(progress.Stopped) as stopped:
        with progress.stop_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("SIGTERM did not stop the block")
    assert isinstance(stopped.value, KeyboardInterrupt)  # every Ctrl-C path handles it
    assert progress.stop_reason(stopped.value) == ("stopped by SIGTERM", 143)
    assert progress.stop_reason(KeyboardInterrupt()) == ("stopped by SIGINT", 130)
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_ignored_sigterm_stays_ignored():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with progress.stop_on_sigterm():
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
