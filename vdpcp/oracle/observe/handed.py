"""The gradient vdpcp hands into each output's backward, kept with a copy, and what the implementation's backward
wrote into it.

vdpcp's loss merges each gathered output into a text stream by addition (vdpcp.feature.loss), so the gradient it hands an
output's backward is a view of the merged stream's gradient, the buffer the prompt's backward reads too. A backward
that writes into it (an all-reduce in place, as Megatron-Core's ``_reduce`` does) leaves its own result right and
hands every later reader of that buffer the sum over the CP group. The write is seen here, where it happens, by
comparing the tensor after the backward with the copy taken as it was handed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vdpcp.feature import loss

# Where a reader learns when the write corrupts and how to fix it.
DOCS = "docs/verdicts.md#a-backward-that-writes-into-its-incoming-gradient"
WROTE = ("the gather's backward wrote into the gradient it was handed: a consumer that reads it after, such as an "
         "additive merge, sees the sum")


@dataclass
class Written:
    """One output's handed gradient after the backward: how many of its rows changed, and by how much (``delta``:
    after minus as handed, zeros where unchanged)."""

    rows: int
    of: int
    delta: torch.Tensor


class Handed:
    """Within the block, a hook on every output that requires grad keeps the gradient autograd hands its backward
    and a copy of it; ``written()`` says, once the backward ran, which of them the implementation changed. The
    hooks are removed on the way out, so a later backward through the same outputs (the regrouped run's) keeps
    nothing."""

    def __init__(self, outputs: dict[str, torch.Tensor]):
        self.outputs = outputs
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles = []

    def __enter__(self) -> Handed:
        for name, t in self.outputs.items():
            if t.requires_grad and t.grad_fn is not None:
                self._handles.append(t.register_hook(lambda grad, name=name: self._keep(name, grad)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keep(self, name: str, grad: torch.Tensor) -> None:
        self.kept.setdefault(name, (grad, grad.detach().clone()))

    def written(self) -> dict[str, Written]:
        """Per output whose handed gradient the backward changed: its rows changed and the change."""
        out = {}
        for name in [name for name in self.outputs if name in self.kept]:  # in the outputs' order, not the backward's
            grad, handed = self.kept[name]
            if not handed.numel():
                continue
            after = grad.detach()
            differs = after.ne(handed) & ~(after.isnan() & handed.isnan())  # a NaN handed on as it was is no write
            changed = differs.reshape(handed.shape[0], -1).any(dim=1)  # outputs are [tokens, ...] (outputs_of)
            if bool(changed.any()):
                out[name] = Written(int(changed.sum()), changed.numel(), after - handed)
        return out


def line(at, written: dict[str, Written]) -> str:
    """The one line that says, for the rank ``at`` (its ``rank`` and ``cp_rank``: an Arm, say), which outputs'
    handed gradients its backward wrote into."""
    what = ", ".join(f"output {name!r} ({w.rows} of {w.of} rows changed)" for name, w in written.items())
    return (f"gradient written: rank {at.rank} (CP rank {at.cp_rank}), {what}: {WROTE} (a copy, or an "
            f"out-of-place collective, fixes it: {DOCS})")


def in_tables(written: dict[str, Written], losses: loss.Loss) -> dict[str, torch.Tensor]:
    """What the write added to each prompt table's gradient, were the prompt's backward to read the buffer after it:
    the change at the vision rows of the merged stream, in the table's row order (vdpcp.feature.loss: the table's gradient
    is the stream's, each stream row looked up once)."""
    out = {}
    for name, table in losses.tables.items():
        stream = torch.zeros((losses.tokens[name].numel(), *table.shape[1:]), dtype=table.dtype, device=table.device)
        if name in written:
            delta = written[name].delta
            stream[loss.TEXT_BEFORE : loss.TEXT_BEFORE + delta.shape[0]] = delta.to(table.dtype)
        out[name] = torch.zeros_like(table).index_copy(0, losses.tokens[name], stream)
    return out
