"""The plugin's session settings: the rank workers go at the outermost session's end (not an inner pytester
session's), the ini settings ``vdpcp_impl`` and ``vdpcp_preload`` are the session's defaults, and ``--replay``'s
options reach the case it collects, which is the session's only test."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# In a fresh process: the plugin as imported, its sessions driven by hand, the pools' shutdown recorded.
SESSIONS = textwrap.dedent("""
    from vdpcp import harness, pytest_plugin

    shut = []
    harness.shutdown = lambda: shut.append(True)
    start, finish = pytest_plugin.pytest_sessionstart, pytest_plugin.pytest_sessionfinish
    start(None); start(None); finish(None)
    assert shut == [], "an inner session's end shut the outer session's workers down"
    finish(None)
    assert shut == [True], "the outermost session's end left the workers running"
    finish(None)  # an end without its start (another plugin's sessionstart raised first): shut down, count kept at 0
    start(None); finish(None)
    assert shut == [True] * 3, shut
""")


def test_the_workers_go_at_the_outermost_sessions_end_only():
    done = subprocess.run([sys.executable, "-c", SESSIONS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_ini_implementation_is_the_matrix_of_vdpcp_case(pytester):
    pytester.makeini("[pytest]\nvdpcp_impl = reference\n")
    pytester.makepyfile(test_ini="def test_case(vdpcp_case): pass")
    result = pytester.runpytest("--vdpcp-cp", "2", "--collect-only", "-q")
    ids = [line for line in result.stdout.lines if "::" in line]
    assert ids and all("-reference-" in i for i in ids), result.stdout.str()  # not the built-ins' mcore too


def test_the_ini_preload_is_the_sessions_preload(pytester):
    pytester.makeini("[pytest]\nvdpcp_preload = json\n")
    pytester.makepyfile(test_ini="""
        from vdpcp.harness.config import default_preload

        def test_preload():
            assert default_preload() == ("json",)
    """)
    pytester.runpytest().assert_outcomes(passed=1)



SPEC = Path(__file__).resolve().parents[2] / "vdpcp" / "fixtures" / "multi-image.json"


def collected(pytester, *args) -> list:
    """The items a session of ``args`` would run (the replays are made after collection, as its last step)."""
    (finished,) = pytester.inline_run("--collect-only", *args).getcalls("pytest_collection_finish")
    return finished.session.items


def test_every_replay_option_reaches_the_case_it_collects(pytester):
    (item,) = collected(pytester, "--replay", str(SPEC), "--replay-cp", "4", "--replay-split", "balanced",
                        "--replay-dtype", "float32", "--replay-no-even-pad", "--replay-mutant", "grad-not-summed")
    case = item.case
    assert (case.cp, case.split, case.dtype, case.even_pad, case.mutant) == (4, "balanced", "float32", False,
                                                                              "grad-not-summed"), case


@pytest.mark.parametrize("select", [["-k", "no_such_test"], ["-m", "distributed"]])
def test_a_replay_is_the_sessions_only_test_whatever_k_or_m_selects(pytester, select):
    """The replays replace the collected tests after -k and -m have deselected theirs (trylast): a replay names
    the one test the session is for, and a selection meant for the test files does not drop it."""
    items = collected(pytester, "--replay", str(SPEC), "--replay-cp", "2", *select)
    assert [item.name for item in items] == [f"replay[{SPEC}]"]


def test_a_failing_replay_shows_its_report_not_a_traceback_through_the_plugin(pytester):
    failing = SPEC.parent / "regressions" / "no-even-pad-cp4.json"
    result = pytester.runpytest("--replay", str(failing))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*failing rank 1: raised ValueError: pixel shuffle*"])
    assert "raise ReplayFailed" not in result.stdout.str(), result.stdout.str()


def test_a_replay_session_does_not_even_import_the_test_files(pytester):
    pytester.makepyfile(test_broken="raise RuntimeError('imported although a replay is the whole session')")
    result = pytester.runpytest("--replay", str(SPEC), "--replay-cp", "2", "--collect-only")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert "imported although" not in result.stdout.str()
