"""torch.distributed.nn's all_to_all on gloo, done right: swapped in around a case's sharded arm on a gloo CP group.

torch.distributed.nn.functional's autograd all_to_all (class ``_AlltoAll``, which ``all_to_all`` and
``all_gather``'s backward both call, looking the name up when they run) falls back on gloo to one ``dist.scatter``
per rank. That fallback needs every tensor to have one size ("ProcessGroupGloo::scatter: invalid tensor size") and
passes the group rank as the global source rank ("is not part of group" on every CP group but the first in a CP x DP
layout). NCCL runs a real all_to_all, which has neither limit. MCore's gather_from_context_parallel_ranks_dynamic_res
goes through it, so on gloo its backward failed whenever CP ranks held different token counts.

``on_gloo(group)`` swaps that one name, for the time of a ``with`` block, for a dispatcher that sends gloo groups to
``GlooAllToAll`` (one gloo ``all_to_all_single`` of the tensors' bytes, which takes uneven split sizes on any
group; its backward is the reverse exchange, as torch's is) and every other group to torch's own class. Nothing of
the code under test is touched: MCore calls torch.distributed.nn.functional.all_to_all as it always does.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

REPLACED = "_AlltoAll"  # the name torch's all_to_all and all_gather's backward look up at call time
NOTE = "vdpcp's gloo all_to_all (torch.distributed.nn's gloo fallback replaced; vdpcp.gloo_collectives)"


def exchange(outputs, inputs, group) -> None:
    """All-to-all by definition: this rank's ``inputs[j]`` lands in rank j's ``outputs[i]`` (i: this rank), any
    sizes and any dtype. One gloo all_to_all_single of bytes: the exchange moves data and computes nothing."""
    size = dist.get_world_size(group)
    if len(inputs) != size or len(outputs) != size:
        raise ValueError(f"all_to_all on a group of {size} ranks takes {size} input and {size} output tensors; "
                         f"got {len(inputs)} and {len(outputs)}")
    sent = [_bytes(t) for t in inputs]
    received = torch.empty(sum(_nbytes(o) for o in outputs), dtype=torch.uint8, device=outputs[0].device)
    dist.all_to_all_single(received, torch.cat(sent),
                           output_split_sizes=[_nbytes(o) for o in outputs],
                           input_split_sizes=[b.numel() for b in sent], group=group)
    for out, part in zip(outputs, received.split([_nbytes(o) for o in outputs])):
        out.copy_(part.view(out.dtype).view(out.shape))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GlooAllToAll(torch.autograd.Function):
    """torch's ``_AlltoAll`` contract (group, output list, *inputs -> the filled outputs), on gloo: the gradient of
    what rank i sent to rank j is what rank j's output i received as gradient, sent back."""

    @staticmethod
    def forward(ctx, group, out_tensor_list, *tensors):
        ctx.group = group
        ctx.input_shapes = [(t.shape, t.dtype) for t in tensors]
        exchange(out_tensor_list, tensors, group)
        return tuple(out_tensor_list)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = [torch.empty(shape, dtype=dtype, device=grad_outputs[0].device) for shape, dtype in ctx.input_shapes]
        return (None, None) + GlooAllToAll.apply(ctx.group, grads, *grad_outputs)


class _Dispatch:
    """What stands under torch's name while swapped: gloo groups to GlooAllToAll, any other to torch's class."""

    def __init__(self, torchs):
        self.torchs = torchs
        self.calls = 0  # calls it sent to GlooAllToAll (whose backward runs without coming back here)

    def apply(self, group, out_tensor_list, *tensors):
        if dist.get_backend(group) != dist.Backend.GLOO:
            return self.torchs.apply(group, out_tensor_list, *tensors)
        self.calls += 1
        return GlooAllToAll.apply(group, out_tensor_list, *tensors)


@contextmanager
def on_gloo(group):
    """Within the block, torch.distributed.nn's all_to_all (and all_gather's backward) run GlooAllToAll on gloo
    groups, if ``group`` is a gloo group. Yields the swap (its ``calls`` say whether anything went through it, so
    a report names it only where it ran), or None where nothing was swapped (an NCCL group: torch's own
    all_to_all is a real one there). Restored on the way out, raise or not."""
    if group is None or dist.get_backend(group) != dist.Backend.GLOO:  # None: the oracle run in-process, alone
        yield None
        return
    torchs = getattr(dist_nn, REPLACED, None)
    if not isinstance(torchs, type) or not issubclass(torchs, torch.autograd.Function):
        raise RuntimeError(f"torch {torch.__version__}: torch.distributed.nn.functional.{REPLACED} is not the "
                           f"autograd all_to_all vdpcp.gloo_collectives replaces on gloo (read on torch 2.14)")
    swap = _Dispatch(torchs)
    setattr(dist_nn, REPLACED, swap)
    try:
        yield swap
    finally:
        setattr(dist_nn, REPLACED, torchs)


def used(swap: _Dispatch | None) -> str:
    """What a rank's report says of its collectives: NOTE where the swap ran an exchange, else nothing."""
    return NOTE if swap is not None and swap.calls else ""
