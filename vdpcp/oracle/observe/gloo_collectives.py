"""torch's collectives that NCCL runs with uneven sizes, run the same way on gloo: swapped in around a case's
sharded arm on a gloo CP group.

Three names, each looked up by the code under test when it runs:

- ``torch.distributed.nn.functional._AlltoAll`` (the class torch.distributed.nn's autograd ``all_to_all`` and
  ``all_gather``'s backward both call). On gloo it falls back to one ``dist.scatter`` per rank, which needs every
  tensor to have one size ("ProcessGroupGloo::scatter: invalid tensor size") and passes the group rank as the global
  source rank ("is not part of group" on every CP group but the first in a CP x DP layout). MCore's
  gather_from_context_parallel_ranks_dynamic_res goes through it, so its backward failed on gloo whenever CP ranks
  held different token counts.
- ``torch.distributed.all_gather`` and ``torch.distributed.all_to_all`` (list forms). torch documents uneven sizes
  for all_gather and NCCL runs both with them; gloo raises "ProcessGroupGloo::allgather (alltoall): invalid tensor
  size" unless every tensor has one shape. Megatron-Bridge's Qwen3-VL gather is a plain uneven all_gather.

``on_gloo(group)`` swaps these names for the time of a ``with`` block for dispatchers that run vdpcp's stand-in only
for a gloo group and only where gloo would refuse the sizes: one gloo ``all_to_all_single`` of the tensors' bytes
(``exchange``), which takes uneven split sizes on any subgroup and any dtype; torch's autograd all_to_all's backward
is the reverse exchange, as torch's is. Every other call (an NCCL group, equal shapes, a tensor subclass, mixed
dtypes, a rank outside the group) goes to torch's own function with its arguments untouched. Nothing of the code
under test is touched: it calls torch's names as it always does. Code that bound torch's function to a name of its
own at import (``from torch.distributed import all_gather``) is not reached; no shipped or field implementation
does (docs/layouts.md).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch.overrides import has_torch_function

NOTE = "vdpcp's gloo all_to_all (torch.distributed.nn's gloo fallback replaced; vdpcp.oracle.observe.gloo_collectives)"
ALL_GATHER_NOTE = "vdpcp's gloo all_gather for uneven sizes (torch.distributed.all_gather; vdpcp.oracle.observe.gloo_collectives)"
ALL_TO_ALL_NOTE = "vdpcp's gloo all_to_all for uneven sizes (torch.distributed.all_to_all; vdpcp.oracle.observe.gloo_collectives)"
# (module, name) -> what a report says where vdpcp's stand-in for it ran
REPLACED = {(dist_nn, "_AlltoAll"): NOTE, (dist, "all_gather"): ALL_GATHER_NOTE, (dist, "all_to_all"): ALL_TO_ALL_NOTE}


def exchange(outputs, inputs, group, collective: str = "all_to_all") -> None:
    """All-to-all by definition: this rank's ``inputs[j]`` lands in rank j's ``outputs[i]`` (i: this rank), any
    sizes and any dtype, bytes as they are. The ranks first agree on the sizes (one small all_gather), so sizes
    that do not match (which NCCL leaves undefined) raise the same error on every rank instead of hanging one."""
    size = dist.get_world_size(group)
    if len(inputs) != size or len(outputs) != size:
        raise ValueError(f"{collective} on a group of {size} ranks takes {size} input and {size} output tensors; "
                         f"got {len(inputs)} and {len(outputs)}")
    sent = [_bytes(t) for t in inputs]
    expected = [_nbytes(o) for o in outputs]
    _agree_on_sizes([b.numel() for b in sent], expected, group, collective, [_shape(t) for t in inputs],
                    [_shape(o) for o in outputs])
    received = torch.empty(sum(expected), dtype=torch.uint8, device=outputs[0].device)
    dist.all_to_all_single(received, torch.cat(sent), output_split_sizes=expected,
                           input_split_sizes=[b.numel() for b in sent], group=group)
    with torch.no_grad():  # a collective moves data: it records no graph, as torch's own do not
        for out, part in zip(outputs, received.split(expected)):
            out.copy_(part.view(out.dtype).view(out.shape))


def _agree_on_sizes(sends: list[int], expects: list[int], group, collective: str, sent=None, expected=None) -> None:
    """Every rank learns what every rank sends and expects; a mismatch raises the same error on all of them, saying
    whether the rows or the dtypes differ. ``sent``/``expected``: (rows, dtype) of each tensor sent and expected."""
    size = len(sends)
    sent = sent or [(0, torch.uint8)] * size
    expected = expected or [(0, torch.uint8)] * size
    shapes = [rows for rows, _ in sent + expected] + [_DTYPES.index(dtype) for _, dtype in sent + expected]
    mine = torch.tensor(sends + expects + shapes, dtype=torch.int64)  # gloo groups always take CPU tensors
    table = [torch.empty_like(mine) for _ in range(size)]
    if _IN_FORCE:
        _IN_FORCE[-1].own += 1  # vdpcp's, not the code under test's: its call is the exchange after it
    dist.all_gather(table, mine, group=group)  # equal shapes: gloo's own
    wrong = [(i, j) for i in range(size) for j in range(size) if table[i][j] != table[j][size + i]]
    if wrong:
        i, j = wrong[0]
        raise ValueError(f"{collective} on gloo: group rank {i} sends group rank {j} {int(table[i][j])} bytes, which "
                         f"expects {int(table[j][size + i])}: {_what_differs(table, size, i, j)} ({len(wrong)} pair(s) "
                         f"of ranks disagree on sizes; NCCL's result is undefined there)")


def _what_differs(table: list[torch.Tensor], size: int, i: int, j: int) -> str:
    """Whether group rank ``i``'s tensor for rank ``j`` and the one ``j`` expects from it differ in rows or in dtype,
    and the dtypes every rank sent (a rank's own dtype is the usual culprit: an empty rank's made apart)."""
    def rows(r, k):
        return int(table[r][2 * size + k])

    def dtype(r, k):
        return _DTYPES[int(table[r][4 * size + k])]

    sends, expects = (rows(i, j), dtype(i, j)), (rows(j, size + i), dtype(j, size + i))
    if sends[1] != expects[1] and sends[0] == expects[0]:
        said = f"their rows agree ({sends[0]}), their dtypes differ ({sends[1]} sent, {expects[1]} expected)"
    elif sends[1] != expects[1]:
        said = f"rows and dtypes differ ({sends[0]} rows of {sends[1]} sent, {expects[0]} rows of {expects[1]} expected)"
    elif sends[0] != expects[0]:
        said = f"their rows differ ({sends[0]} sent, {expects[0]} expected, of {sends[1]})"
    else:
        said = f"their rows ({sends[0]}) and dtype ({sends[1]}) agree, their other dimensions differ"
    each = ", ".join(f"group rank {r} {'/'.join(dict.fromkeys(str(dtype(r, k)) for k in range(size)))}"
                     for r in range(size))
    return f"{said}; each rank sent {each}"


def _shape(t: torch.Tensor) -> tuple[int, torch.dtype]:
    return (t.shape[0] if t.dim() else 1), t.dtype


# Every dtype torch has, in one order on every rank: a dtype crosses ranks as its place here.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
# The swaps in force, innermost last: where vdpcp's own collectives are counted apart from the code under test's.
_IN_FORCE: list[Swap] = []


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


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


def _on_gloo(group) -> bool:
    return group is not dist.GroupMember.NON_GROUP_MEMBER and dist.get_backend(group) == dist.Backend.GLOO


def _refused_by_gloo(tensors: list) -> bool:
    """Plain tensors of one dtype whose shapes gloo's list collectives would refuse (they take one shape only);
    anything else is torch's to run or to refuse with its own error."""
    if not all(type(t) is torch.Tensor for t in tensors) or has_torch_function(tuple(tensors)):
        return False
    return len({t.dtype for t in tensors}) == 1 and len({t.shape for t in tensors}) > 1


