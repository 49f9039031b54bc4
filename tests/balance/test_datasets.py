"""The dataset-shaped generators: deterministic, and shaped like the data they stand for."""

import pytest

from vdpcp.feature.datasets import DATASETS, DatasetError, generate

SEEDS = range(50)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_same_arguments_same_microbatch(name):
    assert generate(name, 7) == generate(name, 7)
    assert generate(name, 7) != generate(name, 8)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_pixel_sizes_at_p16_are_448_to_1024_with_even_grids(name):
    for seed in SEEDS:
        spec = generate(name, seed)
        assert spec.patch_dim == 16
        for h, w in spec.images:
            assert 448 <= h <= 1024 and 448 <= w <= 1024, (name, seed, h, w)
        assert all(gh % 2 == 0 and gw % 2 == 0 for gh, gw in spec.grids)


def test_multi_image_packs_one_to_five_images_per_sample():
    counts = [len(generate("multi-image", seed, samples=1).images) for seed in range(200)]
    assert set(counts) == {1, 2, 3, 4, 5}
    sizes = {len(generate("multi-image", seed).images) for seed in SEEDS}
    assert min(sizes) >= 12 and max(sizes) <= 60  # 12 samples of 1-5 images


def test_doc_qa_is_one_portrait_page_per_sample():
    for seed in SEEDS:
        spec = generate("doc-qa", seed, samples=5)
        assert len(spec.images) == 5 and spec.num_frames is None
        assert all(h > w for h, w in spec.images)


def test_video_is_tubelets_of_two_frames_sharing_a_size():
    for seed in SEEDS:
        spec = generate("video", seed)
        assert spec.temporal_patch_size == 2
        assert all(4 <= n <= 32 for n in spec.num_frames)
        assert sum(spec.num_frames) == len(spec.images)  # and MicrobatchSpec checks a video's frames share a size


def test_another_patch_dim_keeps_the_token_counts():
    for name in DATASETS:
        at16, at4 = generate(name, 3), generate(name, 3, patch_dim=4)
        assert at4.grids == at16.grids and at4.row_patches == at16.row_patches


def test_downscale_divides_grid_sides():
    full, small = generate("multi-image", 1), generate("multi-image", 1, downscale=4)
    assert small.grids == tuple((gh // 4, gw // 4) for gh, gw in full.grids)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="mantis"), "dataset must be one of"),
        (dict(name="video", samples=0), "samples must be a positive integer"),
        (dict(name="video", downscale=0), "downscale must be a positive integer"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(DatasetError, match=message):
        generate(**kwargs)
