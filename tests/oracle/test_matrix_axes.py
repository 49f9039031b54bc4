"""The matrix as an implementation from outside declares itself: its own partitions, its tower's media axes,
its own microbatches. Pure: no ranks run here."""

import pytest

from vdpcp.cli import main
from vdpcp.contract.protocol import MediaAxes
from vdpcp.matrix import scenarios

OWN = "tests.oracle.subjects:own_partition"


def _ids(impl):
    return [c.id for c in scenarios.matrix(impls=(impl,))]


def test_an_own_partition_name_keeps_every_row_of_the_matrix():
    reference = [i.replace("-reference-count", "-X") for i in _ids("reference") if "-reference-count" in i]
    own = [i.replace("-own-partition-contiguous", "-X") for i in _ids(OWN)]
    missing = sorted(set(reference) - set(own))
    assert not missing, missing[:5]  # layouts, zigzag, opt-out, mismatch and empty rows included


def test_media_axes_scale_sizes_keep_grids_raise_small_grids_and_map_tubelets():
    media = MediaAxes(patch_dim=8, temporal_patch_sizes=(1, 2), min_grid=2)
    table = {s.spec.name: s for s in scenarios.scenarios()}
    mixed = scenarios.spec_for(table["mixed-sizes"], media)
    original = table["mixed-sizes"].spec
    assert mixed.patch_dim == 8
    assert mixed.grids == tuple((max(h, 2), max(w, 2)) for h, w in original.grids)
    video = scenarios.spec_for(table["video-t4-ragged"], media)
    assert video.temporal_patch_size == 2 and video.num_frames == table["video-t4-ragged"].spec.num_frames
    assert scenarios.spec_for(table["mixed-sizes"], MediaAxes()) is original  # the toy tower's axes change nothing


def test_a_tower_that_takes_images_only_gets_no_video_rows():
    table = {s.spec.name: s for s in scenarios.scenarios()}
    assert scenarios.spec_for(table["video-t2-even"], MediaAxes(temporal_patch_sizes=(1,))).temporal_patch_size == 1


def test_a_local_floor_adds_microbatches_past_it_on_every_rank_and_its_own_microbatches_run():
    cases = scenarios.matrix(impls=(OWN,))
    large = [c for c in cases if c.spec.name.startswith("large-")]
    assert {c.cp for c in large} == set(scenarios.CP_SIZES)
    for case in large:
        assert len(case.spec.images) == 2 * case.cp + 1  # every rank holds at least one image
        assert min(case.spec.row_patches) > 50, case.spec
        assert scenarios.family_of(case) == "large"
    own = [c for c in cases if c.spec.name == "own-three-large"]
    assert {c.cp for c in own} == set(scenarios.CP_SIZES) and all(scenarios.family_of(c) == "own" for c in own)


def test_split_takes_an_implementations_own_names_and_says_what_a_name_leaves_out(capsys):
    assert main(["check", "--impl", OWN, "reference", "--split", "contiguous", "--cp", "2", "--list"]) == 0
    printed = capsys.readouterr()
    assert "-own-partition-contiguous" in printed.out and "-reference-" not in printed.out
    assert "leaves out every case of reference" in printed.err


@pytest.mark.parametrize("argv", [["check", "--split", "nope", "--list"],
                                  ["replay", "vdpcp/fixtures/video.json", "--cp", "2", "--split", "nope"]])
def test_a_partition_no_implementation_has_is_one_usage_error(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "partition" in err and err.count("\n") == 1, err
