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
from dataclasses import dataclass, replace

import torch

from vdpcp import comm
from vdpcp.case import Case, RankResult
from vdpcp.layout import zigzag_positions
from vdpcp.protocol import OutputsError, outputs_of
from vdpcp.tensor_parallel import held_part

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Gradients in these dtypes compare as vectors, within assert_close's default rtol for the dtype (_compare_norm).
# float32 too: a small tower's unsharded float32 gradients are themselves ~2e-5 off float64's on mixed-sizes, so
# element-wise atol 1e-5 failed correct subjects; as vectors the measured gap is at most 4.7e-7 (4 eps) for the
# reference and qwen2_5_vl at CP 2/4/8, against rtol 1.3e-6 (11 eps), and every gradient mutant moves it by O(1).
VECTOR_RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3, torch.float32: 1.3e-6}
# The fused sequence around the vision tokens, for the zigzag loss: text before and after the media.
TEXT_BEFORE, TEXT_AFTER = 3, 5
DP_SEED_STRIDE = 7919  # DP replica d encodes the case's microbatch drawn with seed + d * this
OUTPUT_SEED_STRIDE = 104_729  # output k's loss weights are drawn with seed + k * this (k = 0: the main features)


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
        ref_out = outputs_of(impl.encode(reference, impl.inputs(ref_batch)), f"{impl.name}.encode")
    except OutputsError:
        raise
    except Exception as err:
        result.unsharded_error = f"{type(err).__name__}: {err}"
        return result

    # What the case expects: sharded, or encoded whole on every rank (CP=1, the opt-out, or the
    # implementation's own fallback policy below some size).
    result.replicated = impl.replicated(spec, config) if config.shard_vision else None
    sharded = config.shard_vision and result.replicated is None
    # ...and the reference finishes, backward too, before the sharded run: collectives inside a model (a
    # tensor-parallel tower) then never interleave with the sharded run's, so a rank that skips its tower leaves
    # its peers waiting in the sharded forward, where they say so, instead of mismatching a later collective.
    plan = impl.plan(spec, config) if sharded else None
    weights = {name: [loss_weights(case, spec, r, t.shape, dtype, device, output=i) for r in range(case.cp)]
               for i, (name, t) in enumerate(ref_out.items())}
    expected_rank_params = None
    if case.grads:
        own = {name: _own_weight(plan, sharded, w, cp_rank, device) for name, w in weights.items()}
        if all(w is not None for w in own.values()):
            expected_rank_params = _param_grads(reference, weighted(ref_out, own))
        weighted(ref_out, {name: sum(w) for name, w in weights.items()}).backward()
    # A tensor-parallel tower splits its MLP's sums over TP ranks, so in low precision its outputs round apart from
    # the plain tower's too (measured on the H200 in bf16: 1 ulp, 0.0039); then they compare as gradients do.
    measured = dtype in VECTOR_RTOL and (case.grads or case.tp > 1)
    rounding = _rounding(impl, case, reference, ref_batch, ref_out, weights) if measured else Rounding()

    # The reference's weights; split inside where the tower is tensor parallel (the reference stays plain), so
    # the reference's gradients are held to each parameter's own part of them (tensor_parallel.held_part).
    model = impl.subject_model(reference, case, dtype, device)
    held = _held_by(model, groups.tp_rank, case.tp)
    ran = Execution(model)
    batch = spec.tensors(dtype=dtype, device=device)
    batch.patches.requires_grad_(True)
    out = outputs_of(impl.encode_sharded(model, impl.inputs(batch), config, cp_group), f"{impl.name}.encode_sharded")
    result.encoded = ran.rows

    # What really ran, on every rank: the rows whose patches reached each rank's tower (a collective, so every
    # rank takes it and decides alike).
    read = _read_table(batch, ran, case.cp, cp_rank, cp_group)
    result.read = [row for row in range(read.shape[1]) if read[cp_rank, row]]
    replicated_run = case.cp > 1 and bool(read.all()) and read.shape[1] > 0
    if case.cp > 1 and cp_rank == 0:  # said once: every rank sees the same table
        _judge_distribution(result, read, plan, sharded, replicated_run, config)
    if plan is not None and _contradicts(read, plan):
        plan, expected_rank_params = None, None  # the plan is not what ran: its per-rank checks would blame gradients
    _describe(result, spec, plan, cp_rank)

    if list(out) != list(ref_out):
        result.failures.append(f"outputs: the sharded encode returned {list(out)}, the unsharded {list(ref_out)}")
        return result
    for name in ref_out:
        result.out_err = max(result.out_err, _compare(result, _label("outputs", name, ref_out), out[name], ref_out[name],
                                                      slack=rounding.outputs if case.tp > 1 else None))
    if any(out[n].shape != ref_out[n].shape for n in ref_out) or not case.grads:
        return result  # every rank gathered the same shapes, so every rank stops here: no collective hangs

    rank_loss(out, weights, cp_rank).backward()

    grad, ref_grad = _grad(batch.patches), _grad(ref_batch.patches)
    owned = config.shard_vision and not replicated_run  # the same on every rank: read is every rank's table
    # Every sum over ranks taken here, in one collective (comm.all_reduce_sums says why).
    summed, summed_params, *holders = comm.all_reduce_sums(
        [grad, _flat_grads(model)] + ([_holding(batch, grad, case.cp, cp_rank)] if owned else []), cp_group)
    result.input_grad_err = _compare(result, "input grads (summed over ranks)", summed, ref_grad, slack=rounding.input)
    if owned:
        _check_ownership(result, batch, grad, ref_grad, plan, read, holders[0], rounding.input)
        _check_execution(result, reference_ran, ran, reference, model)
    result.param_grad_err = _compare(result, "param grads (summed over ranks)", summed_params,
                                     held(_grads(reference)), slack=rounding.params)
    if expected_rank_params is not None and replicated_run == (not sharded):
        result.param_grad_err = max(result.param_grad_err, _compare(
            result, "param grads (this rank alone)", _flat_grads(model), held(expected_rank_params), slack=rounding.params))
    return result


