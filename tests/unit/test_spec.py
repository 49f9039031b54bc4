"""Microbatch specs: every bad spec raises one SpecError naming the field and what was expected; good specs
round-trip through JSON and always yield the same tensors for the same seed."""

import json

import pytest
import torch

from vdpcp.feature.spec import DEFAULT_PATCH_DIM, MicrobatchSpec, SpecError

GOOD = {"name": "doc-qa", "images": [[8, 8], [8, 12]], "num_frames": [1, 1], "temporal_patch_size": 1, "patch_dim": 4, "seed": 3}
VIDEO = {"name": "clip", "images": [[8, 8]] * 5 + [[4, 12]], "num_frames": [5, 1], "temporal_patch_size": 2, "seed": 7}

# (case, spec fields, text the error must contain: the field, then the expected value)
BAD_SPECS = [
    ("size-not-multiple-of-P", {"images": [[8, 6]], "patch_dim": 4}, ["'images'[0]", "multiples of patch_dim=4"]),
    ("zero-height", {"images": [[8, 8], [0, 8]]}, ["'images'[1]", "must be positive"]),
    ("negative-width", {"images": [[8, -4]]}, ["'images'[0]", "must be positive"]),
    ("zero-patch-dim", {"images": [], "patch_dim": 0}, ["'patch_dim'", "positive integer"]),
    ("zero-T", {"images": [], "num_frames": [], "temporal_patch_size": 0}, ["'temporal_patch_size'", "positive integer"]),
    ("frames-sum-short", {"images": [[4, 4]] * 3, "num_frames": [1, 1]}, ["'num_frames'", "expected len(images) = 3"]),
    ("frames-sum-long", {"images": [[4, 4]] * 3, "num_frames": [2, 2]}, ["'num_frames'", "expected len(images) = 3"]),
    ("zero-frame-item", {"images": [[4, 4]] * 2, "num_frames": [2, 0]}, ["'num_frames'", "at least one frame"]),
    ("T-without-num-frames", {"images": [[4, 4]] * 2, "temporal_patch_size": 2}, ["'num_frames'", "required when temporal_patch_size=2"]),
    ("video-frames-differ", {"images": [[4, 4], [4, 8]], "num_frames": [2], "temporal_patch_size": 2}, ["media item 0", "share one size"]),
    ("unknown-key", {"images": [], "frames": [1]}, ["unknown field(s) ['frames']", "'temporal_patch_size'"]),
    ("missing-images", {"num_frames": []}, ["'images' is missing", "[H, W] pairs"]),
    ("images-not-list", {"images": "448x448"}, ["'images'", "[H, W] integer pairs"]),
    ("image-not-pair", {"images": [[4, 4, 4]]}, ["'images'", "[H, W] integer pairs"]),
    ("float-size", {"images": [[4.0, 4]]}, ["'images'", "[H, W] integer pairs"]),
    ("bool-size", {"images": [[True, 4]]}, ["'images'", "[H, W] integer pairs"]),
    ("num-frames-not-list", {"images": [[4, 4]], "num_frames": 1}, ["'num_frames'", "list of integers"]),
    ("num-frames-float", {"images": [[4, 4]], "num_frames": [1.0]}, ["'num_frames'", "list of integers"]),
    ("T-string", {"images": [], "temporal_patch_size": "2"}, ["'temporal_patch_size'", "must be an integer"]),
    ("patch-dim-bool", {"images": [], "patch_dim": True}, ["'patch_dim'", "must be an integer"]),
    ("seed-float", {"images": [], "seed": 1.5}, ["'seed'", "must be an integer"]),
    # torch seeds are unsigned 64-bit: -1 would alias 2**64 - 1 (two seeds, one set of patches), 2**64 overflows
    ("seed-negative", {"images": [], "seed": -1}, ["'seed'", "in [0, 2**64)"]),
    ("seed-too-large", {"images": [], "seed": 2**64}, ["'seed'", "in [0, 2**64)"]),
    ("name-not-string", {"images": [], "name": 3}, ["'name'", "must be a string"]),
]


@pytest.mark.parametrize("fields, expected", [pytest.param(f, e, id=c) for c, f, e in BAD_SPECS])
def test_bad_spec_raises_one_error_naming_field_and_expectation(fields, expected):
    with pytest.raises(SpecError) as err:
        MicrobatchSpec.from_dict(fields, source="batch.json")
    message = str(err.value)
    assert message.startswith("batch.json: ") and "\n" not in message
    for text in expected:
        assert text in message


@pytest.mark.parametrize("data", [[], "spec", None, 3])
def test_non_object_is_rejected(data):
    with pytest.raises(SpecError, match="expected a JSON object"):
        MicrobatchSpec.from_dict(data)


