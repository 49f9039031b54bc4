"""The oracle: on one rank, the implementation's sharded encoder against its own unsharded encoder.

Each CP rank r weights the gathered features with its own deterministic random tensor W_r and takes
L_r = sum(W_r * features), as each CP rank's language model consumes its own tokens; the unsharded
reference, computed on the same rank in one process with an identical model, takes L = sum over r of L_r.
With sharding on, it then checks:

1. outputs: the gathered features on this rank equal the unsharded features, row for row;
2. input grads: summed over the CP ranks they equal the unsharded ones; every image row has a non-zero
   gradient on exactly one rank (its owner: the implementation's plan says which, or it is inferred), and
   the owner's gradient for it equals the unsharded one;
3. parameter grads: summed over the CP ranks they equal the unsharded gradients; where the implementation
   states a plan, this rank's own equal the unsharded gradients of its own images' rows under the summed
   weights (so the projector stays sharded: gathering before the projector passes the sum but fails this);
4. execution, not the plan: the tower's layers ran on this rank on at least one row (an image or a
   placeholder), and every parameter the unsharded run gives a gradient has one here, so a rank holding only
   placeholders that skips its tower (and would hang a tensor-parallel or FSDP peer) fails.

With sharding off (CP=1, opt-out) every rank encodes everything: outputs, and input and parameter grads
summed over ranks. ``grads=False`` checks outputs only. Tolerances are torch.testing.assert_close's defaults
for the dtype, never loosened; bf16 gradients compare as vectors (_compare_norm says why).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from vdpcp import comm
from vdpcp.case import Case, RankResult
from vdpcp.layout import zigzag_positions
from vdpcp.tensor_parallel import held_part

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
LOW_PRECISION = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}  # assert_close's default rtol for each
# The fused sequence around the vision tokens, for the zigzag loss: text before and after the media.
TEXT_BEFORE, TEXT_AFTER = 3, 5
DP_SEED_STRIDE = 7919  # DP replica d encodes the case's microbatch drawn with seed + d * this


def check(ctx, case: Case, impl, groups) -> RankResult:
    """Run ``case`` on this rank (its CP group in ``groups``) and compare with the unsharded encoder."""
    dtype, device, config = DTYPES[case.dtype], ctx.device, case.config
    cp_group, cp_rank = groups.cp, groups.cp_rank
    spec = replica_spec(case, groups.dp_rank)
    result = RankResult(ctx.rank, cp_rank, backend=ctx.backend, device=str(ctx.device))

    # The unsharded reference runs first: if it raises too, every rank raises it alike before any
    # collective (no rank hangs) and the case is reported as unsharded_error, not as a sharding failure.
    reference = impl.build_model(case, dtype, device)
    reference_ran = Execution(reference)
    ref_batch = spec.tensors(dtype=dtype, device=device)
    ref_batch.patches.requires_grad_(True)
    try:
        ref_features = impl.encode(reference, impl.inputs(ref_batch))
    except Exception as err:
        result.unsharded_error = f"{type(err).__name__}: {err}"
        return result

    # ...and finishes, backward too, before the sharded run: collectives inside a model (a tensor-parallel tower)
    # then never interleave with the sharded run's, so a rank that skips its tower leaves its peers waiting in
    # the sharded forward, where they say so, instead of mismatching a later collective.
    plan = impl.plan(spec, config) if config.shard_vision else None
    weights = [loss_weights(case, spec, r, ref_features.shape, dtype, device) for r in range(case.cp)]
    expected_rank_params = None
    if case.grads:
        own_weight = _own_weight(plan, config.shard_vision, weights, cp_rank, device)
        if own_weight is not None:
            expected_rank_params = _param_grads(reference, (own_weight * ref_features).sum())
        sum((w * ref_features).sum() for w in weights).backward()

    # The reference's weights; split inside where the tower is tensor parallel (the reference stays plain), so
    # the reference's gradients are held to each parameter's own part of them (tensor_parallel.held_part).
    model = impl.subject_model(reference, case, dtype, device)
    held = _held_by(model, groups.tp_rank, case.tp)
    ran = Execution(model)
    batch = spec.tensors(dtype=dtype, device=device)
    batch.patches.requires_grad_(True)
    features = impl.encode_sharded(model, impl.inputs(batch), config, cp_group)
    result.encoded = ran.rows

    _describe(result, spec, plan, cp_rank)
    result.out_err = _compare(result, "outputs", features, ref_features)
    if features.shape != ref_features.shape or not case.grads:
        return result  # every rank gathered the same shape, so every rank stops here: no collective hangs

    rank_loss(features, weights, cp_rank).backward()

    grad, ref_grad = _grad(batch.patches), _grad(ref_batch.patches)
    summed = comm.all_reduce_sum(grad, cp_group)
    result.input_grad_err = _compare(result, "input grads (summed over ranks)", summed, ref_grad, reduction=True)
    if config.shard_vision:
        _check_ownership(result, batch, grad, ref_grad, plan, case.cp, cp_group)
        _check_execution(result, reference_ran, ran, reference, model)
    summed_params = comm.all_reduce_sum(_flat_grads(model), cp_group)
    result.param_grad_err = _compare(result, "param grads (summed over ranks)", summed_params,
                                     held(_grads(reference)), reduction=True)
    if expected_rank_params is not None:
        result.param_grad_err = max(result.param_grad_err, _compare(
            result, "param grads (this rank alone)", _flat_grads(model), held(expected_rank_params), reduction=True))
    return result


def replica_spec(case: Case, dp_rank: int):
    """The microbatch DP replica ``dp_rank`` encodes: the case's shapes, its own pixels."""
    return case.spec if dp_rank == 0 else replace(case.spec, seed=(case.spec.seed + DP_SEED_STRIDE * dp_rank) % 2**64)