def rank_loss(outputs: dict[str, torch.Tensor], weights: dict[str, list[torch.Tensor]], rank: int) -> torch.Tensor:
    """L_rank: what this CP rank's language model takes from the gathered outputs (its own weights only)."""
    return weighted(outputs, {name: w[rank] for name, w in weights.items()})


def weighted(outputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over outputs of sum(W * output): what a language model's loss takes from every output."""
    return sum((weights[name] * t).sum() for name, t in outputs.items())


def _label(what: str, name: str, outputs: dict) -> str:
    return what if len(outputs) == 1 else f"{what} {name!r}"


def replica_spec(case: Case, dp_rank: int):
    """The microbatch DP replica ``dp_rank`` encodes: the case's shapes, its own pixels."""
    return case.spec if dp_rank == 0 else replace(case.spec, seed=(case.spec.seed + DP_SEED_STRIDE * dp_rank) % 2**64)


def loss_weights(case: Case, spec, rank: int, shape, dtype, device, output: int = 0) -> torch.Tensor:
    """W_rank for one output: deterministic per (spec seed, CP rank, output); under zigzag, zero outside the
    rank's LM shard (every output is over the same token rows)."""
    gen = torch.Generator().manual_seed((1_000_003 * spec.seed + rank + OUTPUT_SEED_STRIDE * output) % 2**63)
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
    calls; ``ran()``: the modules that saw at least one row (a module called on nothing did not run);
    ``taken``: the differentiable inputs of that first module, from which _read_table finds which microbatch
    rows reached the tower.
    """

    def __init__(self, model: torch.nn.Module):
        self.calls: dict[str, int] = {}
        self.first: str | None = None
        self.taken: list[torch.Tensor] = []  # what the first module took, for what reached the tower (_read_table)
        # Not the root: a tower's encode and project are often called apart, never through its forward.
        self.names = [name for name, m in model.named_modules()
                      if name and any(True for _ in m.parameters(recurse=False))]
        for name, module in model.named_modules():
            if name in self.names:
                module.register_forward_pre_hook(self._hook(name))

    def _hook(self, name: str):
        def record(module, args):
            rows = input_rows(module, next((a for a in args if isinstance(a, torch.Tensor)), None))
            self.first = self.first or name
            self.calls[name] = self.calls.get(name, 0) + rows
            if name == self.first:
                self.taken += [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        return record

    @property
    def rows(self) -> int:
        return self.calls.get(self.first, 0) if self.first else 0

    def ran(self) -> set[str]:
        return {name for name, rows in self.calls.items() if rows > 0}


CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def input_rows(module: torch.nn.Module, tensor: torch.Tensor | None) -> int:
    """Rows a module takes: its input's elements over one row's. A convolution's row is one kernel window over
    every input channel (a patch, for a tower's patch embedding, however its input is shaped); anything
    else's is the last dimension."""
    if tensor is None or tensor.dim() == 0:
        return 0
    if isinstance(module, CONVOLUTIONS):
        per_row = module.in_channels * math.prod(module.kernel_size)
    else:
        per_row = tensor.shape[-1]
    return tensor.numel() // max(per_row, 1)


def _describe(result: RankResult, spec, plan, cp_rank: int) -> None:
    """What this rank encoded, for the report: the rows that really reached its tower where that was measured,
    else what the plan gives it (the whole microbatch when not sharded); placeholders as the plan says."""
    if result.read is not None:
        rows = result.read
    else:
        rows = plan.rows_of(cp_rank) if plan is not None else range(len(spec.images))
    result.images, result.patches = len(rows), sum(spec.row_patches[r] for r in rows)
    result.placeholders = plan.placeholders[cp_rank] if plan is not None and cp_rank < len(plan.placeholders) else 0


def _read_table(batch, ran: Execution, cp: int, cp_rank: int, cp_group) -> torch.Tensor:
    """[CP ranks, rows], True where a microbatch row's patches reached that rank's tower.

    Found through autograd, whatever the tower: the gradient of what the tower's first layer took with respect
    to the microbatch's patches is non-zero exactly on the patches it read. Placeholders and padding come from
    nowhere, so they read nothing; a tower run on every image reads every row, under any loss.
    """
    cu = [int(c) for c in batch.cu_seqlens]
    table = torch.zeros(cp, len(cu) - 1, dtype=torch.float64, device=batch.patches.device)
    if ran.taken and len(cu) > 1:
        (grad,) = torch.autograd.grad(sum(t.sum() for t in ran.taken), batch.patches, retain_graph=True,
                                      allow_unused=True)
        if grad is not None:
            hit = grad[0].ne(0).any(dim=-1)
            for row in range(len(cu) - 1):
                table[cp_rank, row] = float(bool(hit[cu[row] : cu[row + 1]].any()))
    return comm.all_reduce_sum(table, cp_group) > 0


def _readers(read: torch.Tensor, row: int) -> list[int]:
    return read[:, row].nonzero().flatten().tolist()


def _contradicts(read: torch.Tensor, plan) -> bool:
    return len(plan.owner) != read.shape[1] or any(_readers(read, row) != [owner] for row, owner in enumerate(plan.owner))


def _judge_distribution(result: RankResult, read: torch.Tensor, plan, sharded: bool, replicated_run: bool, config) -> None:
    """Was the work distributed as the case expects? Sharded: every row on exactly one rank (the plan's, where
    there is one). Replicated (the opt-out, or the implementation's fallback policy): every row on every rank."""
    cp, rows = read.shape
    if rows == 0:
        return
    if not sharded:
        why = result.replicated or "vision_dp_over_cp is off"
        if not replicated_run:
            per_rank = " ".join(str(int(read[r].sum())) for r in range(cp))
            result.plan_mismatch.append(f"policy mismatch: sharded (rows per rank {per_rank}) where every rank should encode all {rows} "
                                        f"rows: {why}")
        return
    if replicated_run:
        result.not_sharded.append(f"not sharded: every CP rank's tower encoded all {rows} rows, so the microbatch was "
                                  f"encoded {cp} times (vision_dp_over_cp is on at CP={cp})")
        return
    readers = {row: _readers(read, row) for row in range(rows)}
    twice = [f"row {row} on ranks {ranks}" for row, ranks in readers.items() if len(ranks) > 1]
    if twice:
        result.not_sharded.append(f"not sharded: {len(twice)} of {rows} rows encoded on more than one rank "
                                  f"({_few(twice)})")
    nowhere = [str(row) for row, ranks in readers.items() if not ranks]
    if nowhere:
        result.failures.append(f"execution: row(s) {_few(nowhere)} reached no rank's tower, so their features cannot "
                               f"come from their pixels")
    if plan is not None:
        moved = [f"row {row} encoded on rank {ranks[0]}, the plan says rank {plan.owner[row]}"
                 for row, ranks in readers.items() if len(ranks) == 1 and row < len(plan.owner) and ranks != [plan.owner[row]]]
        if moved:
            result.plan_mismatch.append(f"plan mismatch: {_few(moved)}")


def _few(items: list[str], n: int = 4) -> str:
    return "; ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


def _holding(batch, grad, cp: int, cp_rank: int) -> torch.Tensor:
    """[CP ranks, rows]: 1 in this rank's line where its input gradient for a microbatch row is non-zero (summed
    over ranks, which ranks hold each row's gradient)."""
    cu = [int(c) for c in batch.cu_seqlens]
    nonzero = torch.zeros(cp, len(cu) - 1, dtype=torch.float64, device=grad.device)
    for row in range(len(cu) - 1):
        nonzero[cp_rank, row] = float(bool(grad[:, cu[row] : cu[row + 1]].any()))
    return nonzero


def _check_ownership(result, batch, grad, ref_grad, plan, read, holders, slack: float) -> None:
    """Every image row's gradient is non-zero on exactly one rank, its owner (the plan's, or the one rank whose
    tower read it), and equals the unsharded one there. ``holders``: _holding summed over the CP ranks."""
    cu = [int(c) for c in batch.cu_seqlens]
    rows, cp = len(cu) - 1, holders.shape[0]
    wrong = []
    for row in range(rows):
        ranks = [r for r in range(cp) if holders[r, row] > 0]
        readers = _readers(read, row)
        expected = [plan.owner[row]] if plan is not None else readers if len(readers) == 1 else None
        if len(ranks) != 1 or (expected is not None and ranks != expected):
            wrong.append(f"row {row} on ranks {ranks}" + (f" (encoded on rank {expected[0]})" if expected else ""))
    if wrong and result.cp_rank == 0:  # said once: every rank sees the same table
        result.failures.append(f"input grads: an image's gradient must be non-zero on exactly its owner's rank: "
                               f"{'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")
    mine = plan.rows_of(result.cp_rank) if plan is not None else [
        row for row in range(rows) if holders[result.cp_rank, row] > 0]
    own = torch.zeros(grad.shape[1], dtype=torch.bool, device=grad.device)
    for row in mine:
        own[cu[row] : cu[row + 1]] = True
    result.input_grad_err = max(result.input_grad_err, _compare(
        result, "input grads (own images)", grad[:, own], ref_grad[:, own], slack=slack))


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


def _compare(result: RankResult, what: str, actual: torch.Tensor, expected: torch.Tensor,
             slack: float | None = None) -> float:
    """Element by element with assert_close's tolerances for the dtype; a gradient (``slack`` given: a sum over
    tokens) as a vector in low precision, see _compare_norm."""
    if actual.shape != expected.shape:
        result.failures.append(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
        return math.inf
    actual, expected = actual.detach(), expected.detach()
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    if slack is not None and actual.dtype in VECTOR_RTOL:
        _compare_norm(result, what, actual, expected, slack)
        return err
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as mismatch:
        result.failures.append(f"{what}: {str(mismatch).splitlines()[0]} (max abs error {err:.3g})")
    return err


def _compare_norm(result: RankResult, what: str, actual: torch.Tensor, expected: torch.Tensor, slack: float) -> None:
    """Gradients in bf16, fp16 and float32 are sums over tokens (and ranks) rounded to an 8-, 11- or 24-bit
    mantissa: splitting the sum differently (which is what sharding does) moves elements near cancellation by far
    more than an element-wise tolerance allows, while any sharding bug moves the whole tensor. So they are
    compared as vectors: |actual - expected| <= (rtol + slack) * |expected| (2-norms), rtol being assert_close's
    for the dtype and ``slack`` twice the unsharded run's own relative distance from float64 (Rounding: both runs
    add up the same terms in different orders, so each is about that far from the exact sum and they are at
    most about twice it apart). float64's rounding stays far inside its element-wise tolerances, so it compares
    element by element."""
    rtol = VECTOR_RTOL[actual.dtype]
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    if diff > (rtol + slack) * scale:
        result.failures.append(
            f"{what}: relative 2-norm error {diff / max(scale, 1e-300):.3g} exceeds {actual.dtype}'s rtol {rtol:g}"
            + (f" + twice the unsharded run's own rounding ({slack / 2:.2g})" if slack else ""))


@dataclass(frozen=True)
class Rounding:
    """How far the unsharded gradients in the case's dtype are from the same run in float64 (relative 2-norms,
    doubled: the slack a sharded run of the same sums in another order may add on top of the dtype's rtol)."""

    input: float = 0.0
    params: float = 0.0
    outputs: float = 0.0


def _rounding(impl, case: Case, reference, ref_batch, ref_out, weights) -> Rounding:
    """The unsharded run once more in float64, from the same rounded weights, pixels and loss weights.

    Measured (2026-12-01): on microbatches of a few hundred patches float32's own gap is about 4 eps, but on
    Automodel's 8k-patch threshold microbatch 6 eps, and two float32 runs summed in different orders 1.36e-6
    apart: over float32's rtol of 1.3e-6 without any sharding bug. Each case now says how much rounding its
    own sums carry. Through the oracle the sharded runs of the shipped subjects stay within rtol alone (at most
    1.01e-6, tokens-2048 at CP 4); tests/oracle/test_rounding.py holds the slack to its bounds."""
    exact = impl.build_model(case, torch.float64, ref_batch.patches.device)
    exact.load_state_dict(reference.state_dict())
    batch = replace(ref_batch, patches=ref_batch.patches.detach().double().requires_grad_(True))
    out = outputs_of(impl.encode(exact, impl.inputs(batch)), f"{impl.name}.encode")
    outputs = 2 * max(_relative(ref_out[name].detach(), out[name].detach()) for name in out)
    if not case.grads:
        return Rounding(outputs=outputs)
    weighted(out, {name: sum(w).double() for name, w in weights.items()}).backward()
    return Rounding(2 * _relative(_grad(ref_batch.patches), _grad(batch.patches)),
                    2 * _relative(_flat_grads(reference), _flat_grads(exact)), outputs)


def _relative(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return (actual.double() - exact).norm().item() / max(exact.norm().item(), 1e-300)


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
