"""Which microbatch rows reached a tower, seen at the tower's input, whatever the grad mode.

Pixels are data: nothing asks them for a gradient, so what a rank's tower read cannot be learnt through autograd.
Each arm's patches are handed over as a forward-mode dual tensor (torch.autograd.forward_ad) whose tangent carries,
on every element of patch p, a code of p's microbatch row (an image or a video frame). The codes are powers of two
times 1 + k/128, so every code is exact in bfloat16, float32 and float64, and data movement keeps it bit for bit:
casts, reshapes, permutes, slicing, cat, clone, ``.type()``, under ``torch.no_grad`` too (a split that runs there
still passes its codes on). A dual tensor requires no grad, so a split that asserts its pixels need none passes.
A placeholder or padding row is made from nothing and carries a zero tangent: it names no row. A tubelet row that
holds two frames names both.

The tower's forward pre-hooks (vdpcp.oracle.Execution) read the codes off their inputs and hand the tower its
inputs without tangents, so forward-mode AD never runs inside it. ``.detach()`` and ``torch.inference_mode`` drop
tangents; for such a copy the unsharded arm's tower-input rows are an ``Index`` of their bytes (in the tower's
dtype) to the microbatch rows their codes named, which a row with no code is looked up in. Constant rows
(placeholders, zero padding) are never indexed, so they match nothing; a row that neither carries a code nor
matches counts as read by no one.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.autograd.forward_ad as fwAD

from vdpcp import third_party

STEPS = 128  # codes per power of two: 1 + k/STEPS needs 7 bits of mantissa, which bfloat16 has
PRINT_SEED = 49
MASK = 2**62 - 1
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def code(rows: torch.Tensor) -> torch.Tensor:
    """Microbatch row r's code: 2**(r // STEPS) * (1 + (r % STEPS) / STEPS), in float64."""
    rows = rows.to(torch.float64)
    return torch.exp2(torch.floor(rows / STEPS)) * (1 + torch.remainder(rows, STEPS) / STEPS)


def decode(values: torch.Tensor) -> torch.Tensor:
    """The microbatch row each value is the code of, or -1 where it is no code (zero: a placeholder's; anything
    else a computation made of codes rather than a move of them)."""
    values = values.to(torch.float64 if values.dtype == torch.float64 else torch.float32)  # every code is exact
    mantissa, exponent = torch.frexp(values)  # values = mantissa * 2**exponent, mantissa in [0.5, 1)
    k = (2 * mantissa - 1) * STEPS
    rows = (exponent.to(values.dtype) - 1) * STEPS + k
    ok = (values > 0) & (k == torch.round(k)) & (exponent >= 1)
    return torch.where(ok, rows, torch.full_like(rows, -1)).to(torch.int64)


def patch_rows(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The microbatch row of every patch of packed patches (cu_seqlens' segments)."""
    cu = cu_seqlens.to(torch.int64)
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1])


@contextmanager
def coded(batch):
    """``batch`` with its patches a dual tensor whose tangent holds each patch's row code (the same values, and the
    same leaf for autograd where the patches require grad), for an arm's encode; the tangents end with the block,
    and the outputs made inside it are plain tensors after."""
    rows = patch_rows(batch.cu_seqlens).to(batch.patches.device)
    codes = code(rows).to(batch.patches.dtype)
    if not torch.equal(decode(codes), rows):
        raise ValueError(f"vdpcp.oracle.observe.reads: {len(batch.cu_seqlens) - 1} microbatch rows have no exact code in "
                         f"{batch.patches.dtype} (codes reach 2**{(len(batch.cu_seqlens) - 2) // STEPS})")
    tangent = codes.reshape(1, -1, 1).expand(batch.patches.shape).contiguous()
    with fwAD.dual_level():
        yield replace(batch, patches=fwAD.make_dual(batch.patches, tangent))


