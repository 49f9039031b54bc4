"""A saved case says its CP size in up to three places: field ``case.cp``, a ``-cp<N>`` tag on the file's name,
and one on its spec's ``name``. Where they agree the file loads at that size; where any two disagree it is
rejected with one error naming the file and both sizes, by load, save, capture, replay and the matrix alike."""

import json
import re

import pytest

from vdpcp.cli import main
from vdpcp.feature.spec import MicrobatchSpec, SpecError
from vdpcp.matrix import saved, scenarios
from vdpcp.matrix.case import Case
from vdpcp.tools.capture import capture, capture_on_failure


def _write(folder, file_name, name, cp=None):
    data = {"name": name, "images": [[8, 8], [8, 16]], **({"case": {"cp": cp}} if cp is not None else {})}
    path = folder / file_name
    path.write_text(json.dumps(data))
    return path


AGREE = [  # (file name, spec name, case.cp) -> the CP size it loads at
    ("a-cp4.json", "a-cp4", 4, 4),
    ("a-cp4.json", "a", None, 4),  # the file name's tag alone
    ("a.json", "a-cp4", None, 4),  # the spec name's tag alone
    ("a-cp4.json", "a-cp4", None, 4),
    ("a.json", "a", 2, 2),
    ("a.json", "a", None, None),  # no size anywhere: the command line must give one
]
DISAGREE = [  # (file name, spec name, case.cp) -> what the error names, both sizes each
    ("a-cp2.json", "a", 4, ("field 'case.cp' = 4", "the file name (tag -cp2)")),
    ("a.json", "a-cp2", 4, ("field 'case.cp' = 4", "field 'name' (tag -cp2)")),
    ("a-cp2.json", "a-cp8", None, ("the file name (tag -cp2)", "field 'name' (tag -cp8)")),
    ("a-cp4.json", "a-cp4", 2, ("field 'case.cp' = 2", "(tag -cp4)")),
]


@pytest.mark.parametrize("file_name, name, cp, loads_at", AGREE)
def test_sizes_that_agree_load_at_that_size(tmp_path, file_name, name, cp, loads_at):
    assert saved.load(_write(tmp_path, file_name, name, cp)).case.get("cp") == loads_at


@pytest.mark.parametrize("file_name, name, cp, named", DISAGREE)
def test_sizes_that_disagree_are_one_error_naming_the_file_and_both(tmp_path, file_name, name, cp, named):
    path = _write(tmp_path, file_name, name, cp)
    with pytest.raises(SpecError) as raised:
        saved.load(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and "disagree" in message
    assert all(text in message for text in named), message


@pytest.mark.parametrize("file_name, name, cp, named", DISAGREE)
def test_replay_and_the_matrix_reject_it_the_same_way(tmp_path, capsys, file_name, name, cp, named):
    path = _write(tmp_path, file_name, name, cp)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and all(text in err for text in named), err
    with pytest.raises(SpecError, match=re.escape(str(path))):
        scenarios.scenarios(tmp_path)


def test_save_writes_no_file_that_load_would_reject(tmp_path):
    case = Case(MicrobatchSpec(images=((8, 8),), name="found-cp2"), 4)
    with pytest.raises(SpecError, match=r"field 'case.cp' = 4 and field 'name' \(tag -cp2\) disagree"):
        saved.save(tmp_path / "found.json", case)
    with pytest.raises(SpecError, match=r"field 'case.cp' = 4 and the file name \(tag -cp8\) disagree"):
        saved.save(tmp_path / "found-cp8.json", case.with_(spec=MicrobatchSpec(images=((8, 8),), name="found")))
    assert list(tmp_path.iterdir()) == []
    written = saved.save(tmp_path / "found-cp4.json", case.with_(spec=MicrobatchSpec(images=((8, 8),), name="found-cp4")))
    assert saved.load(written).to_case() == case.with_(spec=MicrobatchSpec(images=((8, 8),), name="found-cp4"))


def test_capture_refuses_a_path_tagged_with_another_size_before_the_block_runs(tmp_path):
    ran = []
    with pytest.raises(SpecError, match=r"step7-cp2\.json: the file name \(tag -cp2\) and cp=4 disagree"):
        with capture_on_failure(tmp_path / "step7-cp2.json", [[32, 32]], cp=4, patch_dim=16):
            ran.append(True)
    assert ran == [] and list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError):
        with capture_on_failure(tmp_path / "step7-cp4.json", [[32, 32]], cp=4, patch_dim=16):
            raise RuntimeError("the training step failed")
    assert saved.load(tmp_path / "step7-cp4.json").case == {"cp": 4}


def test_a_saved_signature_is_read_back_and_a_missing_one_is_none(tmp_path):
    case = Case(MicrobatchSpec(images=((8, 8),), name="found-cp4"), 4, even_pad=False)
    with_signature = saved.save(tmp_path / "a-cp4.json", case, "error: raised ValueError: pixel shuffle")
    assert saved.load(with_signature).signature == "error: raised ValueError: pixel shuffle"
    without = saved.save(tmp_path / "b-cp4.json", case)
    assert "expect" not in json.loads(without.read_text()) and saved.load(without).signature is None


@pytest.mark.parametrize("fields", [{"case": [4]}, {"expect": "fail: x"}, {"case": [4], "expect": "fail: x"}])
def test_case_and_expect_must_each_be_objects(tmp_path, fields):
    path = tmp_path / "x-cp4.json"
    path.write_text(json.dumps({"name": "x", "images": [[8, 8]], **fields}))
    with pytest.raises(SpecError, match=r"fields 'case' and 'expect' must be JSON objects"):
        saved.load(path)


def test_save_makes_the_folders_it_needs(tmp_path):
    case = Case(MicrobatchSpec(images=((8, 8),), name="deep-cp2"), 2)
    written = saved.save(tmp_path / "fuzz-out" / "run1" / "deep-cp2.json", case)
    assert saved.load(written).to_case() == case


@pytest.mark.parametrize("cp", [0, -1, True, 2.0, "4"])
def test_capture_takes_a_positive_integer_cp_only(cp):
    with pytest.raises(SpecError, match=r"capture: cp must be a positive integer"):
        capture(imgs_sizes=[[32, 32]], cp=cp, patch_dim=16)


def test_capture_at_cp1_and_its_defaults():
    spec = capture(imgs_sizes=[[32, 32]], cp=1, patch_dim=16)
    assert (spec.name, spec.seed, spec.temporal_patch_size) == ("captured-cp1", 0, 1)
