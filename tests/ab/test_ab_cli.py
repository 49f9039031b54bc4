"""`vdpcp ab` as a user runs it, on gloo ranks: the reference passes at float64 and writes its JSON and PNG, a
gradient bug in the sharded arm fails it (exit 1), bad input is one line and exit 2, and the GPU entry
(`python -m vdpcp.tools.ab`) runs where megatron-core is missing."""

import json
import os
import subprocess
import sys

import pytest

from vdpcp.cli import main

pytestmark = pytest.mark.distributed


def test_the_reference_passes_and_the_json_has_both_arms_losses_per_step(tmp_path, capsys, on_the_cpu):
    code = main(["ab", "--cp", "2", "--steps", "5", "--backend", "gloo",
                 "--json", str(tmp_path / "ab.json"), "--png", str(tmp_path / "ab.png")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: pass" in out and "not measured (cpu: they are GPU figures)" in out and "ran on gloo/cpu" in out
    record = json.loads((tmp_path / "ab.json").read_text())
    assert record["kind"] == "ab" and record["verdict"] == "pass" and record["tolerance"] == 1e-10
    steps = record["results"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert all(abs(s["loss_on"] - s["loss_off"]) <= 1e-10 * s["loss_off"] for s in steps)
    assert {"placeholders", "remainder"} <= {m["kind"] for s in steps for m in s["microbatches"]}
    assert (tmp_path / "ab.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("mutant", ["grad-not-summed", "grad-averaged"])
def test_a_gradient_mutant_in_the_sharded_arm_fails_the_ab(mutant, capsys):
    code = main(["ab", "--cp", "2", "--steps", "2", "--backend", "gloo", "--mutant", mutant])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "verdict: fail" in out and "step 1: vision grad norm" in out


@pytest.mark.parametrize("argv, message", [
    (["--cp", "0"], "argument --cp: expected an integer >= 2, got '0'"),
    (["--cp", "1"], "argument --cp: expected an integer >= 2, got '1' (vision_dp_over_cp is a no-op at CP=1"),
    (["--dataset", "imagenet"], "--dataset imagenet: unknown dataset; expected one of doc-qa, multi-image, video"),
    (["--impl", "no-such-impl"], "--impl no-such-impl: not a registered implementation"),
    (["--impl", "no_such_module:impl"], "--impl no_such_module:impl: cannot import module"),
    (["--mutant", "no-such-mutant"], "--mutant no-such-mutant: unknown mutant"),
    (["--accumulate", "0"], "argument --accumulate: expected an integer >= 1, got '0'"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    code = main(["ab", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_gpu_entry_runs_where_megatron_is_missing(tmp_path):
    blocker = tmp_path / "megatron"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise RuntimeError('vdpcp ab imported megatron')\n")  # not ImportError: no fallback hides it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "vdpcp.tools.ab", "--cp", "2", "--steps", "1", "--accumulate", "1",
                           "--backend", "gloo"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