def row_view(module: torch.nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as [rows, elements of one row], rows as vdpcp.oracle.input_rows counts them for ``module``: a
    convolution's kernel window over every input channel, else the last dimension."""
    if tensor.dim() == 0:
        return tensor.reshape(1, 1)
    per_row = tensor.shape[-1]
    if isinstance(module, CONVOLUTIONS):
        window = module.in_channels * math.prod(module.kernel_size)
        per_row = window if tensor.numel() % window == 0 else per_row
    return tensor.reshape(-1, max(per_row, 1))


def prints(rows: torch.Tensor) -> torch.Tensor:
    """One integer per row of a 2-D tensor from its bytes: rows with equal bits print alike, and a change in any
    element moves the print (each element's bits times an odd weight of its column, summed modulo 2**62)."""
    bits = rows.contiguous().view(BITS[rows.element_size()]).to(torch.int64)
    gen = torch.Generator(device=bits.device).manual_seed(PRINT_SEED)
    low, high = (torch.randint(0, 2**30, (bits.shape[1],), generator=gen, device=bits.device) * 2 + 1 for _ in range(2))
    mixed = (bits & (2**31 - 1)) * low + (bits >> 31) * high  # int64 products wrap modulo 2**64
    return mixed.sum(dim=1) & MASK


class Index:
    """The unsharded arm's tower-input rows by their bytes -> the microbatch rows their codes named, and the modules
    that took them: where a tower input carries no code (a detached or inference-mode copy), its rows are looked up
    here, at those modules only.

    ``learn`` keeps each input's prints and names on the device; they are read into ``rows`` (a Python dict, one
    entry per row) only when something is looked up or read: nearly every case's sharded arm carries its codes, and
    a real-size tower's input is tens of thousands of rows."""

    def __init__(self):
        self._rows: dict[tuple[int, int], frozenset[int]] = {}  # (row width, print) -> microbatch rows
        self._learnt: list[tuple[int, torch.Tensor, tuple]] = []  # (row width, prints, _names'), in learn order
        self.modules: set[str] = set()

    @property
    def rows(self) -> dict[tuple[int, int], frozenset[int]]:
        """(row width, print) -> the microbatch rows it names; where two rows print alike, the later learnt wins."""
        for width, keys, names in self._learnt:
            for key, rows in zip(keys.tolist(), _as_sets(*names)):
                self._rows[(width, key)] = rows
        self._learnt.clear()
        return self._rows

    def learn(self, name: str, primal: torch.Tensor, named: torch.Tensor) -> None:
        """``primal``: [rows, width] tower-input rows; ``named``: [rows, width] the microbatch row each element's
        code names (-1: none)."""
        coded = (named >= 0).any(dim=1) & ~constant(primal)
        if not bool(coded.any()):
            return
        self.modules.add(name)
        where = coded.nonzero().flatten()
        self._learnt.append((primal.shape[1], prints(primal.detach()[where]), _names(named[where])))

    def look_up(self, primal: torch.Tensor, uncoded: torch.Tensor) -> set[int]:
        """The microbatch rows that the ``uncoded`` rows of ``primal`` (a bool per row) hold, by their bytes."""
        where = (uncoded & ~constant(primal)).nonzero().flatten()
        known = self.rows  # read in once, not per row
        if not len(where) or not known:
            return set()
        found: set[int] = set()
        for key in prints(primal.detach()[where]).tolist():
            found |= known.get((primal.shape[1], key), frozenset())
        return found


def named_rows(named: torch.Tensor) -> list[frozenset[int]]:
    """Per row of ``named`` (the microbatch row each element's code names, -1: none; every row names one at
    least), the microbatch rows it names. A row that names one (an image's patch: nearly every row) is read off its
    least and greatest name; only the others (a tubelet's two frames) are sorted, and just their distinct names
    leave the device: a real-size tower's input is millions of elements, a Python int each when read whole."""
    return _as_sets(*_names(named))


def _names(named: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """named_rows' work on the device, in a row or so of integers per row: each row's least name, and for the rows
    that name several, (row, name) pairs of their distinct names."""
    none = torch.iinfo(torch.int64).max
    least = torch.where(named >= 0, named, torch.full_like(named, none)).amin(dim=1)
    several = (least != named.amax(dim=1)).nonzero().flatten()
    ordered = named[several].sort(dim=1).values
    distinct = ordered >= 0
    distinct[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    at, col = distinct.nonzero().unbind(1)
    return least, several[at], ordered[at, col]


def _as_sets(least: torch.Tensor, rows: torch.Tensor, names: torch.Tensor) -> list[frozenset[int]]:
    """named_rows' sets from _names' integers, read off the device."""
    found = [frozenset((r,)) for r in least.tolist()]
    several: dict[int, set[int]] = {}
    for i, r in zip(rows.tolist(), names.tolist()):
        several.setdefault(i, set()).add(r)
    for i, rows_named in several.items():
        found[i] = frozenset(rows_named)
    return found


def constant(rows: torch.Tensor) -> torch.Tensor:
    """Per row of a 2-D tensor, whether every element equals its first (a placeholder's or zero padding's rows)."""
    return (rows == rows[:, :1]).all(dim=1) if rows.shape[1] else torch.ones(rows.shape[0], dtype=torch.bool,
                                                                             device=rows.device)


def seen(module: torch.nn.Module, name: str, tensor: torch.Tensor, index: Index | None, learn: bool) -> tuple[torch.Tensor, set[int]]:
    """One input of a tower's module: (the input without its tangent, the microbatch rows it holds). Rows carry
    their codes; with ``index``, the rows that carry none are looked up in it (``learn``: the rows that carry codes
    are added to it instead)."""
    primal, tangent = fwAD.unpack_dual(tensor)
    look = index is not None and not learn and name in index.modules
    if tangent is None:  # the tensor itself, not a view of its primal: a module's input stays the object it was
        if not look:
            return tensor, set()
        rows = row_view(module, tensor.detach())
        return tensor, index.look_up(rows, torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device))
    rows = row_view(module, primal.detach())
    named = decode(row_view(module, tangent.detach()))
    read = set(torch.unique(named[named >= 0]).tolist())
    if index is not None and learn:
        index.learn(name, rows, named)
    elif look:
        read |= index.look_up(rows, ~(named >= 0).any(dim=1))
    return primal, read


def _warm_forward_ad() -> None:
    """One dual tensor, made and dropped: forward-mode AD loads what it needs at a process's first (torch 2.6 to
    2.14: decompositions it scripts), so a rank zygote that preloads vdpcp (its runner imports this module) pays
    that once, where each worker forked from it paid it at its first coded case (docs/performance.md has the
    figures). torch 2.14's notice that its own torch.jit.script use is deprecated, which every rank echoed, is
    dropped."""
    with warnings.catch_warnings():
        third_party.ignore_jit_deprecation()
        with fwAD.dual_level():
            fwAD.make_dual(torch.zeros(()), torch.zeros(()))


_warm_forward_ad()
