"""`vdpcp balance` and `vdpcp bench memory|wire` on CPU: they run, write what they say, and reject bad input."""

import json

import pytest

from vdpcp.cli import main
from vdpcp.feature.balance import SPLIT_NAMES
from vdpcp.feature.datasets import generate


def test_balance_on_a_dataset_prints_every_rank_and_saves_the_chart(tmp_path, capsys):
    png = tmp_path / "load.png"
    assert main(["balance", "--dataset", "multi-image", "--cp", "4", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    for split in ("count", "balanced:patches", "balanced:attention"):
        assert f"| 4 | {split} | 3 |" in out
    assert png.stat().st_size > 10_000


def test_balance_on_a_folder_sweeps_its_specs(tmp_path, capsys):
    for seed in range(3):
        generate("video", seed).save(tmp_path / f"v{seed}.json")
    assert main(["balance", str(tmp_path), "--cp", "2", "--png", str(tmp_path / "sweep.png")]) == 0
    out = capsys.readouterr().out
    assert "3 microbatch(es)" in out and "unordered LPT (reference)" in out
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["balance"], "either a spec file or folder, or --dataset"),
        (["balance", "x.json", "--dataset", "video"], "either a spec file or folder, or --dataset"),
        (["balance", "--dataset", "mantis"], "dataset must be one of"),
        (["balance", "--dataset", "video", "--cp", "0"], "argument --cp: expected an integer >= 1, got '0'"),
        (["balance", "missing.json"], "cannot read spec file"),
    ],
)
def test_balance_bad_input_exits_2_with_one_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_balance_on_an_empty_folder_exits_2(tmp_path, capsys):
    assert main(["balance", str(tmp_path)]) == 2
    assert "holds no spec files" in capsys.readouterr().err


def test_bench_wire_prints_both_gathers(capsys):
    assert main(["bench", "wire", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "| mcore |" in out and "| reference |" in out


def test_bench_memory_on_cpu_says_so_and_measures_every_shard(tmp_path, capsys):
    argv = ["bench", "memory", "--device", "cpu", "--seeds", "1", "--samples", "2",
            "--cp", "2", "--cp", "3", "--layers", "1", "--reps", "1"]
    assert main(argv + ["--out", str(tmp_path)]) == 0
    assert "CPU (small size: not the GPU's figures)" in capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 1 + len(SPLIT_NAMES) * (2 + 3)  # unsharded, then every rank of every split at CP 2 and 3
    # Activations divide over ranks: with no placeholders the shards' saved tensors add up to the unsharded ones.
    unsharded = next(r["saved_bytes"] for r in rows if r["split"] == "unsharded")
    for cp in (2, 3):
        for split in ("count", "balanced:patches", "balanced:attention"):
            shards = [r for r in rows if r["cp"] == cp and r["split"] == split]
            assert sum(r["saved_bytes"] for r in shards) == unsharded
    assert (tmp_path / "tables.md").read_text().count("| 3 |") >= 3


def test_bench_memory_rejects_bad_sizes(capsys):
    assert main(["bench", "memory", "--device", "cpu", "--seeds", "0"]) == 2
    assert "argument --seeds: expected an integer >= 1, got '0'" in capsys.readouterr().err
