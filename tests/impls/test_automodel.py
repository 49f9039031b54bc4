"""NeMo Automodel's frame-level CP vision sharding around transformers' Qwen3-VL tower (vdpcp.impls.automodel),
held to vdpcp's oracle: how it is installed (the pinned release, without its dependencies, imports with ours);
the tower's input against Qwen3-VL's own image and video processors; the outputs (merged features and every
DeepStack level); the shipped thresholds, whose statement (``replicated``) the oracle checks against what each
rank's tower really read, on microbatches just below and at each threshold (CP 2) and on the matrix's small ones
(CP 2, 4), and its partition on ragged frame units above them; and a subset of the matrix with thresholds 0 at CP
1, 2, 4 and 8."""

import importlib
import tomllib
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import torch
from packaging.requirements import Requirement

from vdpcp.contract.protocol import MAIN_OUTPUT, VisionDPConfig
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls import resolve
from vdpcp.impls.automodel import MODELING, PATCH, SHARDING, SPLIT, automodel, automodel_shipped, token_grids, tower_config
from vdpcp.matrix import scenarios
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged
from vdpcp.oracle.compare import rounding
from vdpcp.testing import assert_case, params

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ("one-image", "three-images", "eleven-images", "mixed-sizes", "video-t2-ragged", "video-and-images")
TABLE = [s for s in scenarios.scenarios(fixtures=None) if s.spec.name in SUBSET]


def _spec(name):
    return next(s.spec for s in TABLE if s.spec.name == name)


# --- installed as code under test --------------------------------------------------------------------------


def _pin(lines, package):
    return next(line.split("==")[1].strip() for line in lines if line.strip().startswith(f"{package}=="))


def test_the_pinned_automodel_runs_on_the_projects_transformers():
    """Installed without its dependencies: the module under test imports with ours alone, and transformers stays
    what the project's environment resolved (within the extra's range), not Automodel's own pin."""
    importlib.import_module(SHARDING)
    no_deps = (ROOT / "requirements" / "no-deps.txt").read_text().splitlines()
    [extra] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["transformers"]
    assert version("nemo-automodel") == _pin(no_deps, "nemo-automodel")
    assert Requirement(extra).specifier.contains(version("transformers"))
    assert set(automodel.preload) == {SHARDING, MODELING}


def test_both_subjects_are_registered_by_their_names():
    assert resolve("automodel") is automodel and resolve("automodel-shipped") is automodel_shipped
    assert automodel.splits == automodel_shipped.splits == (SPLIT,)


# --- the tower's input: Qwen3-VL's processors -----------------------------------------------------------------


def _pixels(patches: torch.Tensor, grid) -> torch.Tensor:
    """One image row of vdpcp's patches ([h * w, C*P*P], row-major, each patch (C, P, P)) as a [C, H, W] image."""
    gh, gw = grid
    return patches.reshape(gh, gw, 3, PATCH, PATCH).permute(2, 0, 3, 1, 4).reshape(3, gh * PATCH, gw * PATCH)


