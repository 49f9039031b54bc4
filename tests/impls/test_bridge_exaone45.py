"""Megatron-Bridge's released EXAONE 4.5 vision DP over CP (vdpcp.impls.bridge_exaone45), a regression fixture: the
functions run are the installed package's own files, Bridge's forward around transformers' tower gives the tower's
features at CP 1 and shards by Bridge's own split; at CP > 1 with an image the release's call into its gather
raises, which vdpcp reports as an error on every rank (docs/known-limits.md); and the installed package's vision-DP-over-CP
paths are the ones vdpcp holds."""

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from vdpcp.contract.protocol import MAIN_OUTPUT, VisionDPConfig
from vdpcp.impls import FIXTURES, SHIPPED, bridge_qwen3_vl, bridge_release, resolve
from vdpcp.impls.bridge_exaone45 import MODEL, UTILS, bridge_exaone45, tower_config
from vdpcp.matrix import scenarios
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged

TABLE = [s for s in scenarios.scenarios(fixtures=None) if s.spec.name in ("one-image", "three-images", "video-and-images")]
MISSING_GROUP = "AllGatherVisionEmbeddings.forward() missing 1 required positional argument: 'cp_group'"


def _spec(name):
    return next(s.spec for s in TABLE if s.spec.name == name)


def _installed() -> Path:
    return Path(importlib.metadata.distribution("megatron-bridge").locate_file("")).resolve() / "megatron" / "bridge"


def test_the_forward_and_the_vision_sections_functions_are_the_installed_packages_files():
    release = bridge_exaone45.release()
    for module, names in {MODEL: ("Exaone45Model.forward",),
                          UTILS: ("reorganize_inputs", "Exaone45_cp_split", "get_vision_cp_data", "collapse_thw",
                                  "split_data_cp_rank", "AllGatherVisionEmbeddings.forward",
                                  "AllGatherVisionEmbeddings.backward")}.items():
        for name in names:
            obj = release[module]
            for part in name.split("."):
                obj = getattr(obj, part)
            assert Path(inspect.unwrap(obj).__code__.co_filename).resolve().is_relative_to(_installed()), name
    model = bridge_exaone45.build_model(Case(_spec("one-image"), 1, "bridge-exaone45"), torch.float64,
                                        torch.device("cpu"))
    assert type(model).forward is release[MODEL].Exaone45Model.forward
    assert type(model).forward.__globals__["AllGatherVisionEmbeddings"] is release[UTILS].AllGatherVisionEmbeddings


def test_it_is_registered_as_a_regression_fixture():
    assert resolve("bridge-exaone45") is bridge_exaone45 and "bridge-exaone45" in FIXTURES


def test_the_real_size_is_the_tower_bridges_provider_builds():
    """Bridge's EXAONE 4.5 provider builds its tower from Exaone4_5_VisionConfig's defaults (read in its file: the
    provider module imports what this environment lacks, omegaconf)."""
    from transformers.models.exaone4_5.configuration_exaone4_5 import Exaone4_5_VisionConfig

    provider = (_installed() / "models" / "exaone" / "exaone45" / "exaone45_provider.py").read_text()
    assert "vision_config: Exaone4_5_VisionConfig = field(default_factory=lambda: Exaone4_5_VisionConfig())" in provider
    assert tower_config(14, "real").to_dict() == Exaone4_5_VisionConfig().to_dict()


def test_bridges_forward_at_cp_1_gives_the_towers_features_issuing_no_collective():
    """No process group exists in this process: a collective would raise. Images and videos interleaved."""
    spec = _spec("video-and-images")
    model = bridge_exaone45.build_model(Case(spec, 1, "bridge-exaone45"), torch.float64, torch.device("cpu"))
    inputs = bridge_exaone45.inputs(spec.tensors())
    out = bridge_exaone45.encode(model, inputs)
    tower = model.vision_model.tower(inputs.tower.pixel_values, grid_thw=inputs.tower.grid_thw).pooler_output
    assert list(out) == [MAIN_OUTPUT] and torch.equal(out[MAIN_OUTPUT], tower) and out[MAIN_OUTPUT].requires_grad
    assert torch.equal(bridge_exaone45.encode_sharded(model, inputs, VisionDPConfig(1), None)[MAIN_OUTPUT], tower)


