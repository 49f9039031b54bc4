"""Which rows reached each rank's tower is seen at the tower's inputs (vdpcp.oracle.observe.reads), through ops between the pixels and
the tower that keep tensors for backward, whose graph must stay whole for the loss's backward after; and a microbatch
with no rows is not a replicated run, so a rank that skips its tower on one (placeholders only, on every rank) still
fails the execution check, and with sharding off it breaks no policy."""

from dataclasses import replace

import pytest
import torch

from vdpcp.impls.reference import Reference
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_case
from vdpcp.matrix.scenarios import EMPTY, SCENARIOS, matrix

SPEC = next(s.spec for s in SCENARIOS if s.spec.name == "three-images")


class KeepsTensorsBeforeItsTower(Reference):
    """The reference, with its patches multiplied by ones before the tower: an op that saves a tensor for backward
    between the patches and the tower's first layer."""

    name = "keeps-tensors-before-its-tower"

    def encode_sharded(self, model, batch, config, group):
        scaled = replace(batch, patches=batch.patches * torch.ones_like(batch.patches))
        return super().encode_sharded(model, scaled, config, group)


keeps_tensors = KeepsTensorsBeforeItsTower()


@pytest.mark.distributed
def test_reading_what_ran_leaves_the_graph_for_the_loss():
    result = run_case(Case(SPEC, 2, "tests.oracle.test_read_table:keeps_tensors"), backend="gloo")
    assert result.verdict == "pass", result.summary()


@pytest.mark.distributed
def test_ranks_that_skip_their_tower_on_an_empty_microbatch_fail():
    empty = next(c for c in matrix(impls=("reference",), cps=(2,)) if c.id == "empty-cp2-reference-count")
    result = run_case(empty.with_(mutant="placeholder-rank-skips-tower"), backend="gloo")
    assert result.verdict == "fail", result.summary()
    assert any("read no row and ran no layer of its tower (its plan gives it no row and 1 placeholder" in f
               for f in result.failures), result.summary()


@pytest.mark.distributed
def test_an_empty_microbatch_with_sharding_off_passes_with_no_policy_to_break():
    result = run_case(Case(EMPTY, 2, vision_dp_over_cp=False), backend="gloo")
    assert result.verdict == "pass" and not any(r.plan_mismatch for r in result.ranks), result.summary()