def test_images_are_packed_as_qwen3_vls_image_processor_packs_them():
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    processor = getattr(transformers, IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_vl"]["pil"])()
    spec = MicrobatchSpec(tuple((h * PATCH, w * PATCH) for h, w in ((4, 6), (2, 8), (6, 2))), patch_dim=PATCH)
    batch = spec.tensors(dtype=torch.float32)  # the processor patchifies in float32: equal to the bit
    inputs, cu = automodel.inputs(batch), batch.cu_seqlens.tolist()
    expected = [processor.patchify(_pixels(batch.patches[0, cu[i] : cu[i + 1]], grid).numpy(), PATCH, 2, 2)
                for i, grid in enumerate(spec.grids)]
    assert inputs.grid_thw.tolist() == [[1, gh, gw] for _, gh, gw in expected]
    assert torch.equal(inputs.pixel_values, torch.from_numpy(np.concatenate([e[0] for e in expected])))


def test_a_video_is_packed_as_qwen3_vls_video_processor_packs_it():
    """An odd frame count too: the processor repeats the last frame up to a whole temporal patch."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    frames = ((4 * PATCH, 2 * PATCH),) * 3 + ((2 * PATCH, 2 * PATCH),)
    spec = MicrobatchSpec(frames, num_frames=(3, 1), temporal_patch_size=2, patch_dim=PATCH)
    batch = spec.tensors()
    inputs, cu = automodel.inputs(batch), batch.cu_seqlens.tolist()
    video = torch.stack([_pixels(batch.patches[0, cu[f] : cu[f + 1]], spec.grids[f]) for f in range(3)])[None]
    patches, t, h, w = Qwen3VLVideoProcessor().patchify(video, patch_size=PATCH, merge_size=2, temporal_patch_size=2)
    assert inputs.grid_thw.tolist()[0] == [t, h, w] == [2, 4, 2]
    assert torch.equal(inputs.pixel_values[: t * h * w], patches[0])


# --- the outputs ---------------------------------------------------------------------------------------------


def test_every_deepstack_level_is_an_output_over_the_merged_token_rows():
    spec = _spec("video-and-images")
    model = automodel.build_model(Case(spec, 1, "automodel"), torch.float64, torch.device("cpu"))
    inputs = automodel.inputs(spec.tensors())
    out = automodel.encode(model, inputs)
    assert list(out) == [MAIN_OUTPUT, "deepstack0", "deepstack1"]
    tokens = int(inputs.grid_thw.prod(dim=1).sum()) // 4
    assert {name: tuple(t.shape) for name, t in out.items()} == {name: (tokens, 48) for name in out}
    assert not torch.allclose(out["deepstack0"], out["deepstack1"])  # two mergers on two layers, not one copy


@pytest.mark.parametrize("name", ["video-and-images", "mixed-sizes"])
def test_the_rows_each_media_item_gives_are_what_its_unsharded_encode_returns_for_it(name):
    """media_tokens (which lets the ranks share the exact run out without a plan) against the tower itself: each
    media item encoded alone: videos of odd frame counts (tubelets of 2), images of odd grids (padded to even, then
    2x2 merged)."""
    spec = _spec(name)
    model = automodel.build_model(Case(spec, 1, "automodel"), torch.float64, torch.device("cpu"))
    alone = [automodel.encode(model, automodel.inputs(item))[MAIN_OUTPUT].shape[0]
             for item in rounding.media_chunks(spec.tensors(), 1)]
    assert len(alone) == len(spec.media_frames) > 1
    assert automodel.media_tokens(spec) == automodel_shipped.media_tokens(spec) == tuple(alone)


def test_without_sharding_no_collective_runs_and_the_result_is_the_unsharded_one():
    """No process group exists in this process: a collective would raise."""
    spec = _spec("video-and-images")
    model = automodel.build_model(Case(spec, 1, "automodel"), torch.float64, torch.device("cpu"))
    inputs = automodel.inputs(spec.tensors())
    expected = automodel.encode(model, inputs)
    for config in (VisionDPConfig(1, strategy=SPLIT), VisionDPConfig(2, vision_dp_over_cp=False, strategy=SPLIT)):
        out = automodel.encode_sharded(model, inputs, config, None)
        assert all(torch.equal(out[name], expected[name]) for name in expected)


def test_a_split_that_is_not_automodels_is_refused_naming_it():
    spec = _spec("one-image")
    model = automodel.build_model(Case(spec, 1, "automodel"), torch.float64, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"automodel: split 'count' is not Automodel's; expected one of \('contiguous"):
        automodel.encode_sharded(model, automodel.inputs(spec.tensors()), VisionDPConfig(1), None)


# --- the shipped thresholds -----------------------------------------------------------------------------------


def _own_specs(impl):
    """The microbatches an implementation adds to the matrix (a spec, or a (spec, CP sizes) pair)."""
    return [item if isinstance(item, MicrobatchSpec) else item[0] for item in impl.scenarios()]


def _workload(spec):
    """(frame units, merged tokens) as the tower's own input counts them."""
    grid_thw = automodel.inputs(spec.tensors()).grid_thw
    return int(grid_thw[:, 0].sum()), int(grid_thw.prod(dim=1).sum()) // 4


def test_the_threshold_scenarios_sit_on_each_side_of_automodels_released_thresholds():
    from nemo_automodel.components.distributed.cp_vision_frame_shard import CpVisionFrameShardingConfig

    released = CpVisionFrameShardingConfig()
    workloads = {spec.name: _workload(spec) for spec in _own_specs(automodel_shipped)}
    name = automodel_shipped.name
    assert workloads == {
        f"{name}-tokens-{released.min_tokens - 1}": (len(token_grids(released.min_tokens - 1)), released.min_tokens - 1),
        f"{name}-tokens-{released.min_tokens}": (len(token_grids(released.min_tokens)), released.min_tokens),
        f"{name}-frames-{released.min_frames - 1}": (released.min_frames - 1, released.min_frames - 1),
        f"{name}-frames-{released.min_frames}": (released.min_frames, released.min_frames),
        f"{name}-ragged-above-thresholds": (released.min_frames + 1, 9 + released.min_frames),
    }
    assert all(units < released.min_frames for units, _ in list(workloads.values())[:2])
    assert automodel.scenarios() == ()  # thresholds 0: no decision to straddle


SHIPPED = {spec.name: spec for spec in _own_specs(automodel_shipped)}
# Each threshold: just below it, then at it; then the ragged units above them, balanced as declared.
EXPECTED = dict(zip(SHIPPED, ("replicated", "pass") * 2 + ("pass",)))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SHIPPED))
def test_the_shipped_thresholds_replicate_just_below_and_shard_at_them(name):
    """The oracle finds from each rank's input gradients what its tower read: all of it (replicated, as declared)
    or its own share, never an undeclared mix; and the results hold either way."""
    judged = run_judged(Case(SHIPPED[name], 2, "automodel-shipped", SPLIT))
    assert judged.verdict == EXPECTED[name], f"{judged.why}\n{judged.result.summary()}"


