"""Nemotron Omni's vision path around MCore's RADIO tower (vdpcp.impls.nemotron_omni), driven through the Bridge
adapter (vdpcp.impls.bridge): the adapter's mapping of vdpcp's microbatch onto ``_encode_images``; the unsharded
encode against an independent composition (each image alone); the switches (off: no collective; a configured CP that
disagrees with the group: Omni's own error before any collective); the odd-frame video remnant, computed from the
plan and a strict xfail exactly there; its saved replay file (an xfail, and a failure for its maintainer); the
execution check with its two embedders (a placeholder rank may take the image embedder, but not skip RADIO); and a
subset of the matrix at CP 2 and 4, every scenario family of its rows once (the full matrix is vdpcp check's)."""

from pathlib import Path

import pytest
import torch

from vdpcp.cli import main
from vdpcp.contract.protocol import VisionDPConfig
from vdpcp.feature.model import seeded
from vdpcp.feature.spec import Microbatch, MicrobatchSpec
from vdpcp.impls import resolve
from vdpcp.impls.bridge import BridgeEncoder
from vdpcp.impls.nemotron_omni import (
    GROUP_MISMATCH,
    SIZES,
    VIDEO_REMNANT,
    NemotronOmni,
    OmniVision,
    nemotron_omni,
    pixel_shuffle,
    video_remnants,
)
from vdpcp.matrix import scenarios
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged
from vdpcp.testing import assert_case, params

ROOT = Path(__file__).resolve().parents[2]
REPLAY = ROOT / "docs" / "known-limits" / "omni-video-remnant-cp2.json"
P = SIZES["toy"].patch


def _build(spec, dtype=torch.float64):
    return nemotron_omni.build_model(Case(spec, 1, "nemotron-omni"), dtype, torch.device("cpu"))


def _mixed():
    """Two images and a 3-frame video (a short last tubelet), even grids."""
    images = ((4 * P, 4 * P), (2 * P, 6 * P)) + ((4 * P, 2 * P),) * 3
    return MicrobatchSpec(images, num_frames=(1, 1, 3), temporal_patch_size=2, patch_dim=P, seed=3)


def test_it_is_registered_by_its_name():
    assert resolve("nemotron-omni") is nemotron_omni
    assert isinstance(nemotron_omni, BridgeEncoder)


# --- the adapter ------------------------------------------------------------------------------------------------


class Recorder:
    """Any object with Bridge's _encode_images and flag: records what the adapter hands it."""

    def __init__(self):
        self.vision_dp_over_cp, self.context_parallel_lm, self.calls = True, 0, []

    def _encode_images(self, images, imgs_sizes, packed_seq_params, num_frames):
        self.calls.append((self.vision_dp_over_cp, self.context_parallel_lm, images, imgs_sizes, packed_seq_params,
                           num_frames))
        return images[0, :, :2]


def test_the_adapter_hands_bridges_encoder_the_microbatch_as_bridges_forward_does():
    spec = _mixed()
    batch, module = spec.tensors(), Recorder()
    adapter = BridgeEncoder()
    adapter.encode(module, batch)
    adapter.encode_sharded(module, batch, VisionDPConfig(4, vision_dp_over_cp=False), None)  # off: no group needed
    adapter.encode_sharded(module, batch, VisionDPConfig(1), None)  # CP 1: the feature self-disables
    assert [(on, cp) for on, cp, *_ in module.calls] == [(False, 1), (False, 4), (False, 1)]
    _, _, images, sizes, params, frames = module.calls[0]
    assert images is batch.patches and torch.equal(sizes, batch.imgs_sizes)  # the same tensor: gradients reach it
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == batch.cu_seqlens.tolist()
    assert params.max_seqlen_q == max(spec.row_patches)
    assert frames.tolist() == [1, 1, 3]


# --- the subject --------------------------------------------------------------------------------------------------


def test_the_pixel_shuffle_folds_each_2x2_block_of_the_spatial_grid():
    grid = torch.arange(4 * 6 * 3.0).reshape(4, 6, 3)
    tokens = pixel_shuffle(grid, pad_odd=False)
    assert tokens.shape == (6, 12)
    # token 4 is block row 1, block column 1: patches (2, 2), (2, 3), (3, 2), (3, 3)
    assert torch.equal(tokens[4], torch.cat([grid[2, 2], grid[2, 3], grid[3, 2], grid[3, 3]]))
    with pytest.raises(ValueError, match="even patch grid, got 3x6"):
        pixel_shuffle(grid[:3], pad_odd=False)
    assert torch.equal(pixel_shuffle(grid[:1, :1], pad_odd=True), torch.cat([grid[0, 0], torch.zeros(9)])[None])


