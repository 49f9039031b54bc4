"""The CP group's collectives kept local, from outside a subject, for the backward of its outputs.

A gather's backward is where the field's worst bugs sat (a backward that keeps only the local slice, a rank that
never enters the backward collective: vdpcp's docs/power.md, the field's bug classes). Any implementation's gather
backward crosses ranks through torch.distributed, so a bug there can be planted in anyone's code from outside:
``LocalBackward`` replaces torch.distributed's cross-rank collectives, for calls over the CP group's ranks only,
from the moment the gradient of the subject's outputs arrives to the end of that backward, by what each would do if
this rank were alone: an all-reduce keeps this rank's tensor, a reduce-scatter or scatter keeps this rank's own
part, an all-to-all keeps what this rank sent itself (zeros from the others). The forward (the gather itself) and
every collective outside that span (vdpcp's own sums of gradients, after backward) are the real ones.
"""

from __future__ import annotations

import inspect

_REPLACED = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "all_to_all", "all_to_all_single")


class _Done:
    """What an async collective returns; this one is already done."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


class LocalBackward:
    """``opened(grad)``, as the outputs' gradient hook, opens the span; the end of that backward closes it and
    tells ``ended`` how many collectives it kept local. ``close()`` puts torch.distributed back and may be called
    again (the case's end calls it too, so that nothing outlives a case whose backward raised).
    """

    def __init__(self, group, ended=lambda calls: None):
        import torch.distributed as dist

        self.group, self.calls, self._saved, self._ended = group, 0, {}, ended
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._ranks = dist.get_process_group_ranks(group)

    def opened(self, grad):
        import torch
        import torch.distributed as dist

        if not self._saved:
            self._saved = {name: getattr(dist, name) for name in _REPLACED}
            for name in _REPLACED:
                setattr(dist, name, self._local(name))
            torch.autograd.Variable._execution_engine.queue_callback(self._end)  # the end of this backward
        return grad

    def _end(self) -> None:
        self.close()
        calls, self.calls = self.calls, 0
        self._ended(calls)

    def close(self) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved = {}

    def _local(self, name: str):
        """torch.distributed's ``name``, kept local when its group has the CP group's ranks."""
        import torch.distributed as dist

        original, alone = self._saved[name], getattr(self, f"_{name}")
        signature = inspect.signature(original)

        def collective(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments  # group and async_op, passed by name or position
            group, async_op = bound.pop("group", None), bound.pop("async_op", False)
            if dist.get_process_group_ranks(group if group is not None else dist.group.WORLD) != self._ranks:
                return original(*args, **kwargs)
            self.calls += 1
            alone(**bound)
            return _Done() if async_op else None

        return collective

    # Each: what the collective leaves on this rank when the others' contributions are not there.
    def _all_reduce(self, tensor, op=None):
        pass  # this rank's own tensor, summed with nothing

    def _reduce_scatter(self, output, input_list, op=None):
        output.copy_(input_list[self.rank])

    def _reduce_scatter_tensor(self, output, input, op=None):
        output.copy_(input.reshape(self.size, *output.shape)[self.rank])

    def _scatter(self, tensor, scatter_list=None, src=None, group_src=None):
        import torch.distributed as dist

        source = group_src if group_src is not None else dist.get_group_rank(self.group, src if src is not None else 0)
        if source == self.rank:
            tensor.copy_(scatter_list[self.rank])
        else:
            tensor.zero_()

    def _all_to_all(self, output_tensor_list, input_tensor_list):
        for out in output_tensor_list:
            out.zero_()
        output_tensor_list[self.rank].copy_(input_tensor_list[self.rank])

    def _all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None):
        sent = input.split(input_split_sizes or input.shape[0] // self.size)
        got = output.split(output_split_sizes or output.shape[0] // self.size)
        output.zero_()
        got[self.rank].copy_(sent[self.rank])
