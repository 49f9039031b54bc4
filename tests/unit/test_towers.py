"""The tower-size axis: every shipped subject at its toy size (CPU CI) and at the published size of the tower it
stands for (``--tower real``, for GPUs), with microbatches that mean something there; refused up front on a CPU."""

import pytest

from vdpcp.cli import main
from vdpcp.cli.mutants import kill_set
from vdpcp.harness.pool import WorkerPool
from vdpcp.impls import BUILT_INS, SHIPPED, resolve
from vdpcp.matrix import scenarios
from vdpcp.tools.mutants import MUTANTS

# The published vision towers each subject stands for (their config.json's vision_config).
PUBLISHED = {
    "qwen2_5_vl": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
    "automodel": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                      patch_size=16, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
}


@pytest.fixture
def no_rank_starts(monkeypatch):
    def start(*args, **kwargs):
        raise AssertionError("a rank started for a case that should have been refused up front")

    monkeypatch.setattr(WorkerPool, "run", start)


@pytest.mark.parametrize("impl", sorted(SHIPPED))
def test_every_shipped_subject_comes_in_the_toy_and_the_real_size(impl):
    assert {"toy", "real"} <= set(resolve(impl).towers)


@pytest.mark.parametrize("impl", sorted(PUBLISHED))
def test_the_real_size_is_the_published_towers(impl):
    from importlib import import_module

    module = import_module(f"vdpcp.impls.{impl}")
    config = module.tower_config(module.REAL_PATCH, "real")
    assert {key: getattr(config, key) for key in PUBLISHED[impl]} == PUBLISHED[impl]


def test_the_references_real_size_is_vit_l_16():
    from vdpcp.feature.model import REAL_PATCH, TOWERS

    assert REAL_PATCH == 16 and {k: TOWERS["real"][k] for k in ("hidden", "heads", "layers")} == dict(hidden=1024, heads=16,
                                                                                                     layers=24)


def test_the_real_microbatches_are_real_sizes_multi_image_odd_grids_and_a_video():
    specs = [s.spec for s in scenarios.REAL_SCENARIOS]
    sides = [side for spec in specs for image in spec.images for side in image]
    assert min(sides) >= 224 and max(sides) == 1344 and all(spec.patch_dim == 14 for spec in specs)
    assert any(len(spec.images) >= 4 for spec in specs)
    assert any(spec.temporal_patch_size == 2 and max(spec.media_frames) > 1 for spec in specs)
    assert any(gh % 2 for spec in specs for gh, _ in spec.grids)


@pytest.mark.parametrize("impl, patch", [("reference", 16), ("qwen2_5_vl", 14), ("automodel", 16)])
def test_each_tower_gets_the_real_microbatches_at_its_own_patch_grids_kept(impl, patch):
    cases = scenarios.matrix(cps=(2,), impls=(impl,), tower="real")
    assert cases and all(c.tower == "real" and c.id.endswith("-tower-real") for c in cases)
    three = next(c for c in cases if c.spec.name == "three-images")
    assert three.spec.patch_dim == patch and three.spec.grids == ((32, 32), (16, 24), (48, 32))


@pytest.mark.parametrize("name", [n for n, m in MUTANTS.items() if not m.generic])
def test_every_named_mutant_has_a_kill_set_at_the_real_size(name):
    matrix = scenarios.matrix(impls=BUILT_INS, tower="real")
    assert kill_set(MUTANTS[name].kills, matrix, "reference", "real")


def test_a_real_size_case_on_the_cpu_is_refused_up_front_naming_what_overrides_it(capsys, no_rank_starts, on_the_cpu):
    assert main(["check", "--tower", "real", "--cp", "2", "-k", "one-image-cp2-reference", "--backend", "gloo"]) == 2
    (memory,) = capsys.readouterr().err.strip().splitlines()
    assert "with the real-size tower" in memory and "--max-spec-bytes" in memory, memory
    assert main(["check", "--tower", "real", "--cp", "2", "-k", "one-image-cp2-reference", "--backend", "gloo",
                 "--max-spec-bytes", "1T"]) == 2
    (slow,) = capsys.readouterr().err.strip().splitlines()
    assert "too slow for this machine" in slow and "--max-case-tflop" in slow and "VDPCP_DEVICE=cuda" in slow, slow


def test_a_size_an_implementation_does_not_come_in_is_one_usage_error(capsys):
    assert main(["check", "--tower", "72b", "--impl", "qwen2_5_vl", "--list"]) == 2
    assert capsys.readouterr().err.strip() == "vdpcp check: --tower 72b: qwen2_5_vl comes in real, toy"


def test_automodel_shipped_shards_one_real_microbatch_at_its_released_thresholds():
    """Its released thresholds (2048 merged tokens, 32 frames) replicate every other real-size row, so without this
    one the size people train never ran its sharded path (on the H200 every automodel-shipped case was replicated)."""
    shipped = resolve("automodel-shipped")
    sharded = {c.spec.name for c in scenarios.matrix(cps=(2, 4), impls=("automodel-shipped",), tower="real")
               if c.config.shard_vision and shipped.replicated(c.spec, c.config) is None}
    assert sharded == {"multi-image-32"}