def test_constructor_validates_as_from_dict_does():
    with pytest.raises(SpecError, match=r"'images'\[0\] = \[6, 8\]: sizes must be multiples of patch_dim=4"):
        MicrobatchSpec(images=((6, 8),), patch_dim=4)


@pytest.mark.parametrize("fields, expected", [pytest.param(f, e, id=c) for c, f, e in BAD_SPECS[:6]])
def test_load_names_the_file_and_the_field(tmp_path, fields, expected):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(SpecError) as err:
        MicrobatchSpec.load(path)
    assert str(err.value).startswith(f"{path}: ")
    for text in expected:
        assert text in str(err.value)


@pytest.mark.parametrize("content, expected", [
    ('{"images": [[4, 4]]', "not valid JSON"),
    ("", "not valid JSON"),
    ("[[4, 4]]", "expected a JSON object"),
])
def test_load_rejects_invalid_json(tmp_path, content, expected):
    path = tmp_path / "spec.json"
    path.write_text(content)
    with pytest.raises(SpecError, match=expected) as err:
        MicrobatchSpec.load(path)
    assert str(path) in str(err.value)


def test_load_rejects_non_utf8_file(tmp_path):
    path = tmp_path / "spec.json"
    path.write_bytes(b'\xff\xfe{"images": []}')
    with pytest.raises(SpecError, match="not valid JSON \\(expected UTF-8 text") as err:
        MicrobatchSpec.load(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("name", ["missing.json", "."])
def test_load_rejects_unreadable_file(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(SpecError, match="cannot read spec file") as err:
        MicrobatchSpec.load(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("fields", [GOOD, VIDEO, {"images": []}, {"images": [[4, 4]] * 3, "num_frames": [2, 1]}])
def test_json_round_trip(tmp_path, fields):
    spec = MicrobatchSpec.from_dict(fields)
    assert MicrobatchSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert MicrobatchSpec.load(spec.save(tmp_path / "sub" / "spec.json")) == spec


def test_defaults():
    spec = MicrobatchSpec.from_dict({"images": [[8, 8]]})
    assert (spec.num_frames, spec.temporal_patch_size, spec.patch_dim, spec.seed) == (None, 1, DEFAULT_PATCH_DIM, 0)
    assert spec.media_frames == (1,)


def test_shapes_of_tensors():
    spec = MicrobatchSpec.from_dict(GOOD)  # grids 2x2 and 2x3
    batch = spec.tensors()
    assert batch.patches.shape == (1, 10, 3 * 4 * 4) and batch.patches.dtype == torch.float64
    assert batch.imgs_sizes.tolist() == [[8, 8], [8, 12]]
    assert batch.cu_seqlens.tolist() == [0, 4, 10] and batch.cu_seqlens.dtype == torch.int32
    assert spec.grids == ((2, 2), (2, 3)) and spec.row_patches == (4, 6)


def test_video_counts_tubelets():
    assert MicrobatchSpec.from_dict(VIDEO).num_tubelets == 3 + 1  # 5 frames at T=2 make 3 tubelets, plus a still


def test_largest_seed_yields_tensors():
    assert MicrobatchSpec.from_dict({"images": [[4, 4]], "seed": 2**64 - 1}).tensors().patches.shape == (1, 1, 48)


def test_same_seed_same_patches():
    a, b = MicrobatchSpec.from_dict(GOOD).tensors(), MicrobatchSpec.from_dict(GOOD).tensors()
    torch.testing.assert_close(a.patches, b.patches, rtol=0, atol=0)


def test_different_seed_different_patches():
    a = MicrobatchSpec.from_dict(GOOD).tensors()
    b = MicrobatchSpec.from_dict({**GOOD, "seed": GOOD["seed"] + 1}).tensors()
    assert a.patches.shape == b.patches.shape and not torch.equal(a.patches, b.patches)


def test_tensors_do_not_touch_the_global_rng():
    state = torch.get_rng_state()
    MicrobatchSpec.from_dict(GOOD).tensors()
    assert torch.equal(torch.get_rng_state(), state)


def test_tensors_dtype_is_a_rounding_of_float64():
    spec = MicrobatchSpec.from_dict(GOOD)
    assert torch.equal(spec.tensors(torch.float32).patches, spec.tensors().patches.float())


@pytest.mark.parametrize("fields", [{"images": []}, {"images": [], "num_frames": [], "temporal_patch_size": 2}])
def test_empty_microbatch_is_valid(fields):
    batch = MicrobatchSpec.from_dict(fields).tensors()
    assert batch.patches.shape == (1, 0, 3 * DEFAULT_PATCH_DIM**2)
    assert batch.imgs_sizes.shape == (0, 2)
    assert batch.cu_seqlens.tolist() == [0]
