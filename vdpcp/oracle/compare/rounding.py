"""The rounding measure: what a case's own unsharded run measures of its own rounding, below float64, for the
tolerances vdpcp.oracle.compare.precision holds each quantity to.

- the unsharded run is repeated once in a higher precision (``EXACT``: float32 for bf16, float64 for float32), from
  the same weights, pixels and loss weights, with TF32 off (``highest_precision``): ``measure`` gives, for every
  compared quantity, ``slack`` = twice its relative distance from that exact run. A correct sharded run sums the
  same terms in another order, so it is about as far from exact as the unsharded one, and the two are at most
  about twice that apart.

TF32: the arms run with the precision the caller's torch is set to (torch's default: TF32 in cuDNN convolutions,
not in cuBLAS matmuls), since that is what training runs with. A float32 case's exact run (float64) has no TF32 to
turn off; a bf16 case's (float32) runs its matmuls and convolutions in TF32 on CUDA (``TF32_EXACT``): 11 significant
bits, accumulated in float32, against bf16's 8, so the exact run's own error is an eighth of the one it measures,
and on a GPU's tensor cores rather than its float32 units. Everywhere else the exact run turns TF32 off, so a float32
case's figure includes TF32's own rounding (the Qwen2.5-VL patch embedding is a Conv3d, far over float32's rtol
under TF32).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from vdpcp.contract.protocol import Ownership, outputs_of
from vdpcp.feature import comm, loss
from vdpcp.feature.grads import grad_or_zeros
from vdpcp.feature.pixels import as_tower_sees
from vdpcp.matrix.budget import EXACT_CHUNK
from vdpcp.oracle.compare import sketch
from vdpcp.oracle.compare.precision import relative, row_relative, segment_relative

EXACT = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}
# Arm dtypes whose exact run may take TF32 on CUDA: bf16 keeps 8 significant bits, TF32 11. Not float16 (11 bits, as
# TF32's: no finer than the run it would measure).
TF32_EXACT = frozenset({torch.bfloat16})


def exact_math(dtype: torch.dtype, device: torch.device):
    """The float32 math of the exact run for arms of ``dtype`` on ``device``: TF32 where it is still finer than the
    arms (TF32_EXACT, on CUDA), else full float32."""
    return highest_precision(tf32=dtype in TF32_EXACT and device.type == "cuda")


@contextmanager
def highest_precision(tf32: bool = False):
    """float32 matmuls and convolutions in full float32 (TF32 off in cuBLAS and cuDNN; with ``tf32``, on in both)
    for the block, then every setting as it was: the exact run must be as exact as it says, whatever the caller's
    training stack chose.

    torch >= 2.9 has its own switches (``fp32_precision``) beside the legacy flags, and a process that set TF32 through
    them cannot read the legacy flags (a RuntimeError: "a mix of the legacy and new APIs"), so there only the new
    switches are read and set."""
    newer = _fp32_switches()
    if newer:
        saved = [(api, api.fp32_precision) for api in newer]
        for api in newer:
            api.fp32_precision = "tf32" if tf32 else "ieee"
        try:
            yield
        finally:
            for api, value in saved:
                api.fp32_precision = value
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())
    matmul.allow_tf32 = cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def _fp32_switches() -> list:
    """torch's own float32 precision switches, where it has them (>= 2.9): cuBLAS matmuls, cuDNN convolutions and
    RNNs, and the math attention kernel where there is one for it."""
    backends = torch.backends
    found = [getattr(backends.cuda, "matmul", None), getattr(backends.cudnn, "conv", None),
             getattr(backends.cudnn, "rnn", None), getattr(backends.cuda, "math_sdp", None)]
    return [api for api in found if api is not None and hasattr(api, "fp32_precision")]


def in_effect(dtype: torch.dtype, device: torch.device) -> str:
    """The precision an arm really ran in, for the report: on CUDA, whether TF32 (float32) or reduced-precision
    reductions (bf16, fp16) were on."""
    name = str(dtype).removeprefix("torch.")
    if device.type != "cuda":
        return name
    matmul = torch.backends.cuda.matmul
    if dtype == torch.float32:
        conv, mm = _tf32_in_effect()
        return f"{name}, TF32 {'on' if conv else 'off'} in convolutions, {'on' if mm else 'off'} in matmuls"
    if dtype in (torch.bfloat16, torch.float16):
        reduced = getattr(matmul, f"allow_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_reduced_precision_reduction")
        return f"{name}, reduced-precision reductions {'on' if reduced else 'off'}"
    return name


def _tf32_in_effect() -> tuple[bool, bool]:
    """(TF32 in cuDNN convolutions, in cuBLAS matmuls): from torch's own switches where it has them (an op's "none"
    defers to its backend's, then to the global one), else from the legacy flags."""
    backends = torch.backends
    conv = getattr(backends.cudnn, "conv", None)
    if conv is None or not hasattr(conv, "fp32_precision"):
        return bool(backends.cudnn.allow_tf32), bool(backends.cuda.matmul.allow_tf32)

    def tf32(*chain) -> bool:
        values = [getattr(api, "fp32_precision", "none") for api in chain]
        return next((v for v in values if v != "none"), "ieee") == "tf32"

    return tf32(conv, backends.cudnn, backends), tf32(backends.cuda.matmul, backends.cuda, backends)


