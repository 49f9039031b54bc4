"""Megatron-Bridge's released Qwen3-VL vision DP over CP (vdpcp.impls.bridge_qwen3_vl) held to vdpcp's oracle: the
functions run are the released package's own files, two releases never mix in one process, Bridge's own
``forward`` runs around transformers' tower and a language probe, and its matrix at CP 1, 2, 4 and 8; and the
released 0.5.0, a regression fixture: vdpcp must keep reporting its two shipped bugs."""

import importlib
import inspect
import sys
from importlib.metadata import version
from pathlib import Path
from types import ModuleType

import pytest
import torch

from vdpcp.contract.protocol import MAIN_OUTPUT, VisionDPConfig
from vdpcp.impls import bridge_release, resolve
from vdpcp.impls.automodel import automodel
from vdpcp.impls.bridge_qwen3_vl import (
    IMAGE,
    MODEL,
    UTILS,
    VIDEO,
    VISION_END,
    VISION_START,
    bridge_qwen3_vl,
    bridge_qwen3_vl_0_5_0,
    forward_arguments,
)
from vdpcp.matrix import scenarios
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged
from vdpcp.testing import assert_case, params

ROOT = Path(__file__).resolve().parents[2]
OLD = "0.5.0"
TABLE = [s for s in scenarios.scenarios(fixtures=None)
         if s.spec.name in ("one-image", "three-images", "video-and-images")]
# What vdpcp runs of a release: its forward and the vision section's own functions.
RUN = {MODEL: ("Qwen3VLModel.forward", "get_rope_index", "split_data_cp_rank", "split_deepstack_embs"),
       UTILS: ("reorganize_inputs", "qwen3vl_cp_split", "get_vision_cp_data", "collapse_thw",
               "AllGatherVisionEmbeddings.forward", "AllGatherVisionEmbeddings.backward")}


def _spec(name):
    return next(s.spec for s in TABLE if s.spec.name == name)


def _file(module, dotted) -> Path:
    """The file a function of ``module`` was compiled from (under its decorators: qwen3vl_cp_split's no_grad)."""
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return Path(inspect.unwrap(obj).__code__.co_filename).resolve()


def _pin(lines, package):
    return next(line.split("==")[1].strip() for line in lines if line.strip().startswith(f"{package}=="))


# --- the release's own files ------------------------------------------------------------------------------------


def test_the_functions_run_are_the_installed_packages_files():
    release = bridge_release.load()
    installed = Path(importlib.metadata.distribution("megatron-bridge").locate_file("")).resolve()
    assert release.version == version("megatron-bridge") == _pin((ROOT / "requirements" / "no-deps.txt").read_text()
                                                                 .splitlines(), "megatron-bridge")
    for module, names in RUN.items():
        for name in names:
            path = _file(release[module], name)
            assert path.is_relative_to(installed / "megatron" / "bridge"), (name, path)
    model = bridge_qwen3_vl.build_model(Case(_spec("one-image"), 1, "bridge-qwen3-vl"), torch.float64,
                                        torch.device("cpu"))
    assert type(model).forward is release[MODEL].Qwen3VLModel.forward


def test_the_old_release_is_its_own_files_and_the_two_never_mix():
    """Both loaded in one process: each one's functions from its own folder, its forward's globals its own
    functions, and sys.modules as it was (a release's modules are held, never registered by name)."""
    before = {name for name in sys.modules if name.startswith("megatron.bridge")}
    new, old = bridge_release.load(), bridge_release.load(OLD)
    assert old.version == OLD == _pin((ROOT / "requirements" / "releases.txt").read_text().splitlines(),
                                      "megatron-bridge")
    assert old.root == (Path(sys.prefix) / "releases" / f"megatron-bridge-{OLD}").resolve() != new.root
    for module, names in RUN.items():
        for name in names:
            path = _file(old[module], name)
            assert path.is_relative_to(old.root / "megatron" / "bridge"), (name, path)
    for release in (new, old):
        forward_globals = release[MODEL].Qwen3VLModel.forward.__globals__
        assert forward_globals["qwen3vl_cp_split"] is release[UTILS].qwen3vl_cp_split
        assert forward_globals["AllGatherVisionEmbeddings"] is release[UTILS].AllGatherVisionEmbeddings
    assert old[UTILS].AllGatherVisionEmbeddings is not new[UTILS].AllGatherVisionEmbeddings
    assert {name for name in sys.modules if name.startswith("megatron.bridge")} == before


