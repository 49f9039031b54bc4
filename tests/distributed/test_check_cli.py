"""`vdpcp check` and `vdpcp mutants` as a user runs them: the table, JSON and JUnit XML, and the exit codes
(0 every case passed, 1 a case failed or a mutant survived, 2 bad input naming what was wrong)."""

import json
import xml.etree.ElementTree as ET

import pytest

from vdpcp.cli import main


def test_check_prints_the_table_and_writes_json_and_junit(tmp_path, capsys):
    code = main(["check", "--cp", "2", "-k", "eight-equal-cp2", "--impl", "reference",
                 "--json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "eight-equal" in out and "pass" in out and "images/rank" in out
    records = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [r["id"] for r in records] == ["eight-equal-cp2-reference-count", "eight-equal-cp2-reference-count-zigzag"]
    assert all(r["verdict"] == "pass" and len(r["ranks"]) == 2 for r in records)
    suite = ET.parse(tmp_path / "r.xml").getroot()
    assert suite.get("tests") == "2" and suite.get("failures") == "0"


def test_check_exits_1_when_a_case_fails(capsys):
    code = main(["check", "--cp", "2", "-k", "eight-equal-cp2-reference-count", "--mutant", "grad-not-summed"])
    out = capsys.readouterr().out
    assert code == 1
    assert "fail" in out


def test_an_expected_xfail_passes_the_check_and_is_a_skipped_junit_case(tmp_path, capsys):
    code = main(["check", "--cp", "2", "-k", "empty-cp2-mcore-count", "--backend", "gloo",
                 "--junit-xml", str(tmp_path / "r.xml")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "xfail" in out
    skipped = ET.parse(tmp_path / "r.xml").getroot().findall("testcase/skipped")
    # the case and its loader twin (pixels as a data loader hands them) meet the same limit
    assert len(skipped) == 2 and all("mcore-empty-microbatch" in s.get("message") for s in skipped)


def test_an_in_process_check_leaves_the_session_backend_as_it_was(tmp_path, capsys):
    from vdpcp.harness.config import default_backend

    before = default_backend()
    other = "nccl" if before == "gloo" else "gloo"
    main(["check", "--cp", "1", "-k", "one-image-cp1-reference-count", "--backend", other,
          "--json", str(tmp_path / "r.json")])
    capsys.readouterr()
    assert default_backend() == before, f"vdpcp check --backend {other} left the harness on {default_backend()}"


def test_check_records_the_backend_and_device_each_case_ran_on(tmp_path, capsys):
    assert main(["check", "--cp", "2", "-k", "eight-equal-cp2-reference-count", "--backend", "gloo",
                 "--json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml")]) == 0
    assert "gloo/" in capsys.readouterr().out  # the "ran on" column
    record = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert record["backend"] == "gloo" and all(r["backend"] == "gloo" and r["device"] for r in record["ranks"])
    properties = ET.parse(tmp_path / "r.xml").getroot().findall("testcase/properties/property")
    assert {p.get("name"): p.get("value") for p in properties}["backend"] == "gloo"


@pytest.mark.parametrize("argv, message", [
    (["--spec", "{tmp}/missing.json"], "missing.json: cannot read spec file"),
    (["--spec", "{tmp}/bad.json"], "bad.json: field 'images'[0] = [3, 4]: sizes must be multiples of patch_dim=4"),
    (["--spec", "{tmp}"], "bad.json"),
    (["--cp", "0"], "argument --cp: expected an integer >= 1, got '0'"),
    (["-k", "no-such-case"], "no case matches"),
    (["--mutant", "no-such-mutant"], "--mutant no-such-mutant: unknown mutant"),
])
def test_check_bad_input_exits_2_with_one_clear_message(tmp_path, capsys, argv, message):
    (tmp_path / "bad.json").write_text(json.dumps({"name": "bad", "images": [[3, 4]]}))
    code = main(["check", *(a.format(tmp=tmp_path) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_check_runs_a_spec_file_at_the_asked_cp_sizes(tmp_path, capsys):
    (tmp_path / "mine.json").write_text(json.dumps({"name": "mine", "images": [[8, 8], [8, 8], [8, 8], [32, 32]]}))
    code = main(["check", "--spec", str(tmp_path / "mine.json"), "--cp", "3", "--list"])
    assert code == 0
    assert capsys.readouterr().out.split() == ["mine-cp3-reference-count", "mine-cp3-reference-balanced",
                                               "mine-cp3-mcore-count"]


def test_mutants_kills_and_reports_the_killing_case(tmp_path, capsys):
    code = main(["mutants", "replicated-loss", "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    record = json.loads((tmp_path / "m.json").read_text())["results"][0]
    assert record["verdict"] == "killed" and record["killed_by"] == "eight-equal-cp2-reference-count"


def test_mutants_unknown_name_exits_2(capsys):
    assert main(["mutants", "no-such-mutant"]) == 2
    assert "no-such-mutant" in capsys.readouterr().err