def whole_and_alone(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """The microbatch's features, and each item's encoded alone (MCore's layers need torch.distributed: a rank)."""
    spec = _mixed()
    model, batch = _build(spec), spec.tensors()
    whole, alone, cu = nemotron_omni.encode(model, batch), [], batch.cu_seqlens.tolist()
    for first, frames in ((0, 1), (1, 1), (2, 3)):
        part = MicrobatchSpec(spec.images[first : first + frames], num_frames=(frames,), temporal_patch_size=2,
                              patch_dim=P, seed=spec.seed)
        rows = slice(first, first + frames)
        alone.append(nemotron_omni.encode(model, Microbatch(
            part, patches=batch.patches[:, cu[first] : cu[first + frames]], imgs_sizes=batch.imgs_sizes[rows],
            cu_seqlens=batch.cu_seqlens[first : first + frames + 1] - cu[first])))
    return whole.detach(), torch.cat(alone).detach()


@pytest.mark.distributed
def test_unsharded_every_item_is_encoded_as_it_would_be_alone(run_ranks):
    """The microbatch's features are each image's and the video's own, encoded alone, in order: attention stays
    within each image, each item gets its class tokens, which are dropped again, and the video goes through the
    video embedder (its short last tubelet repeats its final frame)."""
    whole, alone = run_ranks(whole_and_alone, 1)[0]
    assert whole.shape == (4 + 3 + 2 * 2, SIZES["toy"].lm_hidden)
    torch.testing.assert_close(whole, alone, rtol=0, atol=1e-12)


def test_a_configured_cp_that_disagrees_with_the_group_raises_omnis_error_before_any_collective():
    """No process group exists in this process: a collective would raise something else."""
    spec = _mixed()
    model = _build(spec)
    model.vision_dp_over_cp, model.context_parallel_lm = True, 4  # its CP group (none here) has one rank
    with pytest.raises(ValueError, match=f"Nemotron Omni {GROUP_MISMATCH}: config=4, group=1"):
        model._encode_images(*_bridge_arguments(spec))


def _bridge_arguments(spec):
    from vdpcp.impls.bridge import bridge_arguments

    return bridge_arguments(spec.tensors())


def test_an_empty_microbatch_is_not_encoded_and_has_no_vision_features():
    """Through the adapter, as Bridge's forward: RADIO would refuse an empty microbatch (its non-dynamic branch)."""
    model = _build(_mixed())
    out = nemotron_omni.encode(model, MicrobatchSpec((), patch_dim=P).tensors())
    assert out.shape == (0, SIZES["toy"].lm_hidden) and out.dtype == torch.float64 and out.grad_fn is None


def test_its_parameter_count_is_the_built_towers():
    spec = _mixed()
    assert nemotron_omni.sizing.param_count(Case(spec, 1, "nemotron-omni")) == sum(p.numel() for p in _build(spec).parameters())


# --- the odd-frame video remnant ---------------------------------------------------------------------------------


def _video(frames, images_before=0):
    images = ((4 * P, 4 * P),) * images_before + ((4 * P, 6 * P),) * frames
    return MicrobatchSpec(images, num_frames=(1,) * images_before + (frames,), temporal_patch_size=2, patch_dim=P)


@pytest.mark.parametrize(("spec", "cp", "remnants"), [
    (_video(3), 2, [(1, 0)]),  # frames [0, 1] | [2]: the split lands after the first tubelet
    (_video(3), 4, [(1, 0)]),  # two tubelets and two placeholders: [0, 1] | [2] | P | P
    (_video(5), 2, []),  # the split lands on frame 2: [0, 1] | [2, 3, 4], the short tubelet stays with its first frame
    (_video(5), 4, [(2, 0)]),  # three tubelets and a placeholder: [0, 1] | [2, 3] | [4] | P
    (_video(4), 2, []),  # an even frame count: every share is whole tubelets of 2
    (_video(3, images_before=1), 2, [(1, 1)]),  # image + frames 0-1 | frame 2
], ids=["3f-cp2", "3f-cp4", "5f-cp2", "5f-cp4", "4f-cp2", "image-3f-cp2"])
def test_the_remnant_is_found_from_the_plan(spec, cp, remnants):
    assert video_remnants(spec, cp) == remnants


def test_the_remnant_limit_is_declared_exactly_where_the_plan_has_one():
    """Over the whole matrix (every CP size, every backend's view): the limit where a rank's share of a video is a
    single frame, and nowhere else."""
    met = set()
    for case in scenarios.matrix(impls=("nemotron-omni",)):
        limit = nemotron_omni.known_limit(case, "nccl")
        plain = case.config.shard_vision and case.config_cp is None
        assert (limit is VIDEO_REMNANT) == bool(plain and video_remnants(case.spec, case.cp)), case.id
        if limit is VIDEO_REMNANT:
            met.add(f"{case.spec.name}-cp{case.cp}")
    assert {"few-tubelets-t2-cp2", "video-t2-ragged-cp2", "video-and-images-cp8"} <= met


@pytest.mark.parametrize("options, code, verdict", [((), 0, "verdict: xfail (omni-video-remnant: "),
                                                     (("--no-known-limits",), 1, "verdict: fail")])
def test_the_saved_replay_file_is_an_xfail_and_fails_for_a_maintainer(capsys, options, code, verdict):
    """The runner finds the sharded result wrong; judged as vdpcp check judges it, the declared limit makes it an
    xfail (exit 0); with --no-known-limits, as for the maintainer who fixes it, it fails (exit 1)."""
    assert main(["replay", str(REPLAY), *options]) == code
    said = capsys.readouterr().out
    assert f"\n{verdict}" in said and "\n  rank 1: outputs: Tensor-likes are not close!" in said, said
    assert ("omni-video-remnant set aside" in said) == bool(options), said


# --- the execution check, fair to its two embedders ---------------------------------------------------------------


class PlaceholderRankSkips(OmniVision):
    """Omni whose rank of placeholders alone skips RADIO and the projector and hands MCore's gather zeros (one token
    per 1x1 placeholder, padded to 2x2): outputs right, the gather drops them, but no tower ran there."""

    def _encode_images(self, images, imgs_sizes, packed_seq_params, num_frames):
        if self.vision_dp_over_cp and imgs_sizes.numel():
            local, sizes, _, _, padded_ranks = self._split(images, imgs_sizes, packed_seq_params, num_frames)
            if not local.ne(0).any():  # only the split's all-zero placeholders
                from megatron.core.models.multimodal.context_parallel import (
                    gather_from_context_parallel_ranks_dynamic_res,
                )

                skipped = images.new_zeros(len(sizes), self.size.lm_hidden, requires_grad=True)
                return gather_from_context_parallel_ranks_dynamic_res(skipped, padded_ranks)
        return super()._encode_images(images, imgs_sizes, packed_seq_params, num_frames)


class OmniPlaceholderSkips(NemotronOmni):
    name = "omni-placeholder-skips"

    def build_model(self, case, dtype, device):
        with seeded(0):  # the toy size: drawn on the CPU, as nemotron-omni's
            model = PlaceholderRankSkips(SIZES[case.tower], case.spec.patch_dim)
        return model.to(device=device, dtype=dtype)


omni_placeholder_skips = OmniPlaceholderSkips()
SPECS = {s.spec.name: s.spec for s in scenarios.SCENARIOS}


@pytest.mark.distributed
def test_a_rank_of_placeholders_that_skips_the_tower_fails_outputs_only_too():
    """Outputs only: the placeholder rank's skipped tower is an outputs failure, whatever the gradients say."""
    judged = run_judged(Case(SPECS["one-image"], 2, "tests.impls.test_nemotron_omni:omni_placeholder_skips",
                             grads=False), backend="gloo")
    said = " | ".join(judged.result.failures)
    assert judged.verdict == "fail" and "rank 1: execution: rank 1 (CP rank 1) read no row and ran no layer of its tower" \
           in said, said


# --- the matrix ---------------------------------------------------------------------------------------------------


# Every scenario family of the matrix once, at CP 2 or 4, with every variant the backend in effect runs of it (the full
# matrix is vdpcp check's): three-images at CP 4 brings a placeholder rank and the special rows (the opt-out, a
# configured CP that disagrees with the group, a configured CP of 1: the silent no-op); eight-equal has gradients on
# gloo too (equal token counts), and the zigzag loss; few-tubelets-t2 is the remnant with gradients, video-and-images
# the remnant with both embedders; at mcore-give-up-t3 every real share is video, and the placeholder rank takes the
# image embedder, which the execution check spares; empty is judged on its graph-less result.
CHOSEN = {("three-images", 4), ("eight-equal", 2), ("mixed-sizes", 2), ("video-t2-even", 4), ("few-tubelets-t2", 2),
          ("video-and-images", 4), ("mcore-give-up-t3", 4), ("doc-qa", 4), ("no-even-pad-cp4", 4), ("empty", 2)}


@pytest.mark.parametrize("case", [p for p in params("nemotron-omni", cps=(2, 4), layouts=False)
                                  if (p.values[0].spec.name, p.values[0].cp) in CHOSEN])
def test_matrix(case):
    assert_case(case)
