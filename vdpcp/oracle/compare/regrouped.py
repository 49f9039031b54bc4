"""The regrouped reference: each CP rank held to an unsharded encode of exactly the media it encoded.

The whole-microbatch comparison (vdpcp.oracle) has to allow for rounding: at the size people train, a row's
features depend on what else is in its batch (other GEMM shapes pick other kernels), so the sharded run is only
close to the unsharded one. Here each rank's own work is redone in the same grouping: the implementation's own
unsharded ``encode`` on a microbatch of exactly the rows this rank's tower read (in microbatch order, a media
item's frames kept together), on the same model, dtype and device. Same shapes, same kernels: a correct
implementation is then bitwise equal, in

- outputs: this rank's gathered token rows of its own media against the regrouped run's outputs;
- input grads, where the pixels' gradients are compared (vdpcp.oracle.pixel_grads): this rank's gradient of its
  own rows' patches against the regrouped run's;
- parameter grads: this rank's own gradients against the regrouped run's, given the gradient its rows received,
  which the gather's backward makes the SUM over CP ranks of their loss weights on those rows. The loss weights
  (vdpcp.feature.loss.loss_weights) are sixteenths under 2, so that sum is exact in any order and any dtype: whichever
  order a collective adds them in, every rank's rows receive the same bits.

Two things make a correct run round apart from the regrouped one, and are held within EXTRA_ROWS_ULPS units of the
dtype's rounding instead: rows its tower took besides its media (padding frames: other GEMM shapes), and an output
computed from another after the gather (``derived_outputs``: the ranks' gradients are then summed after that
computation). The gradients are exact only where the backward is deterministic (vdpcp.oracle.compare.determinism:
always on the CPU, on CUDA under strict deterministic algorithms). Where that is off, or the tower runs an op with
no deterministic kernel, the gradients are left to the whole-microbatch checks and the outputs alone are held
exactly (the forward is bitwise repeatable by itself: docs/precision.md).

Which rows a rank encoded and where their tokens are in the gathered features come from the implementation's
plan; without one, from the read table (which rows reached each rank's tower), provided each rank's rows are one
contiguous run (the ranks' token counts, summed over the CP group, then place them). Otherwise nothing is held
here and ``RankResult.exact`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from vdpcp.contract.protocol import outputs_of
from vdpcp.feature import comm, loss
from vdpcp.feature.grads import grad_or_zeros, or_zeros
from vdpcp.feature.spec import Microbatch, MicrobatchSpec
from vdpcp.matrix.case import FAILURE, Finding
from vdpcp.oracle.compare import precision
from vdpcp.oracle.compare.determinism import exact_grads
from vdpcp.oracle.context import Arm, Sharded
from vdpcp.oracle.failures import found
from vdpcp.oracle.observe.execution import Execution

# Where a rank's tower took rows besides its media (padding frames, say), its GEMMs had other shapes than the
# regrouped run's: a few units of rounding apart, well inside this.
EXTRA_ROWS_ULPS = 16
BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bits as an integer of its width
MASK, FINGERPRINT_SEED = 2**48 - 1, 35


@dataclass
class Mine:
    """This rank's own media: microbatch rows (ascending) and their token rows in the gathered features."""

    rows: list[int]
    tokens: torch.Tensor | None  # indices into the gathered outputs; None: not known, and ``why``
    why: str = ""


def mine(plan, read: torch.Tensor, cp_rank: int, cp_group, counts_of) -> Mine:
    """This rank's rows and their token rows: by the plan, or (without one) by the read table, each rank's rows
    one contiguous run placed by every rank's token count (``counts_of(rows)``: this rank's; a collective)."""
    if plan is not None:
        rows = plan.rows_of(cp_rank)
        start = [0]
        for n in plan.tokens:
            start.append(start[-1] + n)
        return Mine(rows, _spans([(start[r], start[r + 1]) for r in rows]))
    runs = [read[r].nonzero().flatten().tolist() for r in range(read.shape[0])]
    rows = runs[cp_rank]
    if any(run and run[-1] - run[0] + 1 != len(run) for run in runs):  # the same on every rank: no collective
        return Mine(rows, None, "no plan, and a rank's rows are not one contiguous run")
    counts = torch.zeros(read.shape[0], dtype=torch.float64, device=read.device)
    counts[cp_rank] = counts_of(rows)
    counts = comm.all_reduce_sum(counts, cp_group)
    if (counts < 0).any():
        return Mine(rows, None, "a rank's own rows could not be encoded unsharded")
    first = sorted((run[0], r) for r, run in enumerate(runs) if run)
    start = sum(int(counts[r]) for row, r in first if rows and row < rows[0])
    return Mine(rows, torch.arange(start, start + int(counts[cp_rank])))


