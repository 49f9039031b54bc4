"""Sized mutants: a planted perturbation of a chosen size, for measuring how small a bug each check catches.

Named ``<name>@<size>`` (``scale-rank-features@1e-3``); ``vdpcp bench sensitivity`` bisects the size. Each is a
wrapper around any implementation (as vdpcp.tools.mutants.interface's), planted on the LAST CP rank only (a bug on a
non-zero rank is the one a checker that looked at rank 0 alone would miss):

- scale-rank-features@eps: that rank's copy of every gathered output x (1 + eps);
- scale-rank-grad@eps: the gradient that rank's loss hands the gather's backward x (1 + eps), so every rank's
  own rows receive a gradient off by eps of that rank's share;
- nudge-token@eps: that rank's first token row of the main output + eps x its 2-norm (spread over the row);
- scale-image@eps: the tokens of the microbatch's first image in that rank's copy of the main output
  x (1 + eps) (from the implementation's plan: it does not apply to one without).

They are kept apart from MUTANTS (vdpcp.tools.mutants.registry.SIZED): the mutation hunts run the named bugs, each of which a correct check
must catch at any size; these are instruments, caught or not according to their size. Each counts the elements it
moved off their values on its rank (``planted``): below a dtype's spacing only a share of them moves, and at a small
enough size, or on a small enough tensor, none does; then nothing was planted, and no check could have caught it.
A moved element can still be rounded away after: a loss weight one step off, added in bf16 to the other ranks'
weights for its row by the gather's backward, is under the spacing of the larger sum.
"""

from __future__ import annotations

import math

from vdpcp.contract.protocol import MAIN_OUTPUT, outputs_of
from vdpcp.tools.mutants.interface import NOT_APPLICABLE, MutantDoesNotApply, Wrapped, cp_rank, gradient_changed
from vdpcp.tools.mutants.registry import sized

ROUNDING_SEED = 35  # the stochastic rounding's draws (scaled): the same bug every run


class Planted:
    """How many elements one case's sized mutant moved off their values on this rank (RankResult.telemetry.planted)."""

    def __init__(self):
        self.moved = 0

    def count(self, before, after):
        """``after``, having counted its elements that differ from ``before``."""
        self.moved += int((after.detach() != before.detach()).sum())
        return after


def planted(subject) -> int | None:
    """The elements ``subject``'s sized mutant moved on this rank in its case; None where it carries none."""
    return subject.planted.moved if isinstance(subject, Wrapped) and subject.planted is not None else None


def _on_last_rank(change):
    """``change(outputs, eps)`` on the last CP rank only."""
    import torch.distributed as dist

    def apply(outputs, config, group):
        return change(outputs) if cp_rank(group) == dist.get_world_size(group) - 1 else outputs

    return apply


def scaled(t, eps: float, planted: Planted | None = None):
    """``t`` x (1 + eps), by eps in expectation whatever the dtype (differentiably: ``rounded``); ``planted`` counts
    the elements that moved."""
    out = rounded(t.double() * (1 + eps), t.dtype)
    return out if planted is None else planted.count(t, out)


def rounded(exact, dtype):
    """``exact`` (float64) in ``dtype``, keeping its expected value. In float64 as it is. In bf16 and float32 rounding
    to nearest would plant nothing below half the dtype's spacing (bf16's is 2**-8 to 2**-7 of a value, so x (1 + 1e-3)
    rounds every element back to itself): each element goes up or down to a neighbour with the probability that keeps
    its expected value (stochastic rounding, seeded), so a size under the dtype's spacing moves that share of the
    elements by one step, as a bug inside a wider accumulation would. Its gradient passes through unchanged."""
    import torch

    if dtype == torch.float64:
        return exact
    digits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    value = exact.detach()
    step = torch.ldexp(torch.ones_like(value), torch.frexp(value)[1] - digits)  # the spacing at each value
    low = torch.floor(value / step) * step
    gen = torch.Generator().manual_seed(ROUNDING_SEED)
    up = torch.rand(value.shape, generator=gen, dtype=torch.float64).to(value.device) < (value - low) / step
    return (exact + (low + up * step - value)).to(dtype)


@sized("scale-rank-features", "the last CP rank's copy of every gathered output is x (1 + {eps})")
def _scale_rank_features(impl, eps: float):
    planted = Planted()
    return Wrapped(impl, _on_last_rank(lambda outputs: {n: scaled(t, eps, planted) for n, t in outputs.items()}),
                    planted=planted)


@sized("scale-rank-grad", "the gradient the last CP rank's loss hands the gather's backward is x (1 + {eps})")
def _scale_rank_grad(impl, eps: float):
    planted = Planted()
    return Wrapped(impl, _on_last_rank(
        lambda outputs: {n: gradient_changed(t, lambda g: scaled(g, eps, planted)) for n, t in outputs.items()}),
        planted=planted)


@sized("nudge-token", "the last CP rank's first token row of the main output is off by {eps} of its 2-norm")
def _nudge_token(impl, eps: float):
    import torch

    planted = Planted()

    def change(outputs):
        t = outputs[MAIN_OUTPUT]
        if t.shape[0] == 0:
            return outputs
        shift = float(t[0].detach().double().norm()) * eps / math.sqrt(t[0].numel())  # eps of the row's norm in all
        return {**outputs, MAIN_OUTPUT: torch.cat([planted.count(t[:1], rounded(t[:1].double() + shift, t.dtype)), t[1:]])}

    return Wrapped(impl, _on_last_rank(change), planted=planted)


@sized("scale-image", "the first image's tokens in the last CP rank's copy of the main output are x (1 + {eps})")
def _scale_image(impl, eps: float):
    import torch
    import torch.distributed as dist

    planted = Planted()

    def around(subject, model, inputs, config, group):
        spec = getattr(inputs, "spec", None)
        plan = subject.plan(spec, config) if spec is not None and config.shard_vision else None
        if config.shard_vision and plan is None:  # on every rank, before any collective
            raise MutantDoesNotApply(f"{NOT_APPLICABLE}: {subject.name}'s inputs carry no spec or it states no plan, "
                                     f"so which tokens are the first image's is not known")
        outputs = outputs_of(subject.encode_sharded(model, inputs, config, group), "encode_sharded")
        if not config.shard_vision or cp_rank(group) != dist.get_world_size(group) - 1:
            return outputs
        t, first = outputs[MAIN_OUTPUT], next((n for n in plan.tokens if n), 0)
        return {**outputs, MAIN_OUTPUT: torch.cat([scaled(t[:first], eps, planted), t[first:]])}

    return Wrapped(impl, around=around, planted=planted)