def test_the_plan_is_bridges_split_by_count_the_remainder_on_the_first_ranks_opt_out_or_not():
    """EXAONE has no switch: its forward shards at every configured CP above 1, the opt-out included."""
    three = _spec("three-images")
    assert bridge_exaone45.plan(three, VisionDPConfig(2)).owner == (0, 0, 1)
    assert bridge_exaone45.plan(three, VisionDPConfig(2, vision_dp_over_cp=False)).owner == (0, 0, 1)
    assert bridge_exaone45.plan(three, VisionDPConfig(4)).owner == (0, 1, 2)
    assert bridge_exaone45.plan(three, VisionDPConfig(1)) is None
    video = _spec("video-and-images")  # an image, a video of 4 frames (2 temporal patches), ...
    first = video.media_rows[1]
    assert bridge_exaone45.plan(video, VisionDPConfig(8)).owner[first : first + 4] == (1, 1, 2, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [s.spec.name for s in TABLE])
def test_at_cp_2_every_case_with_an_image_errors_on_every_rank_with_the_gathers_missing_group(name):
    """0.6.2 calls AllGatherVisionEmbeddings.apply(vision_embeds, seqlen_on_cp_ranks) where the gather's forward
    takes the CP group as a third argument: every rank raises before any collective, so none hangs."""
    for config in ({}, {"vision_dp_over_cp": False}):
        judged = run_judged(Case(_spec(name), 2, "bridge-exaone45", **config), backend="gloo")
        assert judged.verdict == "error", judged.result.summary()
        assert judged.result.error.count(f"raised TypeError: {MISSING_GROUP}") >= 2, judged.result.error


# --- every vision-DP-over-CP path of the installed package ---------------------------------------------------------


def _calls(path: Path, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\s*\(", path.read_text()) is not None


def test_every_model_of_the_installed_package_that_gathers_vision_embeddings_over_cp_is_held():
    """A model shards its images over CP where its forward deals them out (get_vision_cp_data) and gathers them back
    (AllGatherVisionEmbeddings.apply); each such file of the installed package is the forward a shipped subject
    runs. A release that adds another fails here until vdpcp holds it."""
    models = _installed() / "models"
    found = {p.relative_to(models).as_posix() for p in models.rglob("*.py")
             if _calls(p, "get_vision_cp_data") and _calls(p, "AllGatherVisionEmbeddings.apply")}
    held = {"qwen_vl/modelling_qwen3_vl/model.py": bridge_qwen3_vl.MODEL, "exaone/exaone45/modelling_exaone45/model.py": MODEL}
    assert found == set(held)
    releases = [resolve(name).release() for name, target in SHIPPED.items() if target.startswith("vdpcp.impls.bridge_")]
    for path, module in held.items():  # the installed release's module, run by a shipped subject
        assert any(r.root == _installed().parents[1] and module in r.modules for r in releases), path


def test_the_dist_train_vision_split_is_not_vision_dp_over_cp():
    """Qwen3-VL's get_dist_train_vision_dp_data splits the vision batch over the vision module's DP ranks of a
    disaggregated layout (its own ranks, its output sent to the language model's), and Qwen3VLModel refuses CP for
    the encoder there: no image is sharded over the language model's CP ranks, so no subject holds it."""
    release = bridge_release.load()
    source = inspect.getsource(release[bridge_qwen3_vl.MODEL].Qwen3VLModel.__init__)
    assert 'dist train does not support context parallelism for encoder' in source
    assert "self.pg_collection.cp.size() == 1" in source
    split = inspect.signature(release[bridge_qwen3_vl.UTILS].get_dist_train_vision_dp_data)
    assert list(split.parameters) == ["vision_data", "vision_grid_thw", "num_chunks", "dp_rank"]
