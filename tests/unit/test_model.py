"""The CP-unaware tower: pixel shuffle and even-grid padding, placeholders, deterministic init, and the
property vision DP over CP rests on: every image (tubelet) is encoded independently of the others."""

import pytest
import torch
from torch.testing import assert_close

from vdpcp.feature.model import TowerConfig, VisionModel, output_tokens, pad_patch_grid_to_even, pixel_shuffle, positions_needed
from vdpcp.feature.spec import MicrobatchSpec

P = 4
C = 3  # channels of the toy grids below
# Odd and even grids, a 1x1 (placeholder-sized) one among them.
STILLS = [[8, 8], [12, 8], [4, 4], [8, 20], [16, 12], [4, 12]]


def _grid(h, w, c=C):
    return torch.randn(h, w, c, generator=torch.Generator().manual_seed(100 * h + w), dtype=torch.float64)


@pytest.mark.parametrize("h, w", [(2, 2), (2, 4), (4, 2), (6, 4)])
def test_pixel_shuffle_folds_each_2x2_block_into_one_token(h, w):
    grid = _grid(h, w)
    expected = torch.stack([
        torch.cat([grid[2 * i, 2 * j], grid[2 * i, 2 * j + 1], grid[2 * i + 1, 2 * j], grid[2 * i + 1, 2 * j + 1]])
        for i in range(h // 2) for j in range(w // 2)
    ])
    assert torch.equal(pixel_shuffle(grid), expected)


@pytest.mark.parametrize("h, w", [(1, 1), (3, 2), (2, 3), (5, 5)])
def test_pixel_shuffle_rejects_odd_grid(h, w):
    with pytest.raises(ValueError, match=f"pixel shuffle needs an even patch grid, got {h}x{w}"):
        pixel_shuffle(_grid(h, w))


@pytest.mark.parametrize("h, w", [(1, 1), (3, 2), (2, 3), (3, 5), (2, 4)])
def test_pad_to_even_pads_only_odd_axes_with_zeros(h, w):
    grid = _grid(h, w)
    padded = pad_patch_grid_to_even(grid)
    assert padded.shape == (h + h % 2, w + w % 2, C)
    assert torch.equal(padded[:h, :w], grid)
    assert not padded[h:].any() and not padded[:, w:].any()


def test_placeholder_grid_becomes_one_token():
    token = pixel_shuffle(pad_patch_grid_to_even(_grid(1, 1)))
    assert token.shape == (1, 4 * C)
    assert torch.equal(token[0, :C], _grid(1, 1)[0, 0]) and not token[0, C:].any()
    assert output_tokens((1, 1)) == 1


def _model(**config):
    return VisionModel(TowerConfig(patch_dim=P, **config)).double()


def _encode(model, spec):
    batch = spec.tensors()
    return model.encode(batch.patches, batch.imgs_sizes, spec.num_frames)


@pytest.mark.parametrize("size", [[4, 4], [12, 8], [20, 12]])
def test_tokens_per_image_follow_output_tokens(size):
    spec = MicrobatchSpec(images=(tuple(size),), patch_dim=P)
    features = _encode(_model(), spec)
    assert features.shape == (output_tokens(spec.grids[0]), 4 * TowerConfig().hidden)


def _split_media(spec: MicrobatchSpec, cuts: list[list[int]]) -> MicrobatchSpec:
    """The same rows with each media item cut into pieces of the given frame counts."""
    assert [sum(c) for c in cuts] == list(spec.media_frames)
    return MicrobatchSpec(images=spec.images, num_frames=tuple(n for c in cuts for n in c),
                          temporal_patch_size=spec.temporal_patch_size, patch_dim=P, seed=spec.seed)


@pytest.mark.parametrize("seed", range(3))
def test_images_encode_one_by_one_as_packed(seed):
    spec = MicrobatchSpec(images=tuple(map(tuple, STILLS)), patch_dim=P, seed=seed)
    model = _model(seed=seed)
    packed = model(spec.tensors().patches, spec.images)
    cu = spec.tensors().cu_seqlens.tolist()
    alone = torch.cat([model(spec.tensors().patches[:, a:b], [size]) for size, a, b in zip(spec.images, cu, cu[1:])])
    assert_close(alone, packed)


# A video of 7 frames and one of 5 at T=3, with stills between them: (cuts on tubelet boundaries).
VIDEO = MicrobatchSpec(images=((8, 8),) * 7 + ((12, 4),) + ((4, 4),) * 5, num_frames=(7, 1, 5),
                       temporal_patch_size=3, patch_dim=P, seed=5)


@pytest.mark.parametrize("cuts", [
    [[3, 3, 1], [1], [3, 2]],  # every tubelet alone
    [[6, 1], [1], [3, 2]],
    [[3, 4], [1], [5]],
])
def test_videos_split_on_tubelet_boundaries_encode_as_whole(cuts):
    model = _model(temporal_patch_size=3)
    assert_close(_encode(model, _split_media(VIDEO, cuts)), _encode(model, VIDEO))


def test_a_cut_inside_a_tubelet_changes_the_features():
    """The check above can fail: a video cut mid-tubelet stacks different frames."""
    model = _model(temporal_patch_size=3)
    cut, whole = _encode(model, _split_media(VIDEO, [[2, 5], [1], [5]])), _encode(model, VIDEO)
    assert cut.shape == whole.shape and not torch.allclose(cut, whole)


def test_tubelets_encode_one_by_one_as_packed():
    model = _model(temporal_patch_size=3)
    batch = VIDEO.tensors()
    cu, starts, pieces = batch.cu_seqlens.tolist(), [0, 3, 6, 7, 8, 11, 13], []
    for a, b in zip(starts, starts[1:]):
        pieces.append(model.encode(batch.patches[:, cu[a] : cu[b]], VIDEO.images[a:b], [b - a]))
    assert_close(torch.cat(pieces), _encode(model, VIDEO))


def test_init_is_deterministic_from_the_seed_and_leaves_the_global_rng_alone():
    rng = torch.get_rng_state()
    a, b, other = _model(seed=1).state_dict(), _model(seed=1).state_dict(), _model(seed=2).state_dict()
    assert torch.equal(torch.get_rng_state(), rng)
    assert a.keys() == b.keys() == other.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], other[k]) for k in a)