def rank_loss(features: torch.Tensor, weights: list[torch.Tensor], rank: int) -> torch.Tensor:
    """L_rank: what this CP rank's language model takes from the gathered features (its own weights only)."""
    return (weights[rank] * features).sum()


def loss_weights(case: Case, spec, rank: int, shape, dtype, device) -> torch.Tensor:
    """W_rank: deterministic per (spec seed, CP rank); under zigzag, zero outside the rank's LM shard."""
    gen = torch.Generator().manual_seed(1_000_003 * spec.seed + rank)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    if case.loss == "zigzag":
        w = w * zigzag_rows(shape[0], case.cp, rank).unsqueeze(-1)
    return w.to(dtype=dtype, device=device)


def zigzag_rows(num_vision: int, cp: int, rank: int) -> torch.Tensor:
    """Which vision rows rank ``rank`` holds when the fused text+vision sequence is CP-split zigzag-wise
    (vdpcp.layout.zigzag_positions), so most ranks' gradient for an image comes from other ranks."""
    held = zigzag_positions(TEXT_BEFORE + num_vision + TEXT_AFTER, cp, rank)
    return held[TEXT_BEFORE : TEXT_BEFORE + num_vision].to(torch.float64)


def _own_weight(plan, sharded: bool, weights, cp_rank: int, device) -> torch.Tensor | None:
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
    own = [owner == rank for owner, tokens in zip(plan.owner, plan.tokens) for _ in range(tokens)]
    return torch.tensor(own, dtype=torch.bool, device=device)


class Execution:
    """What a model's layers really ran on: forward hooks on every module that holds parameters itself.

    ``rows``: rows (leading elements of its first input) the first such module to run saw, summed over its
    calls; ``empty``: modules that only ever ran on nothing, or never ran.
    """

    def __init__(self, model: torch.nn.Module):
        self.calls: dict[str, int] = {}
        self.first: str | None = None
        # Not the root: a tower's encode and project are often called apart, never through its forward.
        self.names = [name for name, m in model.named_modules()
                      if name and any(True for _ in m.parameters(recurse=False))]
        for name, module in model.named_modules():
            if name in self.names:
                module.register_forward_pre_hook(self._hook(name))

    def _hook(self, name: str):
        def record(module, args):
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            rows = 0 if tensor is None or tensor.dim() == 0 else tensor.numel() // max(tensor.shape[-1], 1)
            self.first = self.first or name
            self.calls[name] = self.calls.get(name, 0) + rows
        return record

    @property
    def rows(self) -> int:
        return self.calls.get(self.first, 0) if self.first else 0

    def ran(self) -> set[str]:
        return {name for name, rows in self.calls.items() if rows > 0}


def _describe(result: RankResult, spec, plan, cp_rank: int) -> None:
    """What the plan gives this rank, for the report (the whole microbatch when not sharded)."""
    if plan is None:
        result.images, result.patches = len(spec.images), sum(spec.row_patches)
        return
    rows = plan.rows_of(cp_rank)
    result.images = len(rows)
    result.placeholders = plan.placeholders[cp_rank] if cp_rank < len(plan.placeholders) else 0
    result.patches = sum(spec.row_patches[r] for r in rows)