def test_a_stale_module_registered_under_a_releases_name_is_not_what_the_release_loads(monkeypatch):
    """Whatever sys.modules holds under megatron.bridge when a release loads (another release's module, a stub a
    test left) is set aside for the load, so the release's own files are imported, then put back as it was."""
    stale = {name: ModuleType(name) for name in ("megatron.bridge", UTILS)}
    stale["megatron.bridge"].__path__ = []
    for name, module in stale.items():
        monkeypatch.setitem(sys.modules, name, module)
    release = bridge_release._load.__wrapped__(None, (UTILS,))  # a fresh load, not the process's cached one
    installed = Path(importlib.metadata.distribution("megatron-bridge").locate_file("")).resolve()
    assert all(release.modules[name] is not module for name, module in stale.items())
    assert Path(release[UTILS].__file__).resolve().is_relative_to(installed / "megatron" / "bridge")
    assert release[UTILS].qwen3vl_cp_split.__module__ == UTILS
    assert all(sys.modules[name] is module for name, module in stale.items())


def test_an_import_by_name_while_a_release_runs_is_refused():
    """The releases import megatron.bridge inside one function only (a config field given as a string, which vdpcp
    never gives); run inside a release, such an import raises instead of taking another release's module."""
    for release in (bridge_release.load(), bridge_release.load(OLD)):
        assert set(bridge_release.lazy_imports(release).values()) == {"_resolve_string_fields"}
        with release.running(), pytest.raises(bridge_release.ReleaseError, match="imported megatron.bridge"):
            importlib.import_module("megatron.bridge.utils.activation_map")


def test_an_old_release_that_is_not_installed_is_named():
    with pytest.raises(bridge_release.ReleaseError, match=r"megatron-bridge 0\.0\.1 is not installed at .*releases"):
        bridge_release.distribution("0.0.1")


