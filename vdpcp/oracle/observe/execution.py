"""What ran: forward pre-hooks on a model's layers (Execution: rows, layers, the microbatch rows read), and the
execution checks on it: every rank ran its tower, through every layer each rank holding real rows ran, and has a
gradient for every parameter of those layers."""

from __future__ import annotations

import math

import torch

from vdpcp.feature import comm
from vdpcp.matrix.case import FAILURE, Finding
from vdpcp.oracle.context import Arm
from vdpcp.oracle.failures import found
from vdpcp.oracle.observe import reads


class Execution:
    """What a model's layers really ran on: forward pre-hooks on every module that holds parameters itself, from
    construction until ``close()`` (or the end of a ``with`` block).

    ``rows``: rows the first such module to run saw, summed over its calls, whatever the grad mode; ``ran()``: the
    modules that saw at least one row (a module called on nothing did not run); ``read``: the microbatch rows whose
    patches reached any of them, read off their inputs' row codes (vdpcp.oracle.observe.reads: inside ``reads.coded``), or looked
    up by their bytes in ``index`` where an input carries none. Each module gets its inputs without their
    tangents, so forward-mode AD never runs inside the tower. ``learn``: the rows that carry codes go into
    ``index`` (the unsharded arm), for the sharded arm's look-ups.
    """

    def __init__(self, model: torch.nn.Module, index: reads.Index | None = None, learn: bool = False):
        self.calls: dict[str, int] = {}
        self.first: str | None = None
        self.read: set[int] = set()
        self.index, self.learn = index, learn
        # Not the root: a tower's encode and project are often called apart, never through its forward.
        held = [(name, m) for name, m in model.named_modules()
                if name and next(m.parameters(recurse=False), None) is not None]
        self.names = [name for name, _ in held]
        self._handles = [module.register_forward_pre_hook(self._hook(name), with_kwargs=True) for name, module in held]

    def _hook(self, name: str):
        def record(module, args, kwargs):
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            rows = input_rows(module, tensor)
            self.first = self.first or name
            self.calls[name] = self.calls.get(name, 0) + rows
            return self._seen(module, name, args, kwargs)
        return record

    def _seen(self, module, name: str, args: tuple, kwargs: dict):
        """The rows ``module``'s tensor inputs hold, recorded; its inputs without tangents, where any had one."""
        def plain(value):
            if not isinstance(value, torch.Tensor):
                return value
            primal, rows = reads.seen(module, name, value, self.index, self.learn)
            self.read |= rows
            return primal

        stripped = tuple(plain(a) for a in args), {key: plain(v) for key, v in kwargs.items()}
        changed = any(a is not b for a, b in zip(stripped[0], args)) or any(
            stripped[1][key] is not v for key, v in kwargs.items())
        return stripped if changed else None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> Execution:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def rows(self) -> int:
        return self.calls.get(self.first, 0) if self.first else 0

    def ran(self) -> set[str]:
        return {name for name, rows in self.calls.items() if rows > 0}


def input_rows(module: torch.nn.Module, tensor: torch.Tensor | None) -> int:
    """Rows a module takes: its input's elements over one row's. A convolution's row is one kernel window over
    every input channel (a patch, for a tower's patch embedding, however its input is shaped); anything
    else's is the last dimension."""
    if tensor is None or tensor.dim() == 0:
        return 0
    if isinstance(module, reads.CONVOLUTIONS):
        per_row = module.in_channels * math.prod(module.kernel_size)
    else:
        per_row = tensor.shape[-1]
    return tensor.numel() // max(per_row, 1)


def ran_by_rank(ran: Execution, read: torch.Tensor, cp_rank: int, group) -> list[set[str]]:
    """The layers each CP rank ran (Execution.ran), exchanged in one collective that every rank takes."""
    mine = ran.ran()
    table = torch.zeros(read.shape[0], len(ran.names), dtype=torch.float64, device=read.device)
    table[cp_rank] = torch.tensor([float(name in mine) for name in ran.names], dtype=torch.float64)
    table = comm.all_reduce_sum(table, group)
    return [{name for name, hit in zip(ran.names, line.tolist()) if hit} for line in table]