def _spans(spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in spans]) if spans else torch.zeros(0, dtype=torch.long)


def sub_spec(spec: MicrobatchSpec, rows: list[int]) -> MicrobatchSpec:
    """The microbatch of exactly ``rows`` (ascending): each run of a media item's frames stays one media item."""
    media = [m for m in range(len(spec.media_frames)) for _ in range(spec.media_frames[m])]
    frames: list[int] = []
    for i, row in enumerate(rows):
        if i and row == rows[i - 1] + 1 and media[row] == media[rows[i - 1]]:
            frames[-1] += 1
        else:
            frames.append(1)
    return replace(spec, images=tuple(spec.images[r] for r in rows),
                   num_frames=tuple(frames) if spec.num_frames is not None else None, name=f"{spec.name}-regrouped")


def sub_batch(batch: Microbatch, rows: list[int]) -> Microbatch:
    """Those rows' patches as a leaf of their own (the same values, needing a gradient where ``batch``'s do: pixels
    are data unless the implementation says otherwise), with the sub-spec's metadata."""
    cu = [int(c) for c in batch.cu_seqlens]
    picked = patch_index(cu, rows).to(batch.patches.device)
    spec = sub_spec(batch.spec, rows)
    device = batch.device  # the tower's (a loader's pixels are on the host)
    bounds = torch.tensor([0, *spec.row_patches], device=device).cumsum(0).to(torch.int32)
    return Microbatch(spec, batch.patches.detach()[:, picked].clone().requires_grad_(batch.patches.requires_grad),
                      torch.tensor(spec.images, dtype=torch.int64, device=device).reshape(-1, 2), bounds)


def patch_index(cu: list[int], rows: list[int]) -> torch.Tensor:
    return _spans([(cu[r], cu[r + 1]) for r in rows])


def hold(run: Sharded, grads: bool, pixels: bool = False) -> list[Finding]:
    """Hold this rank's outputs (and, with ``grads`` and an exact backward, its parameter gradients, and with
    ``pixels`` its input gradients) to the regrouped run of its own media: its failures, and what was held in the
    arm's ``telemetry.exact``."""
    arm, out, figures = run.arm, run.out, run.arm.telemetry
    said = _same_copies(arm, out)
    own, encoded = _own_media(run)
    whose = f"{arm.whose}'s own rows {_rows(own.rows)}"
    if "error" in encoded:
        return said + found(FAILURE, arm.rank, f"exact (regrouped): {whose} could not be encoded unsharded: "
                                               f"{encoded['error']}")
    if own.tokens is None or not own.rows:
        figures.exact = f"not held: {own.why or 'no media of its own (placeholders only)'}"
        return said
    sub, ref_out = encoded["run"]
    # Rows its tower took besides its media (placeholders, padding frames) change the GEMM shapes: not bitwise then.
    extra = figures.encoded - encoded["rows"] if figures.encoded >= 0 else 0
    ulps = EXTRA_ROWS_ULPS if extra > 0 else 0
    tokens = own.tokens.to(next(iter(out.values())).device)
    length = next(iter(out.values())).shape[0]
    if tokens.numel() and int(tokens.max()) >= length:  # a stated plan that is not what ran (a stale split, say)
        return said + found(FAILURE, arm.rank, f"exact (regrouped): {whose} sit at tokens {int(tokens.min())}.."
                                               f"{int(tokens.max())} by its plan, past the {length} rows of the "
                                               f"gathered outputs")
    for name, expected in ref_out.items():
        got = out[name].detach().index_select(0, tokens) if name in out else None
        said += found(FAILURE, arm.rank, _exact(f"outputs{'' if len(ref_out) == 1 else f' {name!r}'}", whose, got,
                                                expected.detach(), ulps))
    held = "outputs"
    derived = derived_outputs(out) if grads else []
    if derived:  # their ranks' gradients were summed after that computation, in another order than any regrouped run
        ulps = max(ulps, EXTRA_ROWS_ULPS)
    if grads and exact_grads(figures):
        received = {name: sum(w)[tokens] for name, w in run.ref.weights.items()}  # the gather's backward: the sum
        repeated, off = _hold_grads(run, whose, sub, ref_out, received, own.rows, ulps, pixels)
        said += off
        if repeated:
            held = f"outputs, {'input and ' if pixels else ''}parameter gradients"
    why = [f"its tower took {extra} rows besides its media"] if extra > 0 else []
    why += [f"output {a!r} is computed from {b!r} after the gather" for a, b in derived[:1]]
    how = f"within {ulps} units of rounding ({'; '.join(why)})" if ulps else "bitwise"
    figures.exact = f"{held} {how}, rows {_rows(own.rows)}" + (
        "" if held != "outputs" or not grads else f"; gradients not (deterministic: {figures.deterministic})")
    return said