def test_bridges_own_vision_model_cannot_be_built_without_transformer_engine():
    """Why transformers' tower stands in for Bridge's: Bridge's __init__ builds its MCore vision model from
    Transformer Engine's layer spec, which this machine cannot install."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    from vdpcp.impls.automodel import tower_config
    from vdpcp.impls.bridge_qwen3_vl import ONE_RANK, bridge_config

    assert importlib.util.find_spec("transformer_engine") is None
    release, vision = bridge_release.load(), tower_config(4)
    model = release[MODEL]
    config = model.get_vision_model_config(vision, megatron_config=bridge_config(release, vision, torch.float32))
    merger = model.PatchMergerSubmodules(patch_norm=model.TENorm, linear_fc1=model.TEColumnParallelLinear,
                                         linear_fc2=model.TERowParallelLinear)
    groups = ProcessGroupCollection(cp=ONE_RANK, tp=ONE_RANK, pp=ONE_RANK, tp_cp=ONE_RANK, dp=ONE_RANK, embd=None)
    with pytest.raises(Exception, match="when instantiating"):
        model.Qwen3VLVisionModel(config, get_vit_layer_with_transformer_engine_spec(), merger, pre_process=True,
                                 post_process=True, pg_collection=groups)


# --- Bridge's forward around transformers' tower -----------------------------------------------------------------


def test_bridges_forward_at_cp_1_gives_the_towers_features_and_deepstack_levels():
    """Images and videos interleaved: Bridge finds them by their token ids, encodes them whole and merges them; the
    probe's vision rows are the tower's own outputs, in media order, every DeepStack level too."""
    spec = _spec("video-and-images")
    model = bridge_qwen3_vl.build_model(Case(spec, 1, "bridge-qwen3-vl"), torch.float64, torch.device("cpu"))
    batch = spec.tensors()
    out = bridge_qwen3_vl.encode(model, bridge_qwen3_vl.inputs(batch))
    tower = automodel.encode(model.vision_model.tower, automodel.inputs(batch))
    assert list(out) == [MAIN_OUTPUT, "deepstack0", "deepstack1"] == list(tower)
    assert all(torch.equal(out[name], tower[name]) for name in tower)
    assert all(t.requires_grad for t in out.values())


def test_the_token_ids_hold_every_image_and_temporal_patch_and_split_into_2_cp_chunks():
    spec = _spec("video-and-images")
    inputs = bridge_qwen3_vl.inputs(spec.tensors())
    grids = inputs.tower.grid_thw
    units, tokens = int(grids[:, 0].sum()), int(grids.prod(dim=1).sum()) // 4  # an image is one unit, a video one a
    for cp in range(1, 9):                                                      # temporal patch; 2x2 patches a token
        ids = forward_arguments(inputs, cp)["input_ids"][0]
        assert ids.numel() % (2 * cp) == 0
        assert int((ids == VISION_START).sum()) == int((ids == VISION_END).sum()) == units
        assert int((ids == IMAGE).sum() + (ids == VIDEO).sum()) == tokens


def test_without_sharding_no_collective_runs_and_the_result_is_the_unsharded_one():
    """No process group exists in this process: a collective would raise."""
    spec = _spec("video-and-images")
    model = bridge_qwen3_vl.build_model(Case(spec, 1, "bridge-qwen3-vl"), torch.float64, torch.device("cpu"))
    inputs = bridge_qwen3_vl.inputs(spec.tensors())
    expected = bridge_qwen3_vl.encode(model, inputs)
    for config in (VisionDPConfig(1), VisionDPConfig(2, vision_dp_over_cp=False)):
        out = bridge_qwen3_vl.encode_sharded(model, inputs, config, None)
        assert all(torch.equal(out[name], expected[name]) for name in expected)


def test_the_plan_is_bridges_split_by_count_the_remainder_on_the_first_ranks_videos_by_temporal_patch():
    three = _spec("three-images")
    assert bridge_qwen3_vl.plan(three, VisionDPConfig(2)).owner == (0, 0, 1)
    assert bridge_qwen3_vl.plan(three, VisionDPConfig(4)).owner == (0, 1, 2)  # rank 3: no image, no placeholder
    assert bridge_qwen3_vl.plan(three, VisionDPConfig(4)).placeholders == (0,) * 4
    video = _spec("video-and-images")  # an image, a video of 4 frames (2 temporal patches), ...
    plan = bridge_qwen3_vl.plan(video, VisionDPConfig(8))
    first = video.media_rows[1]
    assert plan.owner[first : first + 4] == (1, 1, 2, 2)  # the video's temporal patches on two ranks
    assert bridge_qwen3_vl.plan(video, VisionDPConfig(2, vision_dp_over_cp=False)) is None


def test_both_releases_are_registered_by_their_names():
    assert resolve("bridge-qwen3-vl") is bridge_qwen3_vl and resolve("bridge-qwen3-vl-0.5.0") is bridge_qwen3_vl_0_5_0
    assert bridge_qwen3_vl.version is None and bridge_qwen3_vl_0_5_0.version == OLD


# --- the matrix ---------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("case", params("bridge-qwen3-vl", table=TABLE))
def test_matrix(case):
    assert_case(case)


# --- the released 0.5.0: its shipped bugs, reported -------------------------------------------------------------


@pytest.mark.distributed
def test_050s_gather_backward_keeps_the_local_slice_parameter_gradients_fail_outputs_exact():
    """Its AllGatherVisionEmbeddings.backward returns this rank's slice of its own gradient, not summed over the CP
    group: each rank's tower misses the gradient the other ranks' language model shards give its images."""
    judged = run_judged(Case(_spec("three-images"), 2, "bridge-qwen3-vl-0.5.0"))
    failures = judged.result.failures
    assert judged.verdict == "fail", judged.result.summary()
    assert any("param grads" in f for f in failures), failures
    assert not any(": outputs" in f for f in failures), failures  # the forward is right


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_050s_rank_with_no_image_makes_bfloat16_embeddings(dtype):
    """Its rank with no image makes its empty embeddings in a hard-coded bfloat16: in float32 and float64 the
    ranks' gathers disagree in bytes (on NCCL the result is undefined), and the error says the rows agree and which
    dtype each rank sent. One image at CP 2: rank 1 has none."""
    judged = run_judged(Case(_spec("one-image"), 2, "bridge-qwen3-vl-0.5.0", dtype=dtype))
    assert judged.verdict == "error", judged.result.summary()
    assert "all_gather on gloo" in judged.result.error and "disagree on sizes" in judged.result.error, \
        judged.result.error
    tokens = int(bridge_qwen3_vl.inputs(_spec("one-image").tensors()).tower.grid_thw.prod(dim=1).sum()) // 4  # 2x2
    said = f"their rows agree ({tokens}), their dtypes differ (torch.{dtype} sent, "
    assert f"{said}torch.bfloat16 expected); each rank sent group rank 0 torch.{dtype}, group rank 1 torch.bfloat16" \
        in judged.result.error, judged.result.error