class Swap:
    """What stands under torch's names while swapped; ``calls`` counts, per report note, the calls that vdpcp's
    stand-in ran (GlooAllToAll's backward runs without coming back here); ``own``, the collectives they issued
    besides the one each call stands for, which a count of the code under test's leaves out (vdpcp.feature.comm.Collectives)."""

    def __init__(self, torchs: dict):
        self.torchs = torchs
        self.calls: Counter[str] = Counter()
        self.own = 0  # collectives vdpcp's stand-ins issued of their own (the sizes' agreement), beside the calls
        self.stand_ins = {(dist_nn, "_AlltoAll"): self, (dist, "all_gather"): self.all_gather,
                          (dist, "all_to_all"): self.all_to_all}

    def apply(self, group, out_tensor_list, *tensors):
        """The place of the apply of torch.distributed.nn.functional's _AlltoAll."""
        if not _on_gloo(group):
            return self.torchs[dist_nn, "_AlltoAll"].apply(group, out_tensor_list, *tensors)
        self.calls[NOTE] += 1
        return GlooAllToAll.apply(group, out_tensor_list, *tensors)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        """torch.distributed.all_gather's place: output ``tensor_list[i]`` holds rank i's ``tensor``."""
        if not (isinstance(tensor_list, list) and _on_gloo(group) and _refused_by_gloo([tensor, *tensor_list])):
            return self.torchs[dist, "all_gather"](tensor_list, tensor, group=group, async_op=async_op)
        self.calls[ALL_GATHER_NOTE] += 1
        exchange(tensor_list, [tensor] * len(tensor_list), group, "all_gather")
        return _Done(tensor_list) if async_op else None

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        """torch.distributed.all_to_all's place: output ``i`` holds what rank i's input ``r`` was (r: this rank)."""
        tensors = [*input_tensor_list, *output_tensor_list] if isinstance(input_tensor_list, list) else []
        if not (isinstance(output_tensor_list, list) and tensors and _on_gloo(group) and _refused_by_gloo(tensors)):
            return self.torchs[dist, "all_to_all"](output_tensor_list, input_tensor_list, group=group,
                                                  async_op=async_op)
        self.calls[ALL_TO_ALL_NOTE] += 1
        exchange(output_tensor_list, input_tensor_list, group, "all_to_all")
        return _Done(output_tensor_list) if async_op else None