def test_without_even_padding_an_odd_grid_raises_the_pixel_shuffle_error():
    spec = MicrobatchSpec(images=((8, 8), (12, 8)), patch_dim=P)  # grids 2x2, 3x2
    with pytest.raises(ValueError, match="pixel shuffle needs an even patch grid, got 3x2"):
        _encode(_model(pad_odd_grids=False), spec)


def test_even_padding_changes_nothing_on_even_grids():
    spec = MicrobatchSpec(images=((8, 8), (16, 8)), patch_dim=P)
    assert_close(_encode(_model(pad_odd_grids=False), spec), _encode(_model(), spec))


@pytest.mark.parametrize("T", [1, 2])
def test_empty_microbatch_yields_empty_features(T):
    spec = MicrobatchSpec(images=(), num_frames=() if T > 1 else None, temporal_patch_size=T, patch_dim=P)
    model = _model(temporal_patch_size=T)
    batch = spec.tensors()
    assert _encode(model, spec).shape == (0, 4 * model.config.hidden)
    assert model(batch.patches, batch.imgs_sizes, spec.num_frames).shape == (0, model.config.lm_hidden)


def test_a_tower_keeping_fewer_positions_has_every_weight_of_the_whole_one_and_encodes_alike():
    spec = MicrobatchSpec(images=tuple(map(tuple, STILLS)), patch_dim=P)
    kept = positions_needed(spec.grids)
    whole, small = _model(), _model(positions=kept)
    assert kept == 5 and small.pos.shape == (kept, kept, whole.config.hidden)
    small_params = dict(small.named_parameters())
    for name, p in whole.named_parameters():
        assert torch.equal(small_params[name], p[:kept, :kept] if name == "pos" else p), name
    assert torch.equal(_encode(small, spec), _encode(whole, spec))


def test_a_grid_larger_than_the_kept_positions_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"a 3x5 patch grid is larger than the tower's position table \(4x4 patches"):
        _encode(_model(positions=4), MicrobatchSpec(images=((12, 20),), patch_dim=P))


def test_a_case_keeps_the_positions_its_microbatch_needs():
    from vdpcp.impls import resolve
    from vdpcp.matrix.case import Case

    spec = MicrobatchSpec(images=((8, 24), (4, 4)), patch_dim=P)
    model = resolve("reference").build_model(Case(spec, 2, "reference"), torch.float64, torch.device("cpu"))
    assert model.pos.shape[:2] == (6, 6)
