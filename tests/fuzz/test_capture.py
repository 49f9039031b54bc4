"""Capture: a training loop's vision inputs (tensors or lists) become a spec that names its CP size and
replays the same shapes; bad inputs raise one SpecError naming the field; only a failing block writes."""

import json

import pytest
import torch

from vdpcp.feature.spec import MicrobatchSpec, SpecError
from vdpcp.tools.capture import capture, capture_on_failure, cp_from_name, name_with_cp

STILLS = dict(imgs_sizes=[[448, 448], [448, 896]], cp=4, patch_dim=16, seed=18412, name="step18412")
VIDEO = dict(imgs_sizes=[[32, 48]] * 5 + [[64, 64]], num_frames=[5, 1], temporal_patch_size=2, cp=8, patch_dim=16)


@pytest.mark.parametrize("fields", [STILLS, VIDEO], ids=["stills", "video"])
def test_tensors_and_lists_give_the_same_spec(fields):
    as_tensors = {k: torch.tensor(v) if k in ("imgs_sizes", "num_frames") else v for k, v in fields.items()}
    assert capture(**as_tensors) == capture(**fields)


def test_spec_holds_every_field_and_the_cp_in_its_name(tmp_path):
    spec = capture(**VIDEO, seed=3, name="clip")
    assert spec.to_dict() == {"name": "clip-cp8", "images": VIDEO["imgs_sizes"], "num_frames": [5, 1],
                              "temporal_patch_size": 2, "patch_dim": 16, "seed": 3}
    loaded = MicrobatchSpec.load(spec.save(tmp_path / "clip.json"))
    assert loaded == spec and cp_from_name(loaded.name) == 8


def test_same_spec_same_tensors():
    a, b = capture(**STILLS).tensors(), capture(**STILLS).tensors()
    assert torch.equal(a.patches, b.patches) and a.patches.shape == (1, 28 * 28 + 28 * 56, 3 * 16 * 16)


@pytest.mark.parametrize("name, cp, tagged, parsed", [
    ("step5", 4, "step5-cp4", 4),
    ("step5-cp2", 8, "step5-cp8", 8),  # a re-capture at another CP replaces the tag
    ("cp2", 3, "microbatch-cp3", 3),
    ("cp2x", 2, "cp2x-cp2", 2),
])
def test_cp_tag(name, cp, tagged, parsed):
    assert name_with_cp(name, cp) == tagged and cp_from_name(tagged) == parsed


def test_names_without_a_tag_have_no_cp():
    assert [cp_from_name(n) for n in ("doc-qa", "cp", "step-cp", "ccp4x")] == [None] * 4


# (case, capture keywords, text the error must contain)
BAD_CAPTURES = [
    ("cp-zero", dict(STILLS, cp=0), ["cp must be a positive integer"]),
    ("sizes-not-pairs", dict(STILLS, imgs_sizes=[448, 448]), ["'imgs_sizes'", "(H, W) pair"]),
    ("sizes-a-string", dict(STILLS, imgs_sizes="448x448"), ["'imgs_sizes'", "tensor or a list"]),
    ("frames-do-not-sum", dict(VIDEO, num_frames=[4, 1]), ["'num_frames'", "expected len(images) = 6"]),
    ("size-not-multiple-of-patch", dict(STILLS, patch_dim=20), ["'images'[0]", "multiples of patch_dim=20"]),
    ("float-sizes", dict(STILLS, imgs_sizes=torch.tensor([[448.0, 448.0]])), ["'images'", "integer pairs"]),
]


@pytest.mark.parametrize("fields, expected", [c[1:] for c in BAD_CAPTURES], ids=[c[0] for c in BAD_CAPTURES])
def test_bad_capture_names_the_field(fields, expected):
    with pytest.raises(SpecError) as err:
        capture(**fields)
    assert all(text in str(err.value) for text in expected), str(err.value)


def test_capture_on_failure_writes_the_spec_and_reraises(tmp_path):
    path = tmp_path / "crash" / "step18412-rank3.json"
    with pytest.raises(ValueError, match="pixel shuffle"):
        with capture_on_failure(path, **STILLS):
            raise ValueError("pixel shuffle needs an even patch grid, got 1x1")
    assert json.loads(path.read_text()) == capture(**STILLS).to_dict()


def test_capture_on_failure_writes_nothing_when_the_block_passes(tmp_path):
    with capture_on_failure(tmp_path / "ok.json", **STILLS) as spec:
        assert spec.name == "step18412-cp4"
    assert not (tmp_path / "ok.json").exists()


def test_capture_on_failure_rejects_bad_inputs_before_the_block_runs(tmp_path):
    ran = []
    with pytest.raises(SpecError):
        with capture_on_failure(tmp_path / "x.json", **dict(STILLS, cp=0)):
            ran.append(True)
    assert not ran
