"""Execution means rows: a sharded rank whose tower's layers were only ever called on zero rows did not run its
tower, however many calls it made, and fails naming that rank; calls on zero rows beside real ones change
nothing. Behaviour only, through run_judged (the oracle's way of counting is its own business).

The case: one image at CP=2, so CP rank 1 holds only a placeholder.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vdpcp.feature import sharded
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls.reference import Reference
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged

ONE_IMAGE = MicrobatchSpec(images=((16, 16),), seed=4, name="one-image")


def _every_layer_on_zero_rows(model, batch) -> torch.Tensor:
    """Every layer of the toy tower called on zero rows, on the autograd graph: [0, lm_hidden] features through
    which every parameter gets a gradient (of zeros), so only the rows tell that nothing was encoded."""
    touched = model.pos[:0].sum()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            rows = batch.patches[0, :0] if module is model.embed else batch.patches.new_zeros(0, module.in_features)
            touched = touched + module(rows).sum()
        elif isinstance(module, nn.LayerNorm):
            touched = touched + module(batch.patches.new_zeros(0, *module.normalized_shape)).sum()
    return batch.patches.new_zeros(0, model.config.lm_hidden) + touched


class ZeroRows(Reference):
    """The reference, except that a rank with only placeholders calls its layers on zero rows instead."""

    name = "zero-rows"
    warm_up = False  # True: zero rows first, then its placeholders for real

    def encode_sharded(self, model, batch, config, group):
        plan = sharded.plan_for(batch.spec, config)
        if not config.shard_vision or plan.shard(dist.get_rank(group)).num_real_rows > 0:
            return sharded.encode_sharded(model, batch, config, group)
        nothing = _every_layer_on_zero_rows(model, batch)
        if self.warm_up:
            return sharded.encode_sharded(model, batch, config, group) + nothing.sum()
        return sharded.gather_features(nothing, sharded.real_tokens(plan), group)


class ZeroRowsFirst(ZeroRows):
    name = "zero-rows-first"
    warm_up = True


@pytest.mark.distributed
def test_a_rank_whose_layers_only_saw_zero_rows_did_not_run_its_tower():
    judged = run_judged(Case(ONE_IMAGE, 2, "tests.distributed.test_execution:ZeroRows"))
    assert not judged.passing, judged.result.summary()
    assert any("rank 1" in f and "tower" in f for f in judged.result.failures), judged.result.summary()
    assert not any("rank 0" in f for f in judged.result.failures), judged.result.summary()


@pytest.mark.distributed
def test_zero_row_calls_beside_real_rows_change_nothing():
    for impl in ("reference", "tests.distributed.test_execution:ZeroRowsFirst"):
        judged = run_judged(Case(ONE_IMAGE, 2, impl))
        assert judged.verdict == "pass", judged.result.summary()


class Wrapper(torch.nn.Module):
    """A VLM-like holder: the tower is a submodule whose own forward the sharded path never calls (it calls
    encode and project apart), and which holds a parameter of its own (the position table)."""

    def __init__(self, tower):
        super().__init__()
        self.tower = tower


class Wrapped(Reference):
    name = "wrapped"

    def build_model(self, case, dtype, device):
        return Wrapper(super().build_model(case, dtype, device))

    def encode(self, model, batch):
        return sharded.encode_unsharded(model.tower, batch)

    def encode_sharded(self, model, batch, config, group):
        return sharded.encode_sharded(model.tower, batch, config, group)


@pytest.mark.distributed
def test_a_tower_nested_in_a_holder_runs_when_its_encode_and_project_do():
    """The holder's tower holds a parameter itself, so its forward is a layer; the unsharded encode calls it, the
    sharded path never does, on any rank. A layer is required where every rank holding real rows ran it
    (oracle.required_layers): this one nowhere, and rightly, since no rank enters it."""
    judged = run_judged(Case(ONE_IMAGE, 2, "tests.distributed.test_execution:Wrapped"))
    assert judged.verdict == "pass", judged.result.summary()