def _cuts(spec, cp, **policy):
    """Automodel's own partition of the microbatch's frame units over ``cp`` ranks, at the toy tower's width."""
    from nemo_automodel.components.distributed import cp_vision_frame_shard as sharding

    patches = torch.tensor([h * w for t, h, w in automodel.inputs(spec.tensors()).grid_thw.tolist() for _ in range(t)])
    config = sharding.CpVisionFrameShardingConfig(enabled=True, **policy)
    return sharding._contiguous_balanced_bounds(patches, cp, cost_alpha_source=tower_config(PATCH), config=config)


def test_as_shipped_only_the_ragged_microbatch_is_cut_differently_by_p_squared():
    """Why partition-cost-squared needs a microbatch of its own there: every other microbatch of automodel-shipped's
    matrix that shards has frame units all of one size, which any cost growing with a unit's patches cuts alike."""
    sharded = {}
    for case in scenarios.matrix(impls=(automodel_shipped.name,)):
        if case.config.shard_vision and case.cp > 1 and automodel_shipped.replicated(case.spec, case.config) is None:
            sharded.setdefault((case.spec.name, case.cp), case.spec)
    ragged = f"{automodel_shipped.name}-ragged-above-thresholds"
    assert {name for name, _ in sharded} == {ragged, *(f"{automodel_shipped.name}-{s}" for s in ("tokens-2048",
                                                                                                 "frames-32"))}
    for (name, cp), spec in sharded.items():
        differ = _cuts(spec, cp) != _cuts(spec, cp, cost_alpha=0)
        assert differ == (name == ragged), (name, cp, _cuts(spec, cp), _cuts(spec, cp, cost_alpha=0))


@pytest.mark.distributed
@pytest.mark.parametrize("cp", (2, 4))
def test_as_shipped_the_matrixs_microbatches_are_replicated(cp):
    spec = _spec("video-and-images")
    judged = run_judged(Case(spec, cp, "automodel-shipped", SPLIT))
    assert judged.verdict == "replicated", judged.result.summary()
    units, tokens = _workload(spec)
    assert f"{tokens} merged tokens < min_tokens=2048 and {units} frames < min_frames=32" in judged.why, judged.why


# --- the matrix ------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("case", params("automodel", table=TABLE))
def test_matrix(case):
    assert_case(case)
