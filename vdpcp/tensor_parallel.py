"""Tensor parallelism inside the toy tower: each block's MLP split over a TP group, Megatron-style.

The first MLP layer is split by output features (column parallel), the second by input features (row parallel),
so each TP rank holds 1/TP of the MLP and one all-reduce per block restores the full output; its backward
all-reduces the input gradient. The weights are slices of the full tower's, so the TP tower computes the same
function. What it adds to the suite is collectives INSIDE the tower: a rank that skips its tower (e.g. one that
holds only placeholders) leaves its TP peers waiting, and each TP all-reduce waits at most TP_WAIT_S before it
raises naming the peer that never entered it, well within the harness's case timeout, instead of hanging.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TP_WAIT_S = 10.0  # a peer of a tiny tower arrives within milliseconds; a missing one, never


class TPPeerMissing(RuntimeError):
    """A TP peer never entered a collective of the vision tower: it skipped (part of) its tower."""


def all_reduce(x: torch.Tensor, group, what: str) -> torch.Tensor:
    """Sum ``x`` over the TP group, or raise TPPeerMissing naming the peers after TP_WAIT_S."""
    out = x.contiguous().clone()
    work = dist.all_reduce(out, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=TP_WAIT_S))
    except RuntimeError as err:
        me = dist.get_rank()
        peers = [r for r in dist.get_process_group_ranks(group) if r != me]
        raise TPPeerMissing(f"rank {me}: {what} waited {TP_WAIT_S:g} s: TP peer rank(s) {peers} never entered it "
                            f"(a rank that skips its tower hangs its tensor-parallel peers) [{err}]") from None
    return out


class _CopyToTP(torch.autograd.Function):
    """Forward: the input, replicated on every TP rank. Backward: the TP ranks' input gradients summed."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group, f"{ctx.what} (backward)"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: the TP ranks' partial outputs summed. Backward: the gradient, as each rank's partial's."""

    @staticmethod
    def forward(ctx, x, group, what):
        return all_reduce(x, group, what)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class ParallelMLP(nn.Module):
    """A Linear-GELU-Linear MLP with its hidden features split over ``group``."""

    def __init__(self, mlp: nn.Sequential, group, name: str):
        super().__init__()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        first, second = mlp[0], mlp[2]
        part = first.out_features // size
        rows = slice(rank * part, (rank + 1) * part)
        self.up = nn.Linear(first.in_features, part)
        self.down = nn.Linear(part, second.out_features)
        with torch.no_grad():
            self.up.weight.copy_(first.weight[rows])
            self.up.bias.copy_(first.bias[rows])
            self.down.weight.copy_(second.weight[:, rows])
            self.down.bias.copy_(second.bias)
        self.group, self.name = group, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group, f"{self.name} all-reduce")
        partial = F.linear(F.gelu(self.up(x)), self.down.weight)
        return _ReduceFromTP.apply(partial, self.group, f"{self.name} all-reduce") + self.down.bias


def parallelize(model, group):
    """Split every block's MLP of a vdpcp.model.VisionModel over the TP ``group`` (in place)."""
    if dist.get_world_size(group) == 1:
        return model
    for i, block in enumerate(model.blocks):
        block.mlp = ParallelMLP(block.mlp, group, f"TP MLP of block {i}")
    return model
