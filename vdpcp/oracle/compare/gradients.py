"""The gradient checks: pixel gradients summed over ranks and on each row's owner alone, parameter gradients summed
over ranks (in buckets, or as count sketches for a real-size tower) and on this rank alone, and the text stream's
gradient bit for bit."""

from __future__ import annotations

import math

import torch

from vdpcp.feature import comm, loss
from vdpcp.feature.grads import grad_or_zeros
from vdpcp.matrix.case import FAILURE, Finding
from vdpcp.oracle.compare import precision, sketch
from vdpcp.oracle.context import Arm, Sharded
from vdpcp.oracle.failures import found, label
from vdpcp.oracle.observe.split import ranks_reading


def _pixel_grad(batch) -> torch.Tensor:
    """The pixels' gradient on the tower's device (a loader's pixels are on the host)."""
    return grad_or_zeros(batch.patches).to(batch.device)


def pixel_extra(batch, ref_batch, cp: int, cp_rank: int, owned: bool) -> list[torch.Tensor]:
    """What the input-gradient checks sum over the CP group with the parameter gradients: whether this rank's sharded
    pixels and its unsharded ones got a gradient, the sharded gradient, and (owned) which rows it is non-zero on."""
    has = [float(batch.patches.grad is not None), float(ref_batch.patches.grad is not None)]
    grad = _pixel_grad(batch)
    return [torch.tensor(has, dtype=torch.float64, device=grad.device), grad] + (
        [_holding(batch, grad, cp, cp_rank)] if owned else [])


def not_carried(flags: torch.Tensor) -> str:
    """Why the pixel gradients are not compared (RankResult.input_grads), or "" where they are: some rank's sharded
    pixels got one, and the unsharded ones did (``flags``: pixel_extra's, summed over the CP group)."""
    sharded, unsharded = (int(f) for f in flags.tolist())
    if sharded and unsharded:
        return ""
    if not sharded:
        return "no CP rank's sharded pixels got a gradient"
    return "the unsharded encode's pixels got no gradient"


def check_input_grads(run: Sharded, summed: list[torch.Tensor]) -> list[Finding]:
    """The pixel gradients: summed over the CP ranks against the unsharded ones, and (owned) each row's on exactly
    its owner, equal there. ``summed``: pixel_extra's gradient and holders, summed over the CP group."""
    batch, ref, arm = run.batch, run.ref, run.arm
    grad, ref_grad = _pixel_grad(batch), _pixel_grad(ref.batch)
    said = found(FAILURE, arm.rank, _compare_images(arm, "input grads (summed over ranks)", summed[0], ref_grad,
                                                    batch.cu_seqlens, range(len(batch.cu_seqlens) - 1),
                                                    ref.rounding.input))
    if run.owned:
        said += _check_ownership(arm, batch, grad, ref_grad, run.plan, run.read, summed[1], ref.rounding.input)
    return said


def _holding(batch, grad, cp: int, cp_rank: int) -> torch.Tensor:
    """[CP ranks, rows]: 1 in this rank's line where its input gradient for a microbatch row is non-zero (summed
    over ranks, which ranks hold each row's gradient)."""
    cu = [int(c) for c in batch.cu_seqlens]
    nonzero = torch.zeros(cp, len(cu) - 1, dtype=torch.float64, device=grad.device)
    for row in range(len(cu) - 1):
        nonzero[cp_rank, row] = float(bool(grad[:, cu[row] : cu[row + 1]].any()))
    return nonzero


def _check_ownership(arm: Arm, batch, grad, ref_grad, plan, read, holders, slack) -> list[Finding]:
    """Every image row's gradient is non-zero on exactly one rank, its owner (the plan's, or the one rank whose
    tower read it), and equals the unsharded one there. ``holders``: _holding summed over the CP ranks;
    ``slack``: per microbatch row, as the unsharded run measured it (rounding.Rounding.input; None in float64)."""
    cu = [int(c) for c in batch.cu_seqlens]
    rows, cp = len(cu) - 1, holders.shape[0]
    wrong = []
    for row in range(rows):
        ranks = [r for r in range(cp) if holders[r, row] > 0]
        readers = ranks_reading(read, row)
        expected = [plan.owner[row]] if plan is not None else readers if len(readers) == 1 else None
        if len(ranks) != 1 or (expected is not None and ranks != expected):
            wrong.append(f"row {row} on ranks {ranks}" + (f" (encoded on rank {expected[0]})" if expected else ""))
    said = []
    if wrong and arm.cp_rank == 0:  # said once: every rank sees the same table
        said = found(FAILURE, arm.rank, f"input grads: an image's gradient must be non-zero on exactly its owner's "
                                        f"rank: {'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")
    mine = plan.rows_of(arm.cp_rank) if plan is not None else [
        row for row in range(rows) if holders[arm.cp_rank, row] > 0]
    return said + found(FAILURE, arm.rank, _compare_images(arm, "input grads (own images)", grad, ref_grad, cu, mine,
                                                            slack))