@dataclass(frozen=True)
class Rounding:
    """Slack (twice the unsharded run's relative distance from the exact run) for each compared quantity; empty
    where nothing is measured (float64)."""

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # per output, per token row
    input: torch.Tensor | None = None  # per microbatch row (image or frame); None where pixels are data
    params: float = 0.0  # the parameter gradients under the summed loss
    own_params: float = 0.0  # this rank's own share of them (the rank-alone check)
    # this rank's own share of the summed loss's gradients as the shared exact run sketched them (Shared.share_sketch)
    share_sketch: torch.Tensor | None = None

    def own_share_sketch(self, tp: int, device) -> torch.Tensor | None:
        """``share_sketch`` where the summed check may take it as its expected sketch of this rank's own share: at TP 1
        (a TP rank holds parts of the parameters, which the whole tower's sketch hashed otherwise) and drawn on
        ``device`` (the hash is drawn on the device the gradients are on). None: the check draws its own."""
        sketched = self.share_sketch
        return sketched if tp == 1 and sketched is not None and sketched.device == torch.device(device) else None


@dataclass(frozen=True)
class Share:
    """This rank's part of an exact run shared out over its CP group: a sharded case whose ownership is known (the
    implementation's plan, or vdpcp's own deal of whole media items), where every rank would otherwise repeat the
    same exact run of the whole microbatch (on a GPU the ranks share, CP times the work).

    Each rank runs only the chunks of the media it owns, whole or in part (the chunks' ``kinds``, "own" or
    "mixed"), and the figures are summed over ``group``: each output row's and microbatch row's from the rank that
    owns it, and the parameter gradients over every rank's own share (each row has one owner, so the shares add up
    to the summed loss's gradient). ``plan``: who owns which microbatch row, and the output rows each gives.
    """

    group: object
    rank: int
    plan: Ownership

    def own_tokens(self, device) -> torch.Tensor:
        return torch.tensor(self.plan.own_tokens(self.rank), dtype=torch.bool, device=device)

    def own_rows(self, device) -> torch.Tensor:
        return torch.tensor([owner == self.rank for owner in self.plan.owner], dtype=torch.bool, device=device)


@dataclass(frozen=True)
class Reference:
    """The unsharded run whose rounding the exact run measures: its microbatch (``batch.patches.grad`` its input
    gradient), its outputs, its parameter gradients (one per parameter, in order; None where they are the sum of
    the CP ranks' ``own_grads``, which only a shared run can take), the rank-alone expectation (None: not checked),
    the loss weights they were taken under by output name, and whether gradients were taken at all."""

    batch: object
    out: dict[str, torch.Tensor]
    grads: list[torch.Tensor] | None
    own_grads: list[torch.Tensor] | None
    weights: dict[str, torch.Tensor]
    own_weights: dict[str, torch.Tensor] | None
    gradients: bool


@dataclass
class _Chunks:
    """What the exact run's chunks add up to: per output, each token row's figure; the parameter gradients of the
    rank's own loss and of the rest (one per parameter, None: nothing yet); an error a shared run raises later."""

    outputs: dict[str, torch.Tensor]
    own: list
    rest: list
    failed: Exception | None = None


