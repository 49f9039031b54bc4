"""Pixels are data: an implementation is handed pixels that need no gradient unless it declares ``pixel_grads``, and
which rows each rank's tower read is seen at the tower's inputs (vdpcp.oracle.observe.reads), not through pixel gradients.

A split that runs under no_grad and asserts its pixels need none (Megatron-Bridge's released one) passes, with
fewer images than ranks and with videos; so does one that detaches its pixels. A declared subject's pixel-gradient
bug still fails; the same bug undeclared is no bug (its pixels need no gradient). A rank that also runs the whole
microbatch through its tower under no_grad read every row: not sharded. What the graph check says is what it saw."""

import pytest
import torch

from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.runner import run_judged
from vdpcp.matrix.scenarios import SCENARIOS, matrix
from vdpcp.oracle import arms
from vdpcp.oracle.context import Arm

SPECS = {s.spec.name: s.spec for s in SCENARIOS}
SUBJECTS = "tests.oracle.subjects"


def _judged(spec: str, cp: int, subject: str):
    return run_judged(Case(SPECS[spec], cp, f"{SUBJECTS}:{subject}"), backend="gloo")


@pytest.mark.distributed
@pytest.mark.parametrize("spec, cp", [("three-images", 2), ("three-images", 4), ("video-and-images", 4)])
def test_a_split_under_no_grad_that_asserts_its_pixels_need_none_passes(spec, cp):
    judged = _judged(spec, cp, "pixels_as_data")
    result = judged.result
    assert judged.verdict == "pass", result.summary()
    assert all(r.input_grads.startswith("pixels are data") for r in result.ranks), result.summary()
    assert sorted(row for r in result.ranks for row in r.read) == list(range(len(SPECS[spec].images)))


@pytest.mark.distributed
def test_a_split_that_detaches_its_pixels_passes_its_rows_found_by_their_bytes():
    judged = _judged("video-and-images", 2, "detaches_its_pixels")
    result = judged.result
    assert judged.verdict == "pass", result.summary()
    assert "input gradients not compared: no CP rank's sharded pixels got a gradient" in result.summary()


@pytest.mark.distributed
def test_a_declared_pixel_gradient_bug_fails_and_the_same_bug_undeclared_is_none():
    declared = _judged("three-images", 2, "pixel_grad_off")
    assert declared.verdict == "fail", declared.result.summary()
    assert any("input grads (summed over ranks)" in f for f in declared.result.failures), declared.result.summary()
    undeclared = _judged("three-images", 2, "pixel_grad_off_undeclared")
    assert undeclared.verdict == "pass", undeclared.result.summary()
    assert all(r.input_grad_err != r.input_grad_err for r in undeclared.result.ranks)  # NaN: not compared


@pytest.mark.distributed
@pytest.mark.parametrize("impl, spec, cp", [("reference", "three-images", 2), ("mcore", "eight-equal", 4),
                                            ("qwen2_5_vl", "three-images", 2), ("automodel", "video-and-images", 2)])
def test_encoding_the_whole_microbatch_under_no_grad_beside_its_share_reads_every_row(impl, spec, cp):
    case = next(c for c in matrix(impls=(impl,), cps=(cp,)) if c.id.startswith(f"{spec}-cp{cp}-{impl}-") and c.grads
                and c.loss == "rank" and c.dp == c.tp == 1 and c.vision_dp_over_cp)
    judged = run_judged(case.with_(mutant="whole-microbatch-encoded-without-grad"), backend="gloo")
    assert judged.verdict == "not-sharded", judged.result.summary()
    assert any("every CP rank's tower read all" in f for f in judged.result.failures), judged.result.summary()


def _graphless(out: dict, read: list[int]) -> list[str]:
    result = RankResult(rank=1, cp_rank=1)
    result.read = read
    at = Arm(rank=result.rank, cp_rank=result.cp_rank, telemetry=result.telemetry)
    result.add(arms._graphless(at, out, {name: True for name in out}, None)[1])
    return result.failures


def test_an_output_with_rows_and_no_graph_is_said_as_seen():
    (said,) = _graphless({"features": torch.zeros(6, 2)}, [])
    assert said == ("outputs 'features' on rank 1 (CP rank 1) hold 6 rows and require no grad, where the unsharded "
                    "ones carry an autograd graph (its tower read no row): no gradient flows back through them"), said


def test_an_empty_output_with_no_graph_is_no_failure():
    assert _graphless({"features": torch.zeros(0, 2)}, []) == []
