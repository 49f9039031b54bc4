"""Tensor parallelism inside the toy tower: each block's MLP split over a TP group, Megatron-style.

The first MLP layer is split by output features (column parallel), the second by input features (row parallel),
so each TP rank holds 1/TP of the MLP and one all-reduce per block restores the full output; its backward
all-reduces the input gradient. The weights are slices of the full tower's, so the TP tower computes the same
function. What it adds to the suite is collectives INSIDE the tower: a rank that skips its tower (e.g. one that
holds only placeholders) leaves its TP peers waiting, and each TP all-reduce waits at most TP_WAIT_S before it
raises naming the peer that never entered it, well within the harness's case timeout, instead of hanging.

The TP tower is only ever the model under test: the unsharded reference of a CP x TP case is the plain tower
with the same weights (``Reference.subject_model``), so a TP bug cannot cancel on both sides. The parallel MLP
keeps the plain one's module and parameter names (``mlp.0``, ``mlp.2``), and each sharded parameter says which
part of the plain one it holds as MCore marks it (``tensor_model_parallel``, ``partition_dim``): ``held_part``
is that part, of a weight when the tower is split and of a gradient when the oracle compares.
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


def held_part(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The part of a plain tower's tensor (a weight, or its gradient) that ``param`` holds on TP rank ``tp_rank``
    of ``tp``: its chunk along ``partition_dim`` where it is tensor parallel (MCore's marking), else all of it."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if full.shape[param.partition_dim] != tp * param.shape[param.partition_dim]:
        raise ValueError(f"a TP parameter of shape {tuple(param.shape)} split along dim {param.partition_dim} is not "
                         f"1/{tp} of the plain tensor's {tuple(full.shape)}")
    return full.chunk(tp, dim=param.partition_dim)[tp_rank]


def _mark(param: nn.Parameter, dim: int) -> None:
    param.tensor_model_parallel, param.partition_dim = True, dim


class ColumnParallelLinear(nn.Linear):
    """This TP rank's output features of a Linear; its input enters through _CopyToTP."""

    def __init__(self, full: nn.Linear, group, what: str):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        super().__init__(full.in_features, full.out_features // size, dtype=full.weight.dtype, device=full.weight.device)
        _mark(self.weight, 0)
        _mark(self.bias, 0)
        with torch.no_grad():
            self.weight.copy_(held_part(full.weight, self.weight, rank, size))
            self.bias.copy_(held_part(full.bias, self.bias, rank, size))
        self.group, self.what = group, what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, self.group, self.what), self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """This TP rank's input features of a Linear: partial outputs summed over the group, then the (whole) bias."""

    def __init__(self, full: nn.Linear, group, what: str):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        super().__init__(full.in_features // size, full.out_features, dtype=full.weight.dtype, device=full.weight.device)
        _mark(self.weight, 1)
        with torch.no_grad():
            self.weight.copy_(held_part(full.weight, self.weight, rank, size))
            self.bias.copy_(full.bias)
        self.group, self.what = group, what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group, self.what) + self.bias


class ParallelMLP(nn.Sequential):
    """A Linear-GELU-Linear MLP with its hidden features split over ``group``, under the plain MLP's names."""

    def __init__(self, mlp: nn.Sequential, group, name: str):
        what = f"{name} all-reduce"
        super().__init__(ColumnParallelLinear(mlp[0], group, what), mlp[1], RowParallelLinear(mlp[2], group, what))
        self.group, self.name = group, name


def parallelize(model, group):
    """Split every block's MLP of a vdpcp.feature.model.VisionModel over the TP ``group`` (in place)."""
    if dist.get_world_size(group) == 1:
        return model
    for i, block in enumerate(model.blocks):
        block.mlp = ParallelMLP(block.mlp, group, f"TP MLP of block {i}")
    return model