def measure(arm, ref: Reference, chunk: int | None = None, kinds=None, share: Share | None = None) -> Rounding | Shared:
    """``ref`` once more in ``EXACT[dtype]``, on a copy of ``arm.model`` made for it and freed after.

    It runs ``chunk`` patches of whole media items at a time (default EXACT_CHUNK), their gradients summed: a tower
    encodes each image independently of every other (the premise of vision DP over CP, which the matrix checks),
    and a higher precision has no batch effect worth the name, so this is the same exact run with a fraction of its
    activations (a real-size tower's, in float64, would not fit beside the rest). ``kinds`` (one per media item:
    whose it is) keeps items of different kinds in different chunks, so that most chunks are wholly the rank's own
    or wholly not, and need one backward where a mixed one needs two (_backward). With ``share`` (and ``kinds``,
    and ``own_weights`` where gradients are taken) the CP ranks split the run between them (Share): this rank's
    part, no collective, whose ``summed()`` (a collective) is the Rounding.
    """
    grads = ref.gradients
    if grads and ref.grads is None and share is None:
        raise ValueError("rounding.measure: without the summed loss's gradients (ref_grads), only a shared exact run "
                         "can take them as the sum of the ranks' own shares")
    if share is not None and (kinds is None or (grads and ref.own_weights is None)):
        raise ValueError("rounding.measure: a shared exact run needs the media's kinds and, with gradients, the rank's "
                         "own weights (its share of the summed loss)")
    tower = next(iter(ref.out.values()))  # the tower's dtype and device, whatever the pixels came in (vdpcp.feature.pixels)
    exact = copy.deepcopy(arm.model).to(EXACT[tower.dtype])  # the same weights, and no gradient: they were set aside
    params = list(exact.parameters())
    pixels = grads and ref.batch.patches.requires_grad  # pixels are data unless the arms differentiate them
    # the values the arms' towers took (a loader's float32 pixels rounded to a bf16 tower's dtype), exactly
    patches = as_tower_sees(ref.batch.patches.detach(), tower.dtype, tower.device).to(EXACT[tower.dtype])
    patches.requires_grad_(pixels)
    sums = _Chunks({name: torch.zeros(t.shape[0], dtype=torch.float64, device=t.device) for name, t in ref.out.items()},
                   [None] * len(params), [None] * len(params))
    with exact_math(tower.dtype, tower.device), torch.set_grad_enabled(grads):  # outputs only: no graph to keep
        try:
            chunks = replace(ref.batch, patches=patches)
            _run_chunks(arm.impl, exact, ref, chunks, chunk or EXACT_CHUNK, kinds, share, sums)
        except Exception as err:  # shared: raised on every rank alike below, so no rank waits in a collective
            if share is None:
                raise
            sums.failed = err
    if share is not None:
        try:
            return _shared(share, ref, sums, patches, params)
        except Exception as err:  # its figures too (a plan whose token counts are not the outputs' rows, say)
            return Shared(share, patches.device, err)
    return _whole(ref, sums, patches, pixels)


def _run_chunks(impl, exact, ref: Reference, batch, chunk: int, kinds, share: Share | None, sums: _Chunks) -> None:
    """Each chunk of whole media items encoded by ``exact`` (a shared run's: only this rank's own and mixed ones),
    its output rows' figures and its gradients added into ``sums``."""
    params, hp, start = list(exact.parameters()), batch.patches.dtype, 0
    for media, sub in _media_chunks(batch, chunk, kinds):
        first, stop = media
        if share is not None and first < stop and kinds[first] == "other":  # another rank's: it runs it
            start += sum(share.plan.tokens[batch.spec.media_rows[first] : batch.spec.media_rows[stop]])
            continue
        out = outputs_of(impl.encode(exact, impl.inputs(sub)), f"{impl.name}.encode")
        rows = next(iter(out.values())).shape[0]
        for name, t in out.items():
            if name in sums.outputs:
                sums.outputs[name][start : start + rows] = 2 * row_relative(ref.out[name][start : start + rows], t)
        if ref.gradients:
            part = None if ref.own_weights is None else _slice(ref.own_weights, start, rows)
            summed = _slice(ref.weights, start, rows)
            sums.own, sums.rest = _backward(params, out, summed, part, sums.own, sums.rest, hp)
            if share is not None:
                sums.rest = [None] * len(params)  # the other ranks' shares: each adds its own
        start += rows


def _whole(ref: Reference, sums: _Chunks, patches, pixels: bool) -> Rounding:
    """The Rounding of an exact run this rank ran whole."""
    input_figure = 2 * segment_relative(grad_or_zeros(ref.batch.patches).to(patches.device), grad_or_zeros(patches),
                                        ref.batch.cu_seqlens) if pixels else None
    if not ref.gradients:
        return Rounding(sums.outputs)
    summed = [r if o is None else o if r is None else r.add_(o) for o, r in zip(sums.own, sums.rest)]
    own_figure = 2 * relative(ref.own_grads, sums.own) if ref.own_grads is not None else 0.0
    return Rounding(sums.outputs, input_figure, 2 * relative(ref.grads, summed), own_figure)


