"""Whose rows are this rank's own: the loss weights under which its own parameter gradients equal the unsharded
ones, its token rows, its media items, and vdpcp's own deal of whole media items where no plan says."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vdpcp.contract.protocol import Ownership


def owned_weight(plan, sharded: bool, weights, cp_rank: int, device) -> torch.Tensor | None:
    """The weights under which this rank's parameter gradients alone equal the unsharded ones: with sharding,
    the gather hands each rank the summed gradient of its own images' rows (None without a plan to say which
    rows are its own); without sharding, its own loss's."""
    if not sharded:
        return weights[cp_rank]
    if plan is None:
        return None
    own_weight = torch.zeros_like(weights[0])
    rows = own_token_mask(plan, cp_rank, device)
    own_weight[rows] = sum(weights)[rows]
    return own_weight


def own_token_mask(plan, rank: int, device) -> torch.Tensor:
    """Rows of the gathered features (in image order) that come from this rank's real images."""
    return torch.tensor(plan.own_tokens(rank), dtype=torch.bool, device=device)


def own_media(plan, spec, rank: int) -> tuple[str, ...] | None:
    """Per media item of ``spec``, whether its rows are all this rank's own in ``plan``, none, or some (None
    without a plan that covers the microbatch): the exact run's chunks keep them apart (rounding.measure)."""
    if plan is None or len(plan.owner) != len(spec.images):
        return None
    rows = spec.media_rows
    kinds = ({plan.owner[row] == rank for row in range(rows[m], rows[m + 1])} for m in range(len(rows) - 1))
    return tuple("own" if kind == {True} else "other" if kind == {False} else "mixed" for kind in kinds)


def dealt_ownership(impl, spec, out: dict[str, torch.Tensor], group) -> Ownership | None:
    """Where a sharded case has no plan but the implementation says how many output rows each media item gives
    (``media_tokens``), an ownership of vdpcp's own for sharing out the rounding measurement: whole media items in
    contiguous runs of about equal patches (any deal would do: each item is measured once, by one rank). None where
    the implementation does not say. Every rank deals alike (the same spec and sizes)."""
    tokens = impl.media_tokens(spec)
    if tokens is None or not spec.media_frames:
        return None
    rows = next(iter(out.values())).shape[0]
    if len(tokens) != len(spec.media_frames) or sum(tokens) != rows:
        raise ValueError(f"{impl.name}.media_tokens: {list(tokens)} ({sum(tokens)} rows over {len(tokens)} media "
                         f"items); its unsharded encode returned {rows} rows over {len(spec.media_frames)}")
    cp, first = dist.get_world_size(group), spec.media_rows
    patches = [sum(spec.row_patches[first[m] : first[m + 1]]) for m in range(len(tokens))]
    middles = [sum(patches[:m]) + patches[m] / 2 for m in range(len(patches))]  # an item goes where its middle lies
    dealt = [min(cp - 1, int(middle * cp // max(sum(patches), 1))) for middle in middles]
    rows_of = [range(first[m], first[m + 1]) for m in range(len(tokens))]
    return Ownership(tuple(dealt[m] for m in range(len(tokens)) for _ in rows_of[m]),
                     tuple(tokens[m] if row == first[m] else 0 for m in range(len(tokens)) for row in rows_of[m]),
                     (0,) * cp)  # an item's rows on its first row, as a plan's tokens
