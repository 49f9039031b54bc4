"""transformers' Qwen2.5-VL vision tower (vdpcp.impls.qwen2_5_vl) held to vdpcp's oracle: a subset of the
scenario table with a scenario of every family (fewer images than ranks, exact and remainder splits, mixed and
odd sizes, videos, videos with images) at CP 1, 2, 4 and 8, in CP x DP layouts, opted out and with a
mismatched process group; the tower's input against transformers' own image processor; the plan; and a broken
copy, selected by module:object, that the oracle must fail with the rank and the check named."""

import numpy as np
import pytest
import torch

from vdpcp.contract.protocol import Ownership
from vdpcp.feature.sharded import VisionDPConfig
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls import available, resolve
from vdpcp.impls.qwen2_5_vl import media_shards, qwen2_5_vl
from vdpcp.matrix import scenarios
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_case
from vdpcp.testing import assert_case, params

SUBSET = ("one-image", "three-images", "eight-equal", "eleven-images", "mixed-sizes", "video-t2-ragged",
          "video-and-images")
TABLE = [s for s in scenarios.scenarios(fixtures=None) if s.spec.name in SUBSET]
BROKEN = "tests.impls.broken_qwen:broken"
P = 4


@pytest.mark.distributed
@pytest.mark.parametrize("case", params("qwen2_5_vl", table=TABLE))
def test_matrix(case):
    assert_case(case)


@pytest.mark.distributed
def test_opted_out_outputs_equal_the_unsharded_ones():
    """The float64 opt-out's outputs hold whatever its gradients are held to (at a tower over the sketch's width, the
    one backward of the summed loss: the strict xfail qwen-float32-inside)."""
    spec = next(s.spec for s in TABLE if s.spec.name == "video-and-images")
    assert_case(Case(spec, 2, "qwen2_5_vl", vision_dp_over_cp=False, grads=False))


@pytest.mark.distributed
def test_a_gather_that_does_not_sum_gradients_fails_with_the_rank_and_check_named():
    spec = next(s.spec for s in TABLE if s.spec.name == "eleven-images")
    result = run_case(Case(spec, 2, BROKEN))
    assert result.verdict == "fail", result.summary()
    for rank in (0, 1):
        assert f"rank {rank}: input grads (summed over ranks)" in "\n".join(result.failures), result.summary()
        assert f"rank {rank}: param grads (summed over ranks)" in "\n".join(result.failures), result.summary()
    assert not any("outputs" in failure for failure in result.failures), result.summary()


def test_without_sharding_no_collective_runs_and_the_result_is_the_unsharded_one():
    """No process group exists in this process: a collective would raise."""
    spec = next(s.spec for s in TABLE if s.spec.name == "video-and-images")
    model = qwen2_5_vl.build_model(Case(spec, 1, "qwen2_5_vl"), torch.float64, torch.device("cpu"))
    inputs = qwen2_5_vl.inputs(spec.tensors())
    for config in (VisionDPConfig(context_parallel_size=1), VisionDPConfig(context_parallel_size=2, vision_dp_over_cp=False)):
        assert torch.equal(qwen2_5_vl.encode_sharded(model, inputs, config, None), qwen2_5_vl.encode(model, inputs))


def test_an_unregistered_class_resolves_by_module_and_object():
    assert BROKEN not in available().values()
    assert resolve(BROKEN).name == "broken_qwen"


# --- the tower's input -----------------------------------------------------------------------------------


def _spec(images, frames=None, T=1):
    return MicrobatchSpec(images=tuple(map(tuple, images)), num_frames=frames, temporal_patch_size=T, patch_dim=P)


def _pixels(patches: torch.Tensor, grid) -> np.ndarray:
    """One image row of vdpcp's patches ([h * w, C*P*P], row-major, each patch (C, P, P)) as a [C, H, W] image."""
    gh, gw = grid
    return patches.reshape(gh, gw, 3, P, P).permute(2, 0, 3, 1, 4).reshape(3, gh * P, gw * P).numpy()


