"""`vdpcp check`, `mutants` and `fuzz` in a CI log: a line per case as it ends, -x / --maxfail, and reports that a
killed job still leaves (a check killed by `timeout` must print what it finished and leave a report)."""

import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vdpcp.cli import main

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^\[\s*(\d+)/(\d+)\]  (\S+)  (\S+)  (\d+\.\d\d) s  (\S+)(?:  (.+))?$")


def _lines(out: str) -> list[tuple]:
    return [m.groups() for m in map(LINE.match, out.splitlines()) if m]


@pytest.mark.distributed
def test_off_a_terminal_check_prints_a_line_per_case_with_verdict_seconds_and_where_it_ran(capsys, on_the_cpu):
    assert main(["check", "--cp", "2", "-k", "empty-cp2-", "--impl", "reference", "mcore", "--split", "count",
                 "--loss", "rank", "--backend", "gloo"]) == 0
    out = capsys.readouterr().out
    lines = _lines(out)
    ids = [line[2] for line in lines]
    assert ids == ["empty-cp2-reference-count", "empty-cp2-mcore-count", "empty-cp2-reference-count-loader",
                   "empty-cp2-mcore-count-loader"]
    assert [int(line[0]) for line in lines] == list(range(1, len(lines) + 1)) and {line[1] for line in lines} == {str(len(lines))}
    by_id = {line[2]: line for line in lines}
    assert by_id["empty-cp2-reference-count"][3:] == ("pass", by_id["empty-cp2-reference-count"][4], "gloo/cpu", None)
    xfail = by_id["empty-cp2-mcore-count"]
    assert xfail[3] == "xfail" and xfail[6].startswith("mcore-empty-microbatch: ")  # the judge's why
    assert out.index("empty-cp2-reference-count  pass") < out.index("vdpcp check (gloo)")  # before the table


@pytest.mark.distributed
def test_x_stops_at_the_first_case_that_fails_says_so_and_the_reports_hold_it(tmp_path, capsys):
    code = main(["check", "--cp", "2", "-k", "eight-equal-cp2-reference", "--mutant", "grad-not-summed", "-x", "--backend", "gloo",
                 "--json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml")])
    out = capsys.readouterr().out
    assert code == 1, out
    (first,) = _lines(out)
    assert first[2] == "eight-equal-cp2-reference-count-mutant-grad-not-summed" and first[3] == "fail" and first[6].startswith("rank "), out
    assert "--maxfail 1: stopped after 1 case(s) that did not pass;" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["id"] for r in report["results"]] == [first[2]] and report["finished"] == 1 < report["selected"]
    assert report["complete"] is False and report["stopped"].startswith("--maxfail 1")
    assert ET.parse(tmp_path / "r.xml").getroot().get("failures") == "1"


@pytest.mark.distributed
def test_maxfail_n_lets_n_minus_1_failures_through(tmp_path, capsys):
    assert main(["check", "--cp", "2", "-k", "eight-equal-cp2-reference", "--mutant", "grad-not-summed", "--backend", "gloo",
                 "--maxfail", "2", "--json", str(tmp_path / "r.json")]) == 1
    verdicts = [line[3] for line in _lines(capsys.readouterr().out)]
    assert verdicts.count("fail") == 2 and verdicts[-1] == "fail"
    assert json.loads((tmp_path / "r.json").read_text())["finished"] == len(verdicts)


def _check_process(tmp_path: Path, *argv: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    return subprocess.Popen([sys.executable, "-m", "vdpcp", "check", *argv, "--json", str(tmp_path / "r.json"),
                             "--junit-xml", str(tmp_path / "r.xml")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(process, finished: int) -> list[str]:
    """The process's output lines up to its ``finished``-th per-case line."""
    seen = []
    for text in process.stdout:
        seen.append(text.rstrip("\n"))
        if len(_lines("\n".join(seen))) == finished:
            return seen
    raise AssertionError("the check ended before it printed enough case lines:\n" + "\n".join(seen))


@pytest.mark.distributed
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_check_killed_mid_run_leaves_reports_that_parse_and_hold_what_it_finished(tmp_path, signum):
    process = _check_process(tmp_path, "--cp", "2", "-k", "cp2-reference-count", "--loss", "rank", "--backend", "gloo")
    try:
        seen = _read_until(process, 2)
        process.send_signal(signum)
        rest, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    printed = [line[2] for line in _lines("\n".join(seen) + "\n" + rest)]
    report = json.loads((tmp_path / "r.json").read_text())
    ids = [r["id"] for r in report["results"]]
    # A case is written to the reports just before its line is printed: a kill in between leaves one more there.
    both = min(len(ids), len(printed))
    assert len(ids) >= 2 and ids[:both] == printed[:both] and len(ids) - len(printed) in (0, 1), (ids, printed)
    assert report["complete"] is False and report["finished"] == len(ids) < report["selected"]
    testcases = ET.parse(tmp_path / "r.xml").getroot().findall("testcase")
    assert [t.get("name") for t in testcases] == ids
    if signum == signal.SIGTERM:  # an orderly stop: it says so, marks the reports and exits as killed by it
        assert process.returncode == 128 + signal.SIGTERM, rest
        assert report["stopped"] == "stopped by SIGTERM" and f"stopped by SIGTERM; {len(ids)} of " in rest, rest
    else:
        assert process.returncode == -signal.SIGKILL
    assert not list(tmp_path.glob(".r.*")), "a temporary report was left behind"


@pytest.mark.distributed
def test_off_a_terminal_mutants_prints_every_case_it_tried_and_each_mutant_as_it_ends(capsys):
    assert main(["mutants", "replicated-loss"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[1/1]  replicated-loss:  eight-equal-cp2-reference-count  fail  "), out
    assert out[1].startswith("[1/1]  replicated-loss  killed by eight-equal-cp2-reference-count (1 case(s), "), out


@pytest.mark.distributed
def test_off_a_terminal_fuzz_prints_every_microbatch_it_runs(tmp_path, capsys, on_the_cpu):  # it asserts gloo/cpu
    assert main(["fuzz", "--cp", "2", "--budget", "3", "--seed", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    runs = [line for line in out if line.startswith("[")]
    assert [line.split("]")[0] + "]" for line in runs] == ["[1/3]", "[2/3]", "[3/3]"], out
    assert all(re.search(r"\]  images=\[\[.*  pass  \d+\.\d\d s  gloo/cpu$", line) for line in runs), runs
