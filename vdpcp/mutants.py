"""Named mutants of the sharded path: plausible bugs the matrix must catch.

A mutant is a set of monkeypatches over vdpcp's own modules (never MCore's), applied inside every rank for
the duration of one case, so the reference code itself stays clean. ``vdpcp mutants`` runs the matrix
against each and reports which case killed it.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # the plausible bug, in one sentence
    patches: Callable[[], dict[str, object]]  # "module:attr" -> replacement, built lazily inside the rank


MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, bug: str):
    def register(patches):
        MUTANTS[name] = Mutant(name, bug, patches)
        return patches

    return register


@contextmanager
def applied(name: str | None):
    """Apply the named mutant's patches for the duration of the block (no-op for None)."""
    if name is None:
        yield
        return
    if name not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {sorted(MUTANTS)}")
    saved = []
    try:
        for target, replacement in MUTANTS[name].patches().items():
            module_name, attr = target.split(":")
            module = importlib.import_module(module_name)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, replacement)
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)


@mutant("grad-not-summed", "the gather's backward keeps only this rank's own gradient instead of summing over ranks")
def _grad_not_summed():
    import torch.distributed as dist

    from vdpcp import comm

    class NoSum(comm._GatherFeatures):
        @staticmethod
        def backward(ctx, grad):
            start = sum(ctx.counts[: ctx.rank])
            local_grad = grad.new_zeros(ctx.local_rows, *grad.shape[1:])
            local_grad[: ctx.counts[ctx.rank]] = grad[start : start + ctx.counts[ctx.rank]]
            return local_grad, None, None

    def gather(local, counts, group=None):
        assert len(counts) == dist.get_world_size(group)
        return NoSum.apply(local, list(counts), group)

    return {"vdpcp.sharded:gather_features": gather}


@mutant(
    "placeholder-drop-mismatch",
    "the gather drops one placeholder output fewer than the plan injected, so a placeholder's features reach the language model",
)
def _placeholder_drop_mismatch():
    from vdpcp import sharded
    from vdpcp.model import output_tokens

    real_tokens = sharded.real_tokens

    def kept_tokens(plan):
        counts = real_tokens(plan)
        if plan.num_placeholders:  # placeholders sit at the end, on the last rank: keep one of them
            counts[-1] += output_tokens((1, 1))
        return counts

    return {"vdpcp.sharded:real_tokens": kept_tokens}