def _shared(share: Share, ref: Reference, sums: _Chunks, patches, params) -> Shared:
    """This rank's part of a shared exact run, down to what the sums need: its own rows' figures and its own share's
    gradient as a count sketch above sketch.WIDTH parameters (not the tower's size), so it holds nothing large while
    its peers take their turns."""
    device = patches.device
    if sums.failed is not None:
        return Shared(share, device, sums.failed)
    mine = share.own_tokens(device)
    outputs = {name: _own_only(figure, mine.to(figure.device)) for name, figure in sums.outputs.items()}
    if not ref.gradients:
        return Shared(share, device, None, outputs)
    # rows no chunk here reached have no exact gradient: their figure is their owner's
    figure = None
    if patches.requires_grad:
        figure = 2 * segment_relative(grad_or_zeros(ref.batch.patches).to(device), grad_or_zeros(patches),
                                      ref.batch.cu_seqlens)
        figure = _own_only(figure, share.own_rows(figure.device))
    own = [torch.zeros_like(p) if o is None else o for o, p in zip(sums.own, params)]
    own_figure = 2 * relative(ref.own_grads, own) if ref.own_grads is not None else 0.0
    parts = ref.grads is None  # the summed loss's gradients are the ranks' own shares' sum (vdpcp.oracle.unsharded)
    expected = ref.own_grads if parts else ref.grads
    if not sketch.pays(sum(o.numel() for o in own)):
        return Shared(share, device, None, outputs, figure, own_figure, own, expected, parts)
    return Shared(share, device, None, outputs, figure, own_figure, *sketch.sketch(zip(own, expected), device), parts)


@dataclass
class Shared:
    """This rank's part of a shared exact run (Share). ``summed()`` sums the parts over the CP group into the
    Rounding every rank reads: a collective, so the oracle takes it outside any turn (vdpcp.harness.turns: a peer
    may be waiting for its own), after this rank's part ran inside its turn.

    The summed gradients' figure is |ref - sum over ranks of own| / |sum over ranks of own|: summed as they are
    (``own``, ``ref``: lists of gradients), or as count sketches (``own``, ``ref``: each one vector) for a tower
    over sketch.WIDTH parameters, an estimate within 0.07% of each norm (vdpcp.oracle.compare.sketch): a slack figure off by that
    much moves no verdict."""

    share: Share
    device: object
    failed: Exception | None
    outputs: dict = field(default_factory=dict)  # per token row: this rank's own rows' figures, 0 elsewhere
    input: torch.Tensor | None = None  # per microbatch row, the same
    own_figure: float = 0.0
    own: list | torch.Tensor | None = None
    ref: list | torch.Tensor | None = None
    ref_in_parts: bool = False  # ``ref`` is this rank's own share of it too, summed over the group as ``own`` is

    def share_sketch(self) -> torch.Tensor | None:
        """This rank's own share of the summed loss's gradients as a count sketch, where its part holds one (a tower
        over sketch.WIDTH parameters whose summed gradients are the shares' sum): the summed check's expected
        sketch is that one, drawn alike, so it need not be taken again (oracle.gradients)."""
        return self.ref if self.ref_in_parts and isinstance(self.ref, torch.Tensor) else None

    def summed(self) -> Rounding:
        _raise_alike(self.share, self.failed, self.device)
        parts = list(self.outputs.values()) + ([self.input] if self.input is not None else [])
        summed = comm.all_reduce_sums(parts, self.share.group) if parts else []
        outputs = dict(zip(self.outputs, summed))
        if self.own is None:  # outputs only
            return Rounding(outputs)
        pixels = summed[-1] if self.input is not None else None
        if isinstance(self.own, torch.Tensor):
            if self.ref_in_parts:
                total, ref = comm.all_reduce_sum(torch.stack([self.own, self.ref]), self.share.group).unbind()
            else:
                total, ref = comm.all_reduce_sum(self.own, self.share.group), self.ref
            params = float((ref - total).norm() / total.norm().clamp_min(1e-300))
        else:
            n = len(self.own)
            total = comm.all_reduce_sums(self.own + (self.ref if self.ref_in_parts else []), self.share.group)
            params = relative(total[n:] if self.ref_in_parts else self.ref, total[:n])
        return Rounding(outputs, pixels, 2 * params, self.own_figure, self.share_sketch())