def _compare_images(arm: Arm, what: str, actual, expected, cu_seqlens, rows, slack) -> str | None:
    """The input gradients of microbatch ``rows``: element by element in float64, per image row below it; its
    largest element error into the arm's telemetry."""
    cu = [int(c) for c in cu_seqlens]
    rows = list(rows)
    picked = torch.cat([torch.arange(cu[r], cu[r + 1]) for r in rows]) if rows else torch.zeros(0, dtype=torch.long)
    picked = picked.to(actual.device)
    a, e = actual[:, picked], expected[:, picked]
    figures = arm.telemetry
    figures.input_grad_err = max(figures.input_grad_err, precision.max_abs(a, e))
    if not precision.low(actual.dtype):
        return precision.compare(what, a, e)
    sub_cu = [0]
    for r in rows:
        sub_cu.append(sub_cu[-1] + cu[r + 1] - cu[r])
    slack = slack[rows] if isinstance(slack, torch.Tensor) else None
    return precision.compare_rows(what, a, e, slack, "image", cu_seqlens=sub_cu, names=rows)


def check_param_grads(arm: Arm, expected, extra, slack, shares=None,
                      shares_sketch=None) -> tuple[list[torch.Tensor], list[Finding]]:
    """``arm.model``'s parameter gradients summed over ``arm.cp_group`` against ``expected`` (one per parameter, in
    order; None: the unsharded run gives none), in buckets of precision.BUCKET elements: one collective per bucket,
    the first also carrying the ``extra`` tensors to sum (returned summed, with the findings). float64 element by
    element (the first parameter off is named); below it as one vector within rtol + ``slack``. ``expected`` None:
    it is the sum over the group
    of each rank's ``shares`` (vdpcp.oracle.unsharded._sum_split), summed as sketches; ``shares_sketch``, where
    given, is this rank's shares already sketched, on this device and over the same parameters in order
    (rounding.Rounding.own_share_sketch)."""
    figures, group, dtype, said = arm.telemetry, arm.cp_group, arm.dtype, []
    params = [(name, p) for name, p in arm.model.named_parameters()]
    low = precision.low(dtype)
    if expected is None or (low and sketch.pays(sum(p.numel() for _, p in params))):
        return _check_sketched_param_grads(arm, expected, extra, slack, shares, shares_sketch)
    diff_sq = scale_sq = 0.0
    summed_extra = None
    for bucket in _buckets([p for _, p in params]) or [[]]:
        grads = [grad_or_zeros(p) for p in (params[i][1] for i in bucket)]
        parts = comm.all_reduce_sums((extra if summed_extra is None else []) + grads, group)
        if summed_extra is None:
            summed_extra, parts = parts[: len(extra)], parts[len(extra):]
        def pairs(bucket=bucket, parts=parts):  # a generator each time: a missing gradient's zeros one run at a time
            return ((params[i][0], got, expected[i] if expected[i] is not None else torch.zeros_like(got))
                    for i, got in zip(bucket, parts))

        if low:
            peak, bucket_diff_sq, bucket_scale_sq = precision.peak_and_norms(pairs())
            diff_sq, scale_sq = diff_sq + bucket_diff_sq, scale_sq + bucket_scale_sq
        else:
            peak = precision.max_abs_each(pairs())
        figures.param_grad_err = max(figures.param_grad_err, peak)
        if not low and not said:  # the first parameter off is named once, not every one after it
            said = found(FAILURE, arm.rank, precision.compare_each("param grads (summed over ranks)", pairs()))
    if low:
        said = found(FAILURE, arm.rank, precision.compare_vector("param grads (summed over ranks)", diff_sq, scale_sq,
                                                                 dtype, slack))
    return summed_extra, said