def required_layers(reference_ran: set[str], ran: list[set[str]], read: torch.Tensor, cp_rank: int) -> set[str]:
    """The layers CP rank ``cp_rank`` must have run: those of the unsharded run that ran on EVERY CP rank holding
    real rows (``read``: the read table). A layer only some rows take (RADIO's separate video embedder, which a rank
    of images alone never runs) is then required only where every share took it; the trunk every row passes
    through (where a tensor-parallel or FSDP peer would hang) stays required on every rank.

    A rank holding only placeholders is the one such a layer can still wrong: a placeholder is a 1x1 image, so
    where every real share is video it takes the image embedder instead. Its rows visibly took another branch when
    it ran layers no rank holding real rows ran; each such layer excuses one required layer it did not run (a
    branch for a branch), so a rank that runs an embedder and skips the trunk still fails."""
    real = [r for r in range(read.shape[0]) if bool(read[r].any())]
    shared = set(reference_ran).intersection(*(ran[r] for r in real)) if real else set(reference_ran)
    if cp_rank in real:
        return shared
    skipped = shared - ran[cp_rank]
    own_branch = ran[cp_rank] - set().union(*(ran[r] for r in real))
    return shared & ran[cp_rank] if len(own_branch) >= len(skipped) else shared


def check_layers_ran(arm: Arm, required: set[str], ran: Execution, plan=None) -> list[Finding]:
    """The tower ran on this rank: on some row, and through every layer ``required`` (required_layers); known from
    the forward alone, so no gradient is needed. A failure says what this rank read (``arm.telemetry.read``) and
    ran, and what ``plan`` (the implementation's, where it states one that held) gave it."""
    skipped, rows = sorted(required - ran.ran()), arm.telemetry.read
    if not ran.ran():
        read = f"read rows {rows}" if rows else "read no row"
        never = f"; layers never run: {', '.join(skipped[:3])}" if skipped else ""
        return found(FAILURE, arm.rank, f"execution: {arm.whose} {read} and ran no layer of its tower "
                                        f"({_given(plan, arm.cp_rank)}{never}); every rank must run its tower, "
                                        f"placeholders included")
    if not skipped:
        return []
    return found(FAILURE, arm.rank, f"execution: {arm.whose} skipped {len(skipped)} layer(s) that every rank holding "
                                    f"real rows ran ({', '.join(skipped[:3])}); a rank must run its whole tower, "
                                    f"placeholders included")


def _given(plan, cp_rank: int) -> str:
    """What the implementation's plan gives a rank, in words."""
    if plan is None:
        return "no plan says what it holds"
    rows = plan.rows_of(cp_rank)
    placeholders = plan.placeholders[cp_rank] if cp_rank < len(plan.placeholders) else 0
    return (f"its plan gives it {f'rows {rows}' if rows else 'no row'} and "
            f"{placeholders or 'no'} placeholder{'' if placeholders == 1 else 's'}")


def check_param_grads_exist(arm: Arm, given: list[bool], required: set[str], layers: list[str]) -> list[Finding]:
    """Every parameter the unsharded run gives a gradient (``given``, one flag a parameter) has one in
    ``arm.model`` (a skipped tower leaves them None, which summing would read as zeros), where its layer is
    ``required`` on this rank; a parameter outside every layer Execution watches (the root's own) always."""
    watched = set(layers)
    missing = [name for (name, p), g in zip(arm.model.named_parameters(), given)
               if g and p.grad is None and (_layer_of(name) in required or _layer_of(name) not in watched)]
    if not missing:
        return []
    return found(FAILURE, arm.rank, f"execution: {arm.whose} has no gradient for {len(missing)} parameter(s) the "
                                    f"unsharded run gives one ({', '.join(missing[:3])})")


def _layer_of(parameter: str) -> str:
    """The module that holds a parameter itself, by its name ("blocks.0.attn.qkv.weight" -> "blocks.0.attn.qkv")."""
    return parameter.rpartition(".")[0]