def _tower_grid(pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
    """One media item's tower input back on its grid: [t, H, W, C, T, P, P]."""
    t, h, w = grid_thw
    return pixel_values.reshape(t, h // 2, w // 2, 2, 2, 3, 2, P, P).permute(0, 1, 3, 2, 4, 5, 6, 7, 8).reshape(
        t, h, w, 3, 2, P, P)


def test_images_are_packed_as_transformers_image_processor_packs_them():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = _spec([[16, 24], [8, 32], [24, 8]])
    batch = spec.tensors(dtype=torch.float32)  # the processor patchifies in float32: equal to the bit
    inputs = qwen2_5_vl.inputs(batch)
    processor, cu = Qwen2VLImageProcessorPil(), batch.cu_seqlens.tolist()
    expected = [processor.patchify(_pixels(batch.patches[0, cu[i] : cu[i + 1]], grid), P, 2, 2)
                for i, grid in enumerate(spec.grids)]
    assert inputs.grid_thw.tolist() == [[1, gh, gw] for _, gh, gw in expected]
    assert torch.equal(inputs.pixel_values, torch.from_numpy(np.concatenate([e[0] for e in expected])))


def test_an_odd_grid_is_padded_with_zero_patches_at_the_bottom_and_right():
    batch = _spec([[12, 20]]).tensors()  # 3x5 patches
    inputs = qwen2_5_vl.inputs(batch)
    assert inputs.grid_thw.tolist() == [[1, 4, 6]]
    grid = _tower_grid(inputs.pixel_values, (1, 4, 6))[0]
    real = batch.patches[0].reshape(3, 5, 3, P, P)
    for frame in (0, 1):  # an image fills its temporal patch with itself
        assert torch.equal(grid[:3, :5, :, frame], real)
    assert not grid[3:].any() and not grid[:, 5:].any()


def test_a_video_fills_temporal_patches_and_an_odd_frame_count_repeats_its_last_frame():
    batch = _spec([[8, 8]] * 3, frames=(3,), T=2).tensors()
    inputs = qwen2_5_vl.inputs(batch)
    assert inputs.grid_thw.tolist() == [[2, 2, 2]]
    grid = _tower_grid(inputs.pixel_values, (2, 2, 2))
    frames = batch.patches[0].reshape(3, 2, 2, 3, P, P)
    for t, pair in enumerate(((0, 1), (2, 2))):
        for slot, frame in enumerate(pair):
            assert torch.equal(grid[t, :, :, :, slot], frames[frame])


def test_inputs_are_differentiable_and_every_real_patch_reaches_the_tower():
    batch = _spec([[12, 20]] + [[8, 16]] * 3, frames=(1, 3), T=2).tensors()
    batch.patches.requires_grad_(True)
    (grad,) = torch.autograd.grad(qwen2_5_vl.inputs(batch).pixel_values.sum(), batch.patches)
    # An image fills both frames of its temporal patch; the video's last (third) frame fills two slots.
    copies = torch.tensor([2] * 15 + [1] * 16 + [2] * 8, dtype=grad.dtype).reshape(1, -1, 1)
    assert torch.equal(grad, copies.expand_as(grad))


def test_a_video_with_frames_of_two_sizes_is_refused_naming_the_media_item():
    batch = _spec([[8, 8], [8, 8], [8, 16]], frames=(1, 2)).tensors()
    with pytest.raises(ValueError, match=r"media item 1 \(rows 1\.\.2\).*\[\(8, 8\), \(8, 16\)\]"):
        qwen2_5_vl.inputs(batch)


# --- the plan ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_media, cp, shards", [
    (11, 4, [(0, 2), (2, 4), (4, 6), (6, 11)]),  # by count, the remainder on the last rank
    (8, 8, [(r, r + 1) for r in range(8)]),
    (3, 4, [(0, 1), (1, 2), (2, 3), (3, 3)]),  # fewer items than ranks: the last rank holds a placeholder
    (0, 2, [(0, 0), (0, 0)]),
])
def test_media_shards(num_media, cp, shards):
    assert media_shards(num_media, cp) == shards


def test_plan_owns_whole_media_items_with_their_tokens_on_the_first_row():
    spec = next(s.spec for s in TABLE if s.spec.name == "video-and-images")  # frames 1, 4, 1, 5, 1
    plan = qwen2_5_vl.plan(spec, VisionDPConfig(context_parallel_size=2))
    assert plan.owner == (0,) * 5 + (1,) * 7
    # 16x16: 4x4 patches, 4 tokens; 4 frames of 16x24: 2 x 2x3 tokens; 24x8: 3x1; 5 frames of 8x16: 3 x 1x2
    assert plan.tokens == (4, 12, 0, 0, 0, 3, 6, 0, 0, 0, 0, 4)
    assert plan.placeholders == (0, 0)


def test_plan_gives_every_idle_rank_one_placeholder_and_none_when_not_sharded():
    spec = next(s.spec for s in TABLE if s.spec.name == "one-image")  # 32x24: 8x6 patches, 12 tokens
    assert qwen2_5_vl.plan(spec, VisionDPConfig(context_parallel_size=4)) == Ownership((0,), (12,), (0, 1, 1, 1))
    assert qwen2_5_vl.plan(spec, VisionDPConfig(context_parallel_size=4, vision_dp_over_cp=False)) is None


def test_plan_tokens_are_what_the_tower_merges():
    spec = next(s.spec for s in TABLE if s.spec.name == "mixed-sizes")
    grid_thw = qwen2_5_vl.inputs(spec.tensors()).grid_thw
    plan = qwen2_5_vl.plan(spec, VisionDPConfig(context_parallel_size=2))
    assert sum(plan.tokens) == int(grid_thw.prod(dim=1).sum()) // 4
