"""Everything that crosses ranks goes through here: the autograd gather of projected features, the sums the
oracle takes over ranks, and the count of collectives a subject issued on its group.

The gather restores the global feature set, in image order, from uneven rank shards. Forward pads every
shard to the longest and all-gathers (gloo has no uneven list-form all_to_all, and a padded all_gather
works on gloo and NCCL alike), then keeps each rank's first ``counts[r]`` rows: placeholder outputs sit
after a rank's real rows, so they are dropped here. Backward hands each rank the SUM over ranks of the
gradient for its rows: every rank's loss reads the whole gathered tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_features(local: torch.Tensor, counts: list[int], group=None) -> torch.Tensor:
    """[local rows, D] on each rank -> [sum(counts), D] on every rank; counts[r] real rows of rank r."""
    if len(counts) != dist.get_world_size(group):
        raise ValueError(f"gather_features: {len(counts)} counts for a group of {dist.get_world_size(group)} ranks")
    return _GatherFeatures.apply(local, list(counts), group)


class _GatherFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, counts, group):
        rank = dist.get_rank(group)
        if local.shape[0] < counts[rank]:
            raise ValueError(f"gather_features: rank {rank} has {local.shape[0]} rows, expected at least {counts[rank]}")
        ctx.group, ctx.counts, ctx.rank, ctx.local_rows = group, counts, rank, local.shape[0]
        longest = max(counts)
        padded = local.new_zeros(longest, *local.shape[1:])
        padded[: counts[rank]] = local[: counts[rank]]
        shards = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(shards, padded.contiguous(), group=group)
        return torch.cat([s[:n] for s, n in zip(shards, counts)])

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # sum every rank's gradient for every row
        return _own_rows(ctx, grad), None, None


def _own_rows(ctx, grad: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a gradient for the whole gathered tensor, zero for its placeholder rows."""
    start = sum(ctx.counts[: ctx.rank])
    local_grad = grad.new_zeros(ctx.local_rows, *grad.shape[1:])
    local_grad[: ctx.counts[ctx.rank]] = grad[start : start + ctx.counts[ctx.rank]]
    return local_grad


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a tensor over ranks (out of place), accumulating in a wider type (accumulator) and rounding once to
    its dtype, as a trainer reduces low-precision gradients into float32 main grads; used to check summed
    gradients."""
    return all_reduce_sums([tensor], group)[0]


def accumulator(tensors: list[torch.Tensor]) -> torch.dtype:
    """What a sum over ranks accumulates in: float32 when every tensor is a 16-bit float, else float64. n 16-bit
    values summed in float32 are off by at most (n - 1) * 2**-24 of the magnitudes summed: for the 64 ranks of
    the largest layout, under 2**-18, against the 2**-9 the sum is then rounded by to its 16-bit dtype and the
    bf16 tolerance (vdpcp.oracle.compare.precision) on top. It sends half float64's bytes, and at the real size the parameter
    gradients' sum is a case's largest phase (docs/performance.md). float32 inputs keep float64, where the
    same bound (2**-47) stays far below float32's own rounding."""
    half = all(t.is_floating_point() and t.element_size() <= 2 for t in tensors)
    return torch.float32 if tensors and half else torch.float64


def all_reduce_sums(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """all_reduce_sum of each tensor (on one device), in one collective: on gloo a collective's cost hardly
    depends on its size once ranks outnumber cores, so sums taken at the same point go together."""
    wide = accumulator(tensors)
    flat = torch.cat([t.detach().reshape(-1).to(wide) for t in tensors])  # a copy: never reduced in place
    dist.all_reduce(flat, group=group)
    return [part.view(t.shape).to(t.dtype) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


class Collectives:
    """Counts the collectives issued on ``group`` while inside (``count``; 0 where it cannot be told: no process
    group, or a torch without the counter). Each c10d process group numbers the collectives issued on it, gloo's and
    NCCL's alike, whoever calls them (the subject's own dist.all_gather as much as an autograd gather): that number
    is read before and after, less those vdpcp's own stand-ins issued meanwhile (``own``: a running count, such as
    vdpcp.oracle.observe.gloo_collectives' swap keeps), so the count is the subject's calls alone. Collectives on another group
    (MCore's own CP group, say) are not seen; what each rank's tower read is (the oracle's read table)."""

    def __init__(self, group, own=lambda: 0):
        self.group, self.count = group, 0
        self.own = own  # how many collectives vdpcp's own stand-ins have issued so far: never the subject's

    def _number(self) -> int | None:
        if self.group is None or not dist.is_initialized():
            return None
        number = getattr(self.group, "_get_sequence_number_for_group", None)  # torch's own, since 1.10
        return number() if number is not None else None

    def __enter__(self) -> Collectives:
        self._start, self._own = self._number(), self.own()
        return self

    def __exit__(self, *exc) -> None:
        end = self._number()
        self.count = end - self._start - (self.own() - self._own) if None not in (self._start, end) else 0