def _raise_alike(share: Share, failed: Exception | None, device) -> None:
    """Every rank of ``share.group`` raises if any rank's part of the exact run did: its own error, or one naming
    the ranks whose run raised (a collective, so none is left waiting in the next)."""
    flags = torch.zeros(dist.get_world_size(share.group), dtype=torch.float64, device=device)
    flags[share.rank] = failed is not None
    raised = [rank for rank, flag in enumerate(comm.all_reduce_sum(flags, share.group).tolist()) if flag]
    if failed is not None:
        raise failed
    if raised:
        raise RuntimeError(f"rounding.measure: the exact run raised on CP rank(s) {raised} of the shared exact run "
                           f"(its own error is in that rank's result)")


def _own_only(figure: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    return torch.where(own, figure, torch.zeros_like(figure))


def media_chunks(batch, chunk: int, kinds=None):
    """``batch`` as consecutive microbatches of whole media items, each of at most ``chunk`` patches (an item
    larger than that alone) and of one of ``kinds`` (MicrobatchSpec.media_groups); views of its patches, so
    gradients reach the whole."""
    return (sub for _, sub in _media_chunks(batch, chunk, kinds))


def _media_chunks(batch, chunk: int, kinds=None):
    """media_chunks, each chunk with the media items it holds, (first, stop); (0, 0) for a batch without media."""
    spec = batch.spec
    if not spec.media_frames:
        yield (0, 0), batch
        return
    cu, rows = [int(c) for c in batch.cu_seqlens], spec.media_rows
    for m0, m1 in spec.media_groups(chunk, kinds):
        r0, r1 = rows[m0], rows[m1]
        sub = replace(spec, images=spec.images[r0:r1],
                      num_frames=None if spec.num_frames is None else spec.num_frames[m0:m1], name=f"{spec.name}[{m0}:{m1}]")
        yield (m0, m1), replace(batch, spec=sub, patches=batch.patches[:, cu[r0] : cu[r1]],
                                imgs_sizes=batch.imgs_sizes[r0:r1], cu_seqlens=batch.cu_seqlens[r0 : r1 + 1] - batch.cu_seqlens[r0])


def _backward(params, out, summed: dict, share: dict | None, own: list, rest: list, dtype) -> tuple[list, list]:
    """One chunk's gradients into two totals (one per parameter, None: nothing yet): ``own``, of the rank's own
    loss (``share``: its weights over the chunk's rows; None: not asked), and ``rest``, of the summed loss less
    that, so that own + rest is the summed loss's gradient however the chunk splits.

    A chunk wholly the rank's own (its share is the summed weights) or wholly not (a share of zeros) takes one
    backward; only a mixed one takes two, the first keeping the graph for the second. Both go to the input too,
    which so gets the summed loss's gradient. Through .grad, which backward adds to in place: autograd.grad would
    hand back a whole new set of gradients, one more copy of the tower's than the budget counts."""
    if share is None or not any(w.any() for w in share.values()):
        return own, _into(params, rest, _weighted(out, summed, dtype))
    if all(torch.equal(share[name], summed[name]) for name in summed):
        return _into(params, own, _weighted(out, summed, dtype)), rest
    own = _into(params, own, _weighted(out, share, dtype), keep=True)
    return own, _into(params, rest, _weighted(out, {n: summed[n].to(dtype) - share[n].to(dtype) for n in summed}, dtype))


def _into(params, totals: list, of: torch.Tensor, keep: bool = False) -> list:
    """``totals`` plus d of / d params, in place, through each parameter's .grad; the input's .grad too."""
    for p, total in zip(params, totals):
        p.grad = total
    of.backward(retain_graph=keep)
    totals = [p.grad for p in params]
    for p in params:
        p.grad = None
    return totals


def _slice(weights: dict, start: int, rows: int) -> dict:
    """Loss weights over token rows [start, start + rows) of the whole microbatch's outputs."""
    return {name: w[start : start + rows] for name, w in weights.items()}


def _weighted(outputs, weights, dtype) -> torch.Tensor:
    """The case's merged loss over one chunk's outputs as the tower sees it, under its weights there."""
    return loss.features_loss(outputs, {name: w.to(dtype) for name, w in weights.items()})