def _check_ownership(result, batch, grad, ref_grad, plan, cp: int, cp_group) -> None:
    """Every image row's gradient is non-zero on exactly one rank, the plan's owner where there is a plan,
    and equals the unsharded one there."""
    cu = [int(c) for c in batch.cu_seqlens]
    rows = len(cu) - 1
    nonzero = torch.zeros(cp, rows, dtype=torch.float64, device=grad.device)
    for row in range(rows):
        nonzero[result.cp_rank, row] = float(bool(grad[:, cu[row] : cu[row + 1]].any()))
    holders = comm.all_reduce_sum(nonzero, cp_group)
    wrong = []
    for row in range(rows):
        ranks = [r for r in range(cp) if holders[r, row] > 0]
        expected = [plan.owner[row]] if plan is not None else None
        if len(ranks) != 1 or (expected is not None and ranks != expected):
            wrong.append(f"row {row} on ranks {ranks}" + (f" (plan: rank {expected[0]})" if expected else ""))
    if wrong and result.cp_rank == 0:  # said once: every rank sees the same table
        result.failures.append(f"input grads: an image's gradient must be non-zero on exactly its owner's rank: "
                               f"{'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")
    mine = plan.rows_of(result.cp_rank) if plan is not None else [
        row for row in range(rows) if holders[result.cp_rank, row] > 0]
    own = torch.zeros(grad.shape[1], dtype=torch.bool, device=grad.device)
    for row in mine:
        own[cu[row] : cu[row + 1]] = True
    if plan is None:
        result.images, result.patches = len(mine), int(own.sum())
    result.input_grad_err = max(result.input_grad_err, _compare(
        result, "input grads (own images)", grad[:, own], ref_grad[:, own], reduction=True))


def _check_execution(result, reference_ran: Execution, ran: Execution, reference, model) -> None:
    """The tower ran on this rank: its layers saw rows, and every parameter the unsharded run gives a
    gradient has one here (a skipped tower leaves them None, which summing would read as zeros)."""
    skipped = sorted(reference_ran.ran() - ran.ran())
    if ran.rows == 0 or skipped:
        result.failures.append(f"execution: rank {result.rank} (CP rank {result.cp_rank}) did not run its tower on any "
                               f"row{' (layers never run: ' + ', '.join(skipped[:3]) + ')' if skipped else ''}; a rank "
                               f"with only placeholders must still encode them")
    missing = [name for (name, p), q in zip(model.named_parameters(), reference.parameters())
               if q.grad is not None and p.grad is None]
    if missing:
        result.failures.append(f"execution: rank {result.rank} (CP rank {result.cp_rank}) has no gradient for "
                               f"{len(missing)} parameter(s) the unsharded run gives one ({', '.join(missing[:3])})")


def _compare(result: RankResult, what: str, actual: torch.Tensor, expected: torch.Tensor, reduction: bool = False) -> float:
    """Element by element with assert_close's tolerances for the dtype; see _compare_norm for ``reduction``."""
    if actual.shape != expected.shape:
        result.failures.append(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
        return math.inf
    actual, expected = actual.detach(), expected.detach()
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    if reduction and actual.dtype in LOW_PRECISION:
        _compare_norm(result, what, actual, expected)
        return err
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as mismatch:
        result.failures.append(f"{what}: {str(mismatch).splitlines()[0]} (max abs error {err:.3g})")
    return err


def _compare_norm(result: RankResult, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Gradients in bf16/fp16 are sums over tokens (and ranks) rounded to a 8- or 11-bit mantissa: splitting the
    sum differently (which is what sharding does) moves elements near cancellation by far more than an
    element-wise rtol allows, while any sharding bug moves the whole tensor. So in low precision they are
    compared as vectors: |actual - expected| <= rtol * |expected| (2-norms), rtol being assert_close's for the
    dtype."""
    rtol = LOW_PRECISION[actual.dtype]
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    if diff > rtol * scale:
        result.failures.append(
            f"{what}: relative 2-norm error {diff / max(scale, 1e-300):.3g} exceeds {actual.dtype}'s rtol {rtol:g}"
        )


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _grads(model) -> list[torch.Tensor]:
    return [_grad(p) for p in model.parameters()]


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in _grads(model)])


def _held_by(model, tp_rank: int, tp: int):
    """The reference's gradients (one per parameter, in order) -> flattened like _flat_grads(model): each parameter
    of a tensor-parallel model holds its own part of the plain reference's."""
    def held(grads: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([held_part(g, p, tp_rank, tp).reshape(-1) for p, g in zip(model.parameters(), grads)])
    return held


def _param_grads(model, loss: torch.Tensor) -> list[torch.Tensor]:
    """d loss / d params, one per parameter like _grads, leaving the graph for the full backward."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