class _Done(dist.Work):
    """What torch returns for ``async_op=True``: a work handle, here for an exchange that has already completed."""

    def __init__(self, outputs: list[torch.Tensor]):
        super().__init__()
        self.outputs = outputs

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self.outputs)
        return future


@contextmanager
def on_gloo(group):
    """Within the block, torch's names in REPLACED run vdpcp's stand-ins where a call's group is a gloo group and
    gloo would refuse its sizes, if ``group`` is a gloo group. Yields the swap (its ``calls`` say which stand-ins
    ran, so a report names those only), or None where nothing was swapped (an NCCL group: torch's own run there).
    Restored on the way out, raise or not."""
    if group is None or dist.get_backend(group) != dist.Backend.GLOO:  # None: the oracle run in-process, alone
        yield None
        return
    torchs = {(module, name): getattr(module, name, None) for module, name in REPLACED}
    _check_torchs(torchs)
    swap = Swap(torchs)
    for (module, name), stand_in in swap.stand_ins.items():
        setattr(module, name, stand_in)
    _IN_FORCE.append(swap)
    try:
        yield swap
    finally:
        _IN_FORCE.remove(swap)
        for (module, name), torchs_own in torchs.items():
            setattr(module, name, torchs_own)


def _check_torchs(torchs: dict) -> None:
    """The names hold what vdpcp's stand-ins replace (read on torch 2.14), or the swap would change behaviour."""
    alltoall = torchs[dist_nn, "_AlltoAll"]
    expected = {(dist_nn, "_AlltoAll"): isinstance(alltoall, type) and issubclass(alltoall, torch.autograd.Function),
                (dist, "all_gather"): callable(torchs[dist, "all_gather"]),
                (dist, "all_to_all"): callable(torchs[dist, "all_to_all"])}
    for (module, name), ok in expected.items():
        if not ok:
            raise RuntimeError(f"torch {torch.__version__}: {module.__name__}.{name} is not the collective "
                               f"vdpcp.oracle.observe.gloo_collectives replaces on gloo (read on torch 2.14)")


def used(swap: Swap | None) -> str:
    """What a rank's report says of its collectives: the note of each stand-in that ran, else nothing."""
    if swap is None:
        return ""
    return "; ".join(note for note in REPLACED.values() if swap.calls[note])