def _own_media(run: Sharded) -> tuple[Mine, dict]:
    """This rank's own media (mine) and their regrouped run: ``encoded`` holds the run, the rows its tower took,
    or the error it raised (said by the caller; the count still goes out, so no rank waits on this one)."""
    arm, encoded = run.arm, {}

    def counts_of(rows: list[int]) -> int:
        if not rows:
            return 0  # nothing of its own: no encode (an empty microbatch is a limit of some towers)
        try:
            with Execution(arm.model) as ran:  # the rows the regrouped run's tower takes
                encoded["run"] = _encode(arm.impl, arm.model, run.batch, rows)
            encoded["rows"] = ran.rows
        except Exception as err:
            encoded["error"] = f"{type(err).__name__}: {err}"
            return -1
        return next(iter(encoded["run"][1].values())).shape[0]

    own = mine(run.plan, run.read, arm.cp_rank, arm.cp_group, counts_of)
    if own.rows and own.tokens is not None and not encoded:
        counts_of(own.rows)
    return own, encoded


def _hold_grads(run: Sharded, whose: str, sub, ref_out, received, rows, ulps: int,
                pixels: bool) -> tuple[bool, list[Finding]]:
    """This rank's parameter (and, with ``pixels``, input) gradients against the regrouped run's, given the gradient
    its rows received: whether they were held (not: the regrouped backward does not repeat itself bit for bit), and
    the failures."""
    figures, batch, rank = run.arm.telemetry, run.batch, run.arm.rank
    named = list(run.arm.model.named_parameters())
    params = [p for _, p in named]
    merged = loss.features_loss(ref_out, received)  # the case's merged loss, as the tower sees it
    inputs = [sub.patches] if pixels else []
    want = torch.autograd.grad(merged, [*inputs, *params], allow_unused=True, retain_graph=True)
    picked = patch_index([int(c) for c in batch.cu_seqlens], rows).to(batch.patches.device) if pixels else None
    got = ([grad_or_zeros(batch.patches)[:, picked]] if pixels else []) + [grad_or_zeros(p) for p in params]
    # Not equal: the same backward again, since where it does not repeat itself bit for bit no bitwise verdict on
    # gradients is fair (they are left to the other checks). Only then, so a correct run pays for one backward.
    same = within_ulps(got, or_zeros(want, [*inputs, *params]), ulps)
    if not (same or _repeats(want, torch.autograd.grad(merged, [*inputs, *params], allow_unused=True))):
        figures.deterministic = f"{figures.deterministic}, but the regrouped run's backward did not repeat itself"
        return False, []
    if same and ulps == 0:  # bitwise all together is bitwise each; else each part is judged alone
        return True, []
    lines = [_exact("input grads", whose, got[0], want[0], ulps)] if pixels else []
    return True, found(FAILURE, rank, *lines, _exact_params(whose, named, want[len(inputs):], ulps))


def derived_outputs(out: dict, reach: int = 64) -> list[tuple[str, str]]:
    """(output, output it is computed from) where one output's graph passes through another's within ``reach``
    autograd nodes: computed after the gather (a tanh of the gathered features, say), so the gather's backward sums
    the ranks' gradients after that computation, where a regrouped run can only sum them before it."""
    found = []
    for name, t in out.items():
        seen, frontier = set(), [t.grad_fn] if t.grad_fn is not None else []
        while frontier and len(seen) < reach:
            node = frontier.pop()
            if node in seen:
                continue
            seen.add(node)
            frontier += [n for n, _ in node.next_functions if n is not None]
        found += [(name, other) for other, u in out.items() if other != name and u.grad_fn in seen - {t.grad_fn}]
    return found