def _check_sketched_param_grads(arm: Arm, expected, extra, slack, shares=None,
                                shares_sketch=None) -> tuple[list[torch.Tensor], list[Finding]]:
    """check_param_grads for a tower with more parameters than vdpcp.oracle.compare.sketch.WIDTH, below float64: the ranks sum
    count sketches of their gradients, not the gradients, so |summed - expected| is an estimate (vdpcp.oracle.compare.sketch says
    how close) and no element-wise figure exists: ``param_grad_err`` is NaN, not measured (the report's "-").
    With ``shares`` (``expected`` None) the expected sketch is summed too, in the same collective: a sketch is
    linear, so the shares' sketches add up to the sketch of their sum, and its norm estimates the sum's."""
    params, group = list(arm.model.parameters()), arm.cp_group
    summed_extra = comm.all_reduce_sums(extra, group) if extra else []
    device = params[0].device
    if expected is None:
        if shares_sketch is not None:
            mine, want = sketch.sketch(((p.grad, None) for p in params), device)[0], shares_sketch
        else:
            mine, want = sketch.sketch(zip((p.grad for p in params), shares), device)
        diff, want = comm.all_reduce_sum(torch.stack([mine - want, want]), group).unbind()
        diff_sq, scale_sq = diff.square().sum().item(), want.square().sum().item()
    else:
        mine, want = sketch.sketch(zip((p.grad for p in params), expected), device)
        diff_sq = (comm.all_reduce_sum(mine, group) - want).square().sum().item()
        scale_sq = float(precision.read_once([e.double().square().sum() for e in expected if e is not None], sum))
    arm.telemetry.param_grad_err = math.nan
    return summed_extra, found(FAILURE, arm.rank, precision.compare_vector("param grads (summed over ranks)", diff_sq,
                                                                           scale_sq, arm.dtype, slack))


def check_text(arm: Arm, got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tokens, how: str,
               written: dict[str, torch.Tensor] | None = None) -> list[Finding]:
    """The prompt tables' gradients (vdpcp.feature.loss), bit for bit: they are the loss weights, odd sixteenths, exact in
    every dtype however ranks sum them. Which rows of the merged stream differ says where it was seen. ``written``:
    what the implementation's backward wrote into the gradient it was handed, as it would show in each table's
    (vdpcp.oracle.observe.handed.in_tables); a difference that is exactly that is the write's, reported as such already."""
    said = []
    for name, want in expected.items():
        if written is not None and bool(written[name].any()) and torch.equal(got[name], want + written[name]):
            continue  # the write explains it: one cause, one line
        a, e = got[name].index_select(0, tokens[name]), want.index_select(0, tokens[name])  # in stream order
        differ = a.ne(e).reshape(e.shape[0], -1).any(dim=1)
        if bool(differ.any()):
            rows = differ.nonzero().flatten().tolist()
            vision = [r for r in rows if loss.TEXT_BEFORE <= r < e.shape[0] - loss.TEXT_AFTER]
            said += found(FAILURE, arm.rank, (
                f"{label('text grads', name, expected)} ({how}): {arm.whose}'s "
                f"gradient of the text stream the outputs merge into differs from the unsharded run's in {len(rows)} "
                f"of {e.shape[0]} rows, {len(vision)} of them vision rows (max abs {precision.max_abs(a, e):.3g}): "
                f"a consumer of the merged stream's gradient saw it changed"))
    return said


def check_rank_alone(arm: Arm, expected, slack) -> list[Finding]:
    """This rank's own parameter gradients against its own share of the unsharded ones (no collective)."""
    figures, dtype = arm.telemetry, arm.dtype

    def pairs():  # a generator each time: a missing gradient's zeros one run at a time, never a tower's worth
        return ((name, grad_or_zeros(p), want)
                for (name, p), want in zip(arm.model.named_parameters(), expected))

    if precision.low(dtype):
        peak, diff_sq, scale_sq = precision.peak_and_norms(pairs())
        figures.param_grad_err = max(figures.param_grad_err, peak)
        return found(FAILURE, arm.rank, precision.compare_vector("param grads (this rank alone)", diff_sq, scale_sq,
                                                                 dtype, slack))
    figures.param_grad_err = max(figures.param_grad_err, precision.max_abs_each(pairs()))
    return found(FAILURE, arm.rank, precision.compare_each("param grads (this rank alone)", pairs()))


def _buckets(params) -> list[list[int]]:
    """Parameter indices in runs of at most precision.BUCKET elements (a larger parameter is a bucket alone)."""
    out, size = [], 0
    for i, p in enumerate(params):
        if not out or size + p.numel() > precision.BUCKET:
            out.append([])
            size = 0
        out[-1].append(i)
        size += p.numel()
    return out
