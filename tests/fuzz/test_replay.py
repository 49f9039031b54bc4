"""`vdpcp replay` and `pytest --replay`: a spec file runs as one case, prints who encodes what, and exits
0 on a pass, 1 on a failure (with the failing rank's traceback), 2 on a bad file naming the file and field."""

import json
from pathlib import Path

import pytest

from vdpcp.cli import main
from vdpcp.cli.replay import plan_lines
from vdpcp.feature.spec import MicrobatchSpec, SpecError
from vdpcp.matrix.case import Case

pytest_plugins = ["pytester"]

REGRESSIONS = Path(__file__).resolve().parents[2] / "vdpcp" / "fixtures" / "regressions"


def write(tmp_path, data, name="spec.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_passing_spec_prints_the_plan_and_exits_0(tmp_path, capsys):
    path = write(tmp_path, {"name": "one-image-cp2", "images": [[8, 12]], "seed": 4})
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    for line in ["plan (count, cp=2, T=1): 1 rows, 1 placeholders; the gather drops the last 1 rank(s)",
                 "  rank 0: image 0 (8x12) (6 patches)", "  rank 1: 1 placeholder(s) 4x4 (1 patches)", "verdict: pass"]:
        assert line in out.splitlines(), out


def test_cp_option_overrides_the_name_tag(tmp_path, capsys):
    path = write(tmp_path, {"name": "two-cp2", "images": [[8, 8], [8, 8]]})
    assert main(["replay", str(path), "--cp", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  rank 3: 1 placeholder(s) 4x4 (1 patches)" in out and "verdict: pass" in out


# (spec, cp, the plan's rank lines): images by count with the remainder on the last rank; videos by tubelet
PLANS = [
    (dict(images=[[8, 8], [8, 12], [4, 4], [8, 8], [12, 8]]), 2,
     ["  rank 0: image 0 (8x8), image 1 (8x12) (10 patches)",
      "  rank 1: image 2 (4x4), image 3 (8x8), image 4 (12x8) (11 patches)"]),
    (dict(images=[[8, 8]] * 5 + [[4, 8]], num_frames=[5, 1], temporal_patch_size=2), 4,
     ["  rank 0: video 0 frames 0-1 of 5 (8x8) (8 patches)",
      "  rank 1: video 0 frames 2-3 of 5 (8x8) (8 patches)",
      "  rank 2: video 0 frames 4-4 of 5 (8x8) (4 patches)",
      "  rank 3: image 1 (4x8) (2 patches)"]),
]


@pytest.mark.parametrize("fields, cp, expected", PLANS, ids=["stills-remainder", "video-tubelets"])
def test_plan_lines_say_which_rank_encodes_what(fields, cp, expected):
    assert plan_lines(Case(MicrobatchSpec.from_dict(fields), cp))[1:] == expected


def test_an_implementations_own_rule_under_a_split_name_vdpcp_also_has_is_printed_as_its_plan():
    """Bridge's "count" gives the remainder to the first ranks, vdpcp's planner's to the last: the replay says what
    Bridge's split does, not what vdpcp's would."""
    spec = MicrobatchSpec.from_dict(dict(images=[[16, 16], [24, 16], [16, 32]]))
    assert plan_lines(Case(spec, 2, "bridge-qwen3-vl"))[1:] == ["  rank 0: image 0 (16x16), image 1 (24x16)",
                                                               "  rank 1: image 2 (16x32)"]
    assert plan_lines(Case(spec, 2))[1:] == ["  rank 0: image 0 (16x16) (16 patches)",
                                             "  rank 1: image 1 (24x16), image 2 (16x32) (56 patches)"]


def test_a_saved_failure_fails_again_with_no_flag_retyped_and_prints_the_failing_ranks_traceback(capsys):
    path = REGRESSIONS / "no-even-pad-cp4.json"
    assert main(["replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert "verdict: error" in out.splitlines()
    assert ("the same as the saved signature: error: raised ValueError: pixel shuffle needs an even patch grid, "
            "got #x#") in out
    assert "failing rank 1: raised ValueError: pixel shuffle needs an even patch grid, got 1x1" in out
    assert 'in pixel_shuffle\n    raise ValueError(f"pixel shuffle needs an even patch grid' in out


# (case, file content, text stderr must contain besides the file's path)
BAD_FILES = [
    ("unknown-field", {"name": "x-cp2", "images": [[8, 8]], "cp": 2}, ["unknown field(s) ['cp']"]),
    ("images-not-pairs", {"name": "x-cp2", "images": [8, 8]}, ["field 'images'", "[H, W] integer pairs"]),
    ("frames-do-not-sum", {"name": "x-cp2", "images": [[8, 8]] * 2, "num_frames": [1]}, ["field 'num_frames'", "expected len(images) = 2"]),
    ("size-not-multiple", {"name": "x-cp2", "images": [[8, 6]]}, ["field 'images'[0]", "multiples of patch_dim=4"]),
    ("no-cp-tag", {"name": "doc-qa", "images": [[8, 8]]}, ["no case.cp and its name no -cp<N> tag", "--cp N"]),
    ("bad-case-field", {"name": "x", "images": [[8, 8]], "case": {"cp": 2, "colour": 1}}, ["field 'case'", "'colour'"]),
    ("bad-case-type", {"name": "x", "images": [[8, 8]], "case": {"cp": "2"}}, ["field 'case.cp' = '2': expected int"]),
    ("not-json", "{images: [[8, 8]]", ["not valid JSON"]),
    ("not-an-object", "[[8, 8]]", ["expected a JSON object"]),
]


@pytest.mark.parametrize("content, expected", [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_a_bad_spec_file_exits_2_naming_file_and_field(tmp_path, capsys, content, expected):
    path = write(tmp_path, content)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(text in err for text in expected), err
    assert str(path) in err or "no CP size" in err, err


def test_a_missing_file_exits_2(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: cannot read spec file" in capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    (["--mutant", "no-such-mutant"], "--mutant no-such-mutant: unknown mutant"),
    (["--cp", "0"], "argument --cp: expected an integer >= 1, got '0'"),
])
def test_bad_options_exit_2(capsys, args, expected):
    assert main(["replay", str(REGRESSIONS / "no-even-pad-cp4.json"), *args]) == 2
    assert expected in capsys.readouterr().err


def test_a_spec_the_unsharded_encoder_rejects_too_exits_2(tmp_path, capsys):
    # An odd real grid (3x2 patches) with even padding off: no sharding is needed to fail, so nothing to replay.
    path = write(tmp_path, {"name": "odd-cp2", "images": [[12, 8], [8, 8]]})
    assert main(["replay", str(path), "--no-even-pad"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "the unsharded encoder rejects this spec too" in err and "got 3x2" in err


# --- pytest --replay --------------------------------------------------------------------------------------


def test_pytest_replay_fails_with_the_replay_report(pytester):
    result = pytester.runpytest("--replay", str(REGRESSIONS / "no-even-pad-cp4.json"))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1: 1 placeholder(s) 4x4*", "*failing rank 1: raised ValueError: pixel shuffle*"])


def test_pytest_replay_passes_as_specified_and_collects_nothing_else(pytester, tmp_path):
    pytester.makepyfile(test_other="def test_other(): pass")
    spec = write(tmp_path, {"name": "one-image-cp4", "images": [[8, 8]]})
    result = pytester.runpytest("--replay", str(spec), "--replay-cp", "2", "-rP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*replay*: one-image-cp4-cp2-reference-count*", "verdict: pass"])


def test_replay_of_a_known_limit_is_an_xfail_with_its_reason_in_replay_and_pytest(pytester, tmp_path, capsys):
    spec = write(tmp_path, {"name": "three-cp2", "images": [[16, 16], [16, 16], [16, 32]]})  # 3 images over 2 ranks
    subject = "tests.oracle.subjects:backward_refused"  # its backward refuses that on gloo, a declared limit
    assert main(["replay", str(spec), "--impl", subject, "--backend", "gloo"]) == 0
    out = capsys.readouterr().out
    assert "verdict: xfail (backward-refused: its gather's backward refuses" in out, out
    assert "--outputs-only" in out
    assert main(["replay", str(spec), "--impl", subject, "--backend", "gloo", "--outputs-only"]) == 0
    assert "verdict: pass" in capsys.readouterr().out.splitlines()
    result = pytester.runpytest("--replay", str(spec), "--replay-impl", subject, "--backend", "gloo")
    result.assert_outcomes(xfailed=1)


def test_pytest_replay_of_a_bad_file_is_a_usage_error(pytester, tmp_path):
    path = write(tmp_path, {"name": "x-cp2", "images": [[8, 6]]})
    result = pytester.runpytest(f"--replay={path}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: --replay: {path}: field 'images'[0] = [8, 6]: sizes must be multiples of patch_dim=4" in result.stderr.str()


def test_every_case_field_round_trips_through_a_saved_file(tmp_path):
    from dataclasses import fields

    from vdpcp.matrix import saved

    case = Case(MicrobatchSpec(images=((8, 8),), name="x"), 2, impl="mcore", split="count", loss="zigzag",
                vision_dp_over_cp=False, config_cp=4, dtype="bfloat16", even_pad=False, mutant="grad-averaged",
                grads=False, dp=2, tp=1, tower="real", pixels="loader")
    assert {f.name for f in fields(Case)} - {"spec"} == set(saved.CASE_TYPES)
    assert saved.load(saved.save(tmp_path / "x.json", case, "fail: x")).to_case() == case


def test_a_saved_case_whose_pixels_are_neither_the_towers_nor_a_loaders_is_one_clear_error(tmp_path):
    from vdpcp.matrix import saved

    path = tmp_path / "x-cp2.json"
    path.write_text(json.dumps({"name": "x-cp2", "images": [[8, 8]], "case": {"pixels": "disk"}}))
    with pytest.raises(SpecError, match=r"field 'case.pixels' = 'disk': expected one of tower, loader$"):
        saved.load(path)