def _same_copies(arm: Arm, out) -> list[Finding]:
    """Every CP rank's gathered copy of every output is the same bits (a gather copies, it does not compute): with
    each rank's own rows held to its regrouped run, every row of every copy is then its owner's exact result."""
    cp = dist.get_world_size(arm.cp_group)
    prints = torch.zeros(len(out), cp, dtype=torch.float64, device=next(iter(out.values())).device)
    for i, t in enumerate(out.values()):
        prints[i, arm.cp_rank] = fingerprint(t.detach())
    prints = comm.all_reduce_sum(prints, arm.cp_group)
    said = []
    for (name, _), row in zip(out.items(), prints):
        if row[arm.cp_rank] != row[0]:  # said by the rank whose copy is not rank 0's
            what = f"outputs{'' if len(out) == 1 else f' {name!r}'}"
            said += found(FAILURE, arm.rank, f"exact (regrouped): {what}: {arm.whose}'s gathered copy is not "
                                             f"bitwise CP rank 0's (a gather copies)")
    return said


def fingerprint(t: torch.Tensor) -> float:
    """The bits of ``t`` hashed to an integer under 2**48 (a float64 holds it, and CP of them sum exactly): bitwise
    equal tensors print alike, and a change in any one element moves the print (its low 48 bits and the rest each
    times an odd weight, which is invertible modulo 2**48)."""
    if t.numel() == 0:
        return 0.0
    bits = t.contiguous().reshape(-1).view(BITS[t.element_size()]).to(torch.int64)
    gen = torch.Generator(device=bits.device).manual_seed(FINGERPRINT_SEED)
    low, high = (torch.randint(0, 2**20, bits.shape, generator=gen, device=bits.device) * 2 + 1 for _ in range(2))
    mixed = (bits & MASK) * low + ((bits >> 48) & 0xFFFF) * high  # int64 products wrap modulo 2**64, a multiple of 2**48
    return float(mixed.sum().item() & MASK)


def _encode(impl, model, batch, rows):
    sub = sub_batch(batch, rows)
    with torch.enable_grad():
        return sub, outputs_of(impl.encode(model, impl.inputs(sub)), f"{impl.name}.encode")


def _exact(what: str, whose: str, got, expected, ulps: int) -> str | None:
    if got is None or got.shape != expected.shape:
        shape = "nothing" if got is None else f"shape {tuple(got.shape)}"
        return (f"exact (regrouped): {what} of {whose}: {shape}, an unsharded encode of exactly them gives "
                f"{tuple(expected.shape)}")
    if not within_ulps([got], [expected], ulps):
        return (f"exact (regrouped): {what} of {whose} differ from an unsharded encode of exactly them, same dtype "
                f"and grouping: relative 2-norm {precision.relative([got], [expected]):.3g}"
                f"{_allowed(got.dtype, ulps)}, max abs {precision.max_abs(got, expected):.3g}")
    return None


def _exact_params(whose: str, named, want, ulps: int) -> str | None:
    """Every parameter's gradient (as one vector within ``ulps``); the first one off is named."""
    params = [p for _, p in named]
    got = [grad_or_zeros(p) for p in params]
    want = or_zeros(want, params)
    if within_ulps(got, want, ulps):
        return None
    off = next(i for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w))
    return (f"exact (regrouped): parameter grads of {whose} differ from an unsharded encode of exactly them, given "
            f"the gradient its rows received (first: {named[off][0]}, of {len(params)}): relative 2-norm "
            f"{precision.relative(got, want):.3g}{_allowed(params[0].dtype, ulps)}")


def _repeats(first, second) -> bool:
    """Two backward passes of one graph gave the same bits (None where a parameter got no gradient, both times)."""
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(first, second))


def within_ulps(got: list, want: list, ulps: int) -> bool:
    """Bitwise (``ulps`` 0), or as one vector within ``ulps`` units of the dtype's rounding (relative 2-norm)."""
    if bitwise_equal(got, want):
        return True
    return ulps > 0 and precision.relative(got, want) <= ulps * torch.finfo(want[0].dtype).eps


def bitwise_equal(got: list, want: list) -> bool:
    """torch.equal of every pair, read with one wait for the device: a tower's hundreds of parameters compared one
    torch.equal at a time wait for the device hundreds of times."""
    if any(g.shape != w.shape or g.dtype != w.dtype or g.device != w.device for g, w in zip(got, want)):
        return all(torch.equal(g, w) for g, w in zip(got, want))
    differs: dict[torch.device, list[torch.Tensor]] = {}
    for g, w in zip(got, want):
        differs.setdefault(g.device, []).append(torch.ne(g, w).any())
    return not any(bool(torch.stack(flags).any()) for flags in differs.values())


def _allowed(dtype, ulps: int) -> str:
    return f" (allowed {ulps * torch.finfo(dtype).eps:.2g})" if ulps else " (expected bitwise)"


def _rows(rows: list[int]) -> str:
    return str(rows) if len(rows) <= 6 else f"[{rows[0]}..{rows[-1]}] ({len(rows)})"
