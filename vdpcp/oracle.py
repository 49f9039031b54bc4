"""The oracle: on one rank, the implementation's sharded encoder against its own unsharded encoder.

Each CP rank r merges the gathered features into a text stream, as a VLM's embedding merge does, and weights the
merged stream with its own deterministic random tensor W_r: L_r = sum(W_r * merged) (vdpcp.loss), as each CP rank's
language model consumes its own tokens; the unsharded reference, computed on the same rank with the same model,
takes L = sum over r of L_r. With sharding on, it then checks:

1. outputs: the gathered features on this rank equal the unsharded features, row for row;
2. input grads, where the implementation declares its path differentiable in its pixels (``pixel_grads``; else
   pixels are data, handed over needing no gradient) and its sharded path carries them: summed over the CP ranks
   they equal the unsharded ones; every image row has a non-zero gradient on exactly one rank (its owner: the
   implementation's plan says which, or it is inferred), and the owner's gradient for it equals the unsharded one;
3. parameter grads: summed over the CP ranks (below float64, a tower over vdpcp.sketch.WIDTH parameters sums
   count sketches of them) they equal the unsharded gradients; where the implementation
   states a plan, this rank's own equal the unsharded gradients of its own images' rows under the summed
   weights (so the projector stays sharded: gathering before the projector passes the sum but fails this);
4. execution, not the plan: the tower ran on this rank on at least one row (an image or a placeholder; from the
   forward pre-hooks, so outputs-only cases too) through every layer that ran on every CP rank holding real rows
   (a branch only some rows take, a separate video embedder, is not required elsewhere; required_layers), and
   where gradients run every parameter of those layers the unsharded run gives a gradient has one here, so a rank
   holding only placeholders that skips its tower (and would hang a tensor-parallel or FSDP peer) fails, unless
   the implementation says an empty rank may skip it;
   with sharding off, no collective is issued on the CP group;
5. the text stream's gradient, a second consumer of the merged stream's gradient, bit for bit: on this rank its own
   loss's, summed over the CP ranks the unsharded one (a gather whose backward writes into the gradient it was
   handed changes it);
6. did it shard: which rows reached each rank's tower, seen at the tower's inputs whatever the grad mode
   (vdpcp.reads): a tower that also runs rows of other ranks, under no_grad too, read them, which is not-sharded;
   and where the implementation declares the objective its partition balances, each rank's load from what it read
   against the best partition under it (vdpcp.load_balance: unbalanced).

With sharding off (CP=1, opt-out) every rank encodes everything: outputs, and input and parameter grads
summed over ranks. ``grads=False`` checks outputs only; so does a forward-only implementation, its gradients
"not checked" (RankResult.unchecked_grads). Tolerances: float64 element by element with
assert_close's; below it, vdpcp.precision (each quantity within the dtype's rtol plus twice this case's own
unsharded run's measured distance from a higher-precision run).

On a gloo CP group the sharded arm runs with the collectives NCCL takes with uneven sizes made right for gloo (any
subgroup: vdpcp.gloo_collectives), and each rank's result names those that ran (RankResult.collectives).

The model is borrowed from the rank's cache (vdpcp.model_cache): the unsharded arm runs on it, its gradients are
set aside, and the sharded arm runs on the same weights (or on ``subject_model``'s split of them). Ranks sharing
one GPU take turns for the unsharded arm and its exact run where the case would not fit otherwise (vdpcp.budget).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from vdpcp import budget, comm, gloo_collectives, load_balance, loss, model_cache, precision, reads, regrouped, sketch
from vdpcp.case import Case, RankResult
from vdpcp.harness.turns import turn
from vdpcp.harness.worker import setting_up
from vdpcp.protocol import OutputsError, Ownership, outputs_of
from vdpcp.tensor_parallel import held_part

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
DP_SEED_STRIDE = 7919  # DP replica d encodes the case's microbatch drawn with seed + d * this
# Ranks sharing a GPU take turns for the unsharded arm when the case's concurrent estimate is over this share of it.
TURNS_ABOVE = 0.8


@dataclass
class Unsharded:
    """What the unsharded arm leaves for the sharded one to be held to."""

    batch: object
    out: dict[str, torch.Tensor]  # detached
    grads: list[torch.Tensor | None]  # the parameter gradients under the summed loss, set aside from the model
    own_grads: list[torch.Tensor] | None  # this rank's own share (None: no plan to say which rows are its own)
    ran: set[str]  # layers that ran
    index: reads.Index  # its tower-input rows by their bytes, for rows of the sharded arm that carry no code
    plan: object
    weights: dict[str, list[torch.Tensor]]
    sharded: bool
    rounding: precision.Rounding | precision.Shared  # Shared: this rank's part, until summed after its turn
    graph: dict[str, bool]  # which outputs had an autograd graph (an encoder may return a bare tensor for no rows)
    gradients: bool  # whether the arms' gradients are checked (gradients_checked)
    loss: loss.Loss
    text_grads: dict[str, torch.Tensor] | None  # the prompt tables' gradients under the summed loss


def check(ctx, case: Case, impl, groups) -> RankResult:
    """Run ``case`` on this rank (its CP group in ``groups``) and compare with the unsharded encoder."""
    dtype, device = DTYPES[case.dtype], ctx.device
    result = RankResult(ctx.rank, groups.cp_rank, backend=ctx.backend, device=str(device),
                        precision=precision.in_effect(dtype, device))
    with setting_up():  # a rank first using its GPU (Memory, Clock) or building its model is behind, not hung
        clock, memory = Clock(result, device), Memory(device)
        model, result.model = model_cache.acquire(impl, case.impl, case, dtype, device)
    clock.lap("build")
    try:
        with regrouped.deterministic(device, result, model):
            with _turns(ctx, case, result):
                unsharded = _unsharded(impl, case, model, replica_spec(case, groups.dp_rank), result, groups.cp_rank,
                                       device, clock, group=groups.cp)
                _give_back(ctx)
            _sum_shared(unsharded)  # out of the turn: a collective, and a peer may be waiting for its own turn
            memory.phase("unsharded peak")
            if unsharded is not None:
                with gloo_collectives.on_gloo(groups.cp) as swap:  # uneven collectives on gloo, as on NCCL
                    _sharded(impl, case, model, unsharded, result, groups, clock)
                result.collectives = gloo_collectives.used(swap)
                memory.phase("sharded peak")
    finally:
        problem = model_cache.release(model)
        _give_back(ctx)
    if problem:
        result.failures.append(problem)
    result.memory = memory.figures(model, unsharded)
    return result


def _sum_shared(unsharded: Unsharded | None) -> None:
    """A shared exact run's parts summed over the CP group into the Rounding every rank reads (precision.Shared)."""
    if unsharded is not None and isinstance(unsharded.rounding, precision.Shared):
        with regrouped.relaxed():  # sums held to nothing bit for bit (on CUDA: index_add_'s atomic kernel)
            unsharded.rounding = unsharded.rounding.summed()


def _give_back(ctx) -> None:
    """On a GPU other ranks share, hand the memory this rank's allocator cached back to them: its turn's peak would
    otherwise stay reserved in this process while the next rank takes its turn."""
    if getattr(ctx, "shares_device", False):
        torch.cuda.empty_cache()


def _turns(ctx, case: Case, result: RankResult):
    """On a shared GPU, the unsharded arm a few ranks at a time, where all of them at once would not fit: as many at
    once as fit (at least one), each rank in a slot of its own, so that the ranks of each slot go in turn."""
    if not getattr(ctx, "shares_device", False):
        return nullcontext()
    need = budget.need(case, device="cuda")
    limit = TURNS_ABOVE * torch.cuda.get_device_properties(ctx.device).total_memory
    if need.colocated(turns=False) <= limit:
        return nullcontext()
    result.turns = True
    at_once = max((k for k in range(2, case.world_size) if need.colocated(turns=k) <= limit), default=1)
    sharing = ctx.rank // max(torch.cuda.device_count(), 1)  # its place among the ranks on its GPU (rank % GPUs)
    return turn(ctx.device, sharing % at_once)


def _unsharded(impl, case: Case, model, spec, result: RankResult, cp_rank: int, device, clock,
               group=None) -> Unsharded | None:
    """The unsharded arm, forward and backward, then its gradients set aside and its rounding measured.

    If the unsharded encoder raises, every rank raises alike before any collective (no rank hangs) and the case
    is unsharded_error, not a sharding failure. It finishes, backward too, before the sharded run: collectives
    inside a model (a tensor-parallel tower) then never interleave with the sharded run's. ``group``: the CP group
    its rounding measurement may be shared out over (precision.Share; None: this rank measures it whole); then its
    ``rounding`` is this rank's part, which _sum_shared sums."""
    batch = spec.tensors(dtype=DTYPES[case.dtype], device=device)
    batch.patches.requires_grad_(pixel_grads(impl))
    refused, index = None, reads.Index()
    with Execution(model, index, learn=True) as ran, reads.coded(batch) as coded:
        try:
            out = outputs_of(impl.encode(model, impl.inputs(coded)), f"{impl.name}.encode")
        except OutputsError:
            raise
        except Exception as err:
            refused = err
    if refused is not None:
        if regrouped.lacking(model, refused, result):  # an op with no deterministic kernel: again, allowed
            return _unsharded(impl, case, model, spec, result, cp_rank, device, clock, group)
        result.unsharded_error = f"{type(refused).__name__}: {refused}"
        return None
    try:
        return _unsharded_rest(impl, case, model, spec, result, cp_rank, device, clock, batch, out, ran, group)
    except RuntimeError as err:  # its backward (or its measuring run) ran an op with no deterministic kernel
        if not regrouped.lacking(model, err, result):
            raise
        for p in model.parameters():
            p.grad = None
        return _unsharded(impl, case, model, spec, result, cp_rank, device, clock, group)


def _unsharded_rest(impl, case: Case, model, spec, result: RankResult, cp_rank: int, device, clock, batch, out,
                    ran, group) -> Unsharded:
    """The unsharded arm after its forward: the backward, its gradients set aside, its rounding measured."""
    dtype, config = DTYPES[case.dtype], case.config
    graph = {name: t.requires_grad for name, t in out.items()}
    gradients = gradients_checked(impl, case, out, result)
    if not gradients:  # no backward: let its graph (every activation of the arm) go now
        out = {name: t.detach() for name, t in out.items()}
    # What the case expects: sharded, or encoded whole on every rank (CP=1, the opt-out, or the implementation's
    # own fallback policy below some size).
    result.replicated = impl.replicated(spec, config) if config.shard_vision else None
    sharded = config.shard_vision and result.replicated is None
    plan = impl.plan(spec, config) if sharded else None
    case_loss = loss.case_loss(case, spec, {name: t.shape for name, t in out.items()}, dtype, device)
    weights = case_loss.weights
    summed = {name: sum(w) for name, w in weights.items()}
    own_weights, own_grads, text_grads = None, None, None
    if gradients:
        own_weights = {name: _own_weight(plan, sharded, w, cp_rank, device) for name, w in weights.items()}
        if all(w is not None for w in own_weights.values()):
            own_grads = _param_grads(model, loss.features_loss(out, own_weights))
        prompt = case_loss.prompt()
        loss.merged_loss(out, prompt, case_loss.stream_weights()).backward()
        text_grads = prompt.grads()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None  # set aside: the sharded arm's gradients accumulate afresh on the same weights
    rounding = precision.Rounding()
    clock.lap("unsharded")
    if precision.low(dtype):
        with regrouped.relaxed():
            kinds = own_media(plan, spec, cp_rank)  # chunks kept to one owner
            share = _share(plan, kinds, gradients, own_grads, group, cp_rank)
            split = own_weights if own_grads is not None else None
            deal = _deal(impl, spec, out, group) if share is None and plan is None and sharded and group else None
            if deal is not None:  # no plan: vdpcp's own deal of whole media items, for the exact run alone
                kinds, share = own_media(deal, spec, cp_rank), precision.Share(group, cp_rank, deal)
                split = {name: _own_weight(deal, True, w, cp_rank, device) for name, w in weights.items()}
            rounding = precision.measure(impl, model, batch, out, grads, own_grads, summed, split, gradients,
                                         kinds=kinds, share=share)
        clock.lap("exact")
    return Unsharded(batch, {n: t.detach() for n, t in out.items()}, grads, own_grads, ran.ran(), ran.index,
                     plan, weights, sharded, rounding, graph, gradients, case_loss, text_grads)


def _share(plan, kinds, gradients: bool, own_grads, group, cp_rank: int) -> precision.Share | None:
    """The rounding measurement shared out over the CP group (precision.Share), where the plan says whose every
    media item is and, with gradients, this rank holds its own share's expectation: every rank of the group decides
    alike (the same plan, case and group). None: this rank measures it whole."""
    if group is None or kinds is None or (gradients and own_grads is None):
        return None
    return precision.Share(group, cp_rank, plan)


def _deal(impl, spec, out: dict[str, torch.Tensor], group) -> Ownership | None:
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


def gradients_checked(impl, case: Case, out: dict[str, torch.Tensor], result: RankResult) -> bool:
    """Whether this case's gradients are checked, and where a case that asks for them does not get them, why
    (``result.unchecked_grads``): a forward-only implementation has none to check, and unsharded outputs with no
    autograd graph have none to compare with. Outputs with no rows and no graph (an encoder's bare empty tensor for
    an empty microbatch) have no gradient at all: nothing is left unchecked, and nothing runs backward."""
    if not case.grads:
        return False
    if getattr(impl, "forward_only", False):
        result.unchecked_grads = "forward-only implementation (an inference tower: no backward)"
    elif not any(t.requires_grad for t in out.values()):
        if not any(t.numel() for t in out.values()):
            return False
        result.unchecked_grads = "the unsharded encode's outputs have no autograd graph"
    return result.unchecked_grads is None


def _sharded(impl, case: Case, model, ref: Unsharded, result: RankResult, groups, clock) -> None:
    """The sharded arm on the same weights, and every check against the unsharded one."""
    dtype, config, cp_rank = DTYPES[case.dtype], case.config, groups.cp_rank
    subject = impl.subject_model(model, case, dtype, ref.batch.patches.device)
    pixels = pixel_grads(impl)
    batch = replace(ref.batch, patches=ref.batch.patches.detach().clone().requires_grad_(pixels))
    prompt = ref.loss.prompt()  # before the encode, as a VLM embeds its tokens first (vdpcp.loss: why it matters)
    with Execution(subject, ref.index) as ran, comm.Collectives(groups.cp) as issued, reads.coded(batch) as coded:
        out = outputs_of(impl.encode_sharded(subject, impl.inputs(coded), config, groups.cp), f"{impl.name}.encode_sharded")
    result.encoded = ran.rows
    if not config.shard_vision and case.cp > 1 and issued.count:  # CP 1 configured, or the opt-out: the no-op
        result.failures.append(f"execution: rank {result.rank} issued {issued.count} collective(s) on its CP group "
                               f"where vision_dp_over_cp is off ({_off(config)}): it must be a no-op")

    # What really ran, on every rank: the rows whose patches reached each rank's tower, with or without a graph (a
    # collective, so every rank takes it and decides alike).
    read = _read_table(batch.spec, ran, case.cp, cp_rank, groups.cp, batch.patches.device)
    result.read = [row for row in range(read.shape[1]) if read[cp_rank, row]]
    replicated_run = case.cp > 1 and bool(read.all()) and read.shape[1] > 0
    plan = ref.plan
    if case.cp > 1 and cp_rank == 0:  # said once: every rank sees the same table
        _judge_distribution(result, read, plan, ref.sharded, replicated_run)
        if ref.sharded and not replicated_run:  # held to the partition the implementation says it balances
            _fail_into(result.unbalanced, load_balance.judge(read.tolist(), batch.spec, impl.balance(case)))
    rank_alone = ref.own_grads is not None
    if plan is not None and _contradicts(read, plan):
        plan, rank_alone = None, False  # the plan is not what ran: its per-rank checks would blame gradients
    _describe(result, batch.spec, plan, cp_rank)
    owned = config.shard_vision and not replicated_run  # the same on every rank: read is every rank's table
    may_skip = getattr(impl, "empty_rank_may_skip", False) and not result.read  # a rank with no real rows
    # What ran is known from the forward alone, so outputs-only cases are held to it too. Where the unsharded encode
    # ran no layer and returned no graph (a bare empty tensor for an empty microbatch) no rank need run one either.
    required = None
    if owned and (ref.ran or any(ref.graph.values())):  # the same on every rank: the exchange is a collective
        required = required_layers(ref.ran, ran_by_rank(ran, read, cp_rank, groups.cp), read, cp_rank)
        if not may_skip:
            _check_layers_ran(result, required, ran, plan)

    if list(out) != list(ref.out):
        result.failures.append(f"outputs: the sharded encode returned {list(out)}, the unsharded {list(ref.out)}")
        return
    for name, expected in ref.out.items():
        label = _label("outputs", name, ref.out)
        _fail(result, precision.compare_rows(label, out[name], expected, ref.rounding.outputs.get(name), "token")
              if precision.low(dtype) else precision.compare(label, out[name], expected))
        result.out_err = max(result.out_err, precision.max_abs(out[name], expected))
    if any(out[n].shape != ref.out[n].shape for n in ref.out) or not ref.gradients:
        if not ref.gradients and ref.sharded and not replicated_run:  # shapes that differ stop every rank alike
            regrouped.hold(result, impl, subject, batch, out, ref.weights, plan, read, groups.cp, grads=False,
                           watch=Execution)
        return  # every rank gathered the same shapes, so every rank stops here: no collective hangs
    if _graphless(result, out, ref.graph, groups.cp):
        return  # decided over the CP group, so every rank stops here alike

    loss.rank_loss(out, ref.loss, prompt, cp_rank).backward()
    clock.lap("sharded")
    # The comparisons below hold the gradients within tolerances, not bit for bit: deterministic algorithms off
    # (on CUDA the count sketch's index_add_ then takes its atomic kernel, not a sorting one).
    with regrouped.relaxed():
        held = [held_part(g, p, groups.tp_rank, case.tp) if g is not None else None
                for p, g in zip(subject.parameters(), ref.grads)]
        texts = prompt.grads()
        extra = (_pixel_extra(batch, ref.batch, case.cp, cp_rank, owned) if pixels else []) + list(texts.values())
        summed = _check_param_grads(result, subject, held, groups.cp, extra, dtype, ref.rounding.params)
        summed, summed_texts = summed[: len(summed) - len(texts)], summed[len(summed) - len(texts):]
        _check_text(result, texts, ref.loss.table_grads(cp_rank), ref.loss.tokens, "this rank alone")
        _check_text(result, dict(zip(texts, summed_texts)), ref.text_grads, ref.loss.tokens, "summed over ranks")
        pixels = pixels and _carried(result, summed[0])  # the same on every rank: the flags were summed over them
        if pixels:
            _check_input_grads(result, batch, ref, plan, read, summed[1:], owned)
        else:
            result.input_grad_err = math.nan  # not compared: RankResult.input_grads says why
            result.input_grads = result.input_grads or "pixels are data (the implementation declares no pixel_grads)"
        if owned and not may_skip and required is not None:
            _check_param_grads_exist(result, ref.grads, subject, required, ran.names)
        if rank_alone and replicated_run == (not ref.sharded):
            own = [held_part(g, p, groups.tp_rank, case.tp) for p, g in zip(subject.parameters(), ref.own_grads)]
            _check_rank_alone(result, subject, own, dtype, ref.rounding.own_params)
    clock.lap("gradients")
    if owned:
        regrouped.hold(result, impl, subject, batch, out, ref.weights, plan, read, groups.cp, grads=True,
                       watch=Execution, pixels=pixels)
        clock.lap("regrouped")


def _fail(result: RankResult, why: str | None) -> None:
    _fail_into(result.failures, why)


def _fail_into(lines: list[str], why: str | None) -> None:
    if why:
        lines.append(why)


def pixel_grads(impl) -> bool:
    """Whether the implementation declares its path differentiable in its pixels (Implementation.pixel_grads): its
    pixels are then handed over requiring grad, and their gradients held where its sharded path carries them."""
    return bool(getattr(impl, "pixel_grads", False))


def _pixel_extra(batch, ref_batch, cp: int, cp_rank: int, owned: bool) -> list[torch.Tensor]:
    """What the input-gradient checks sum over the CP group with the parameter gradients: whether this rank's sharded
    pixels and its unsharded ones got a gradient, the sharded gradient, and (owned) which rows it is non-zero on."""
    has = [float(batch.patches.grad is not None), float(ref_batch.patches.grad is not None)]
    grad = _grad(batch.patches)
    return [torch.tensor(has, dtype=torch.float64, device=grad.device), grad] + (
        [_holding(batch, grad, cp, cp_rank)] if owned else [])


def _carried(result: RankResult, flags: torch.Tensor) -> bool:
    """Whether the pixel gradients are compared: some rank's sharded pixels got one, and the unsharded ones did
    (``flags``: _pixel_extra's, summed over the CP group). Where not, RankResult.input_grads says which was seen."""
    sharded, unsharded = (int(f) for f in flags.tolist())
    if sharded and unsharded:
        return True
    result.input_grads = ("no CP rank's sharded pixels got a gradient" if not sharded else
                          "the unsharded encode's pixels got no gradient")
    return False


def _check_input_grads(result: RankResult, batch, ref: Unsharded, plan, read, summed: list[torch.Tensor],
                       owned: bool) -> None:
    """The pixel gradients: summed over the CP ranks against the unsharded ones, and (owned) each row's on exactly
    its owner, equal there. ``summed``: _pixel_extra's gradient and holders, summed over the CP group."""
    grad, ref_grad = _grad(batch.patches), _grad(ref.batch.patches)
    _fail(result, _compare_images(result, "input grads (summed over ranks)", summed[0], ref_grad, batch.cu_seqlens,
                                  range(len(batch.cu_seqlens) - 1), ref.rounding.input))
    if owned:
        _check_ownership(result, batch, grad, ref_grad, plan, read, summed[1], ref.rounding.input)


def _off(config) -> str:
    return "context_parallel_size=1" if config.context_parallel_size == 1 else "the opt-out"


def _graphless(result: RankResult, out: dict[str, torch.Tensor], graph: dict[str, bool], group) -> bool:
    """Whether any CP rank's sharded outputs lack the autograd graph the unsharded ones have (outputs with rows: an
    empty one has no gradient to carry, graph or not). This rank says which of its own do, in one line, with what
    it saw: no gradient can reach any tower through them, so the gradient checks are not run; the outputs and what
    ran were judged already."""
    bare = [name for name, t in out.items() if graph[name] and t.numel() and not t.requires_grad]
    if bare:
        rows = next(iter(out.values())).shape[0]
        read = f"its tower read rows {result.read}" if result.read else "its tower read no row"
        result.failures.append(f"outputs {', '.join(map(repr, bare))} on rank {result.rank} (CP rank {result.cp_rank}) "
                               f"hold {rows} rows and require no grad, where the unsharded ones carry an autograd graph "
                               f"({read}): no gradient flows back through them")
    flag = torch.tensor([float(bool(bare))], dtype=torch.float64, device=next(iter(out.values())).device)
    return bool(comm.all_reduce_sum(flag, group).item()) if group is not None else bool(bare)


def _label(what: str, name: str, outputs: dict) -> str:
    return what if len(outputs) == 1 else f"{what} {name!r}"


def replica_spec(case: Case, dp_rank: int):
    """The microbatch DP replica ``dp_rank`` encodes: the case's shapes, its own pixels."""
    return case.spec if dp_rank == 0 else replace(case.spec, seed=(case.spec.seed + DP_SEED_STRIDE * dp_rank) % 2**64)


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
    return torch.tensor(plan.own_tokens(rank), dtype=torch.bool, device=device)


def own_media(plan, spec, rank: int) -> tuple[str, ...] | None:
    """Per media item of ``spec``, whether its rows are all this rank's own in ``plan``, none, or some (None
    without a plan that covers the microbatch): the exact run's chunks keep them apart (precision.measure)."""
    if plan is None or len(plan.owner) != len(spec.images):
        return None
    rows = spec.media_rows
    kinds = ({plan.owner[row] == rank for row in range(rows[m], rows[m + 1])} for m in range(len(rows) - 1))
    return tuple("own" if kind == {True} else "other" if kind == {False} else "mixed" for kind in kinds)


# --- what ran --------------------------------------------------------------------------------------------


class Execution:
    """What a model's layers really ran on: forward pre-hooks on every module that holds parameters itself, from
    construction until ``close()`` (or the end of a ``with`` block).

    ``rows``: rows the first such module to run saw, summed over its calls, whatever the grad mode; ``ran()``: the
    modules that saw at least one row (a module called on nothing did not run); ``read``: the microbatch rows whose
    patches reached any of them, read off their inputs' row codes (vdpcp.reads: inside ``reads.coded``), or looked
    up by their bytes in ``index`` where an input carries none. Each module gets its inputs without their
    tangents, so forward-mode AD never runs inside the tower. ``learn``: the rows that carry codes go into
    ``index`` (the unsharded arm), for the sharded arm's look-ups.
    """

    def __init__(self, model: torch.nn.Module, index: reads.Index | None = None, learn: bool = False):
        self.calls: dict[str, int] = {}
        self.first: str | None = None
        self.read: set[int] = set()
        self.index, self.learn = index, learn
        # Not the root: a tower's encode and project are often called apart, never through its forward.
        self.names = [name for name, m in model.named_modules()
                      if name and any(True for _ in m.parameters(recurse=False))]
        self._handles = [module.register_forward_pre_hook(self._hook(name), with_kwargs=True)
                         for name, module in model.named_modules() if name in self.names]

    def _hook(self, name: str):
        def record(module, args, kwargs):
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            rows = input_rows(module, tensor)
            self.first = self.first or name
            self.calls[name] = self.calls.get(name, 0) + rows
            return self._seen(module, name, args, kwargs)
        return record

    def _seen(self, module, name: str, args: tuple, kwargs: dict):
        """The rows ``module``'s tensor inputs hold, recorded; its inputs without tangents, where any had one."""
        def plain(value):
            if not isinstance(value, torch.Tensor):
                return value
            primal, rows = reads.seen(module, name, value, self.index, self.learn)
            self.read |= rows
            return primal

        stripped = tuple(plain(a) for a in args), {key: plain(v) for key, v in kwargs.items()}
        changed = any(a is not b for a, b in zip(stripped[0], args)) or any(
            stripped[1][key] is not v for key, v in kwargs.items())
        return stripped if changed else None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> Execution:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def rows(self) -> int:
        return self.calls.get(self.first, 0) if self.first else 0

    def ran(self) -> set[str]:
        return {name for name, rows in self.calls.items() if rows > 0}


def input_rows(module: torch.nn.Module, tensor: torch.Tensor | None) -> int:
    """Rows a module takes: its input's elements over one row's. A convolution's row is one kernel window over
    every input channel (a patch, for a tower's patch embedding, however its input is shaped); anything
    else's is the last dimension."""
    if tensor is None or tensor.dim() == 0:
        return 0
    if isinstance(module, reads.CONVOLUTIONS):
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


def _read_table(spec, ran: Execution, cp: int, cp_rank: int, cp_group, device) -> torch.Tensor:
    """[CP ranks, rows], True where a microbatch row's patches reached that rank's tower (Execution.read: seen at
    the tower's inputs, whatever the grad mode). Placeholders and padding carry no row, so they read nothing; a
    tower run on every image reads every row, with or without a graph. One collective, every rank alike."""
    rows = len(spec.images)
    table = torch.zeros(cp, rows, dtype=torch.float64, device=device)
    table[cp_rank, sorted(r for r in ran.read if r < rows)] = 1.0
    return comm.all_reduce_sum(table, cp_group) > 0


def _readers(read: torch.Tensor, row: int) -> list[int]:
    return read[:, row].nonzero().flatten().tolist()


def _contradicts(read: torch.Tensor, plan) -> bool:
    return len(plan.owner) != read.shape[1] or any(_readers(read, row) != [owner] for row, owner in enumerate(plan.owner))


def _judge_distribution(result: RankResult, read: torch.Tensor, plan, sharded: bool, replicated_run: bool) -> None:
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
        result.not_sharded.append(f"not sharded: every CP rank's tower read all {rows} rows, so the microbatch was "
                                  f"encoded {cp} times (vision_dp_over_cp is on at CP={cp})")
        return
    readers = {row: _readers(read, row) for row in range(rows)}
    twice = [f"row {row} on ranks {ranks}" for row, ranks in readers.items() if len(ranks) > 1]
    if twice:
        result.not_sharded.append(f"not sharded: {len(twice)} of {rows} rows encoded on more than one rank "
                                  f"({_few(twice)})")
    nowhere = [str(row) for row, ranks in readers.items() if not ranks]
    if nowhere:
        result.failures.append(f"execution: row(s) {_few(nowhere)} reached no rank's tower (no rank's tower input held "
                               f"their pixels)")
    if plan is not None:
        moved = [f"row {row} encoded on rank {ranks[0]}, the plan says rank {plan.owner[row]}"
                 for row, ranks in readers.items() if len(ranks) == 1 and row < len(plan.owner) and ranks != [plan.owner[row]]]
        if moved:
            result.plan_mismatch.append(f"plan mismatch: {_few(moved)}")


def _few(items: list[str], n: int = 4) -> str:
    return "; ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


# --- gradients ---------------------------------------------------------------------------------------------


def _holding(batch, grad, cp: int, cp_rank: int) -> torch.Tensor:
    """[CP ranks, rows]: 1 in this rank's line where its input gradient for a microbatch row is non-zero (summed
    over ranks, which ranks hold each row's gradient)."""
    cu = [int(c) for c in batch.cu_seqlens]
    nonzero = torch.zeros(cp, len(cu) - 1, dtype=torch.float64, device=grad.device)
    for row in range(len(cu) - 1):
        nonzero[cp_rank, row] = float(bool(grad[:, cu[row] : cu[row + 1]].any()))
    return nonzero


def _check_ownership(result, batch, grad, ref_grad, plan, read, holders, slack) -> None:
    """Every image row's gradient is non-zero on exactly one rank, its owner (the plan's, or the one rank whose
    tower read it), and equals the unsharded one there. ``holders``: _holding summed over the CP ranks;
    ``slack``: per microbatch row, as the unsharded run measured it (precision.Rounding.input; None in float64)."""
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
    _fail(result, _compare_images(result, "input grads (own images)", grad, ref_grad, cu, mine, slack))


def _compare_images(result, what: str, actual, expected, cu_seqlens, rows, slack) -> str | None:
    """The input gradients of microbatch ``rows``: element by element in float64, per image row below it."""
    cu = [int(c) for c in cu_seqlens]
    rows = list(rows)
    picked = torch.cat([torch.arange(cu[r], cu[r + 1]) for r in rows]) if rows else torch.zeros(0, dtype=torch.long)
    picked = picked.to(actual.device)
    a, e = actual[:, picked], expected[:, picked]
    result.input_grad_err = max(result.input_grad_err, precision.max_abs(a, e))
    if not precision.low(actual.dtype):
        return precision.compare(what, a, e)
    sub_cu = [0]
    for r in rows:
        sub_cu.append(sub_cu[-1] + cu[r + 1] - cu[r])
    slack = slack[rows] if isinstance(slack, torch.Tensor) else None
    return precision.compare_rows(what, a, e, slack, "image", cu_seqlens=sub_cu, names=rows)


def _check_param_grads(result, model, expected, group, extra, dtype, slack) -> list[torch.Tensor]:
    """The parameter gradients summed over ``group`` against ``expected`` (one per parameter, in order; None:
    the unsharded run gives none), in buckets of precision.BUCKET elements: one collective per bucket, the first
    also carrying the ``extra`` tensors to sum (returned summed). float64 element by element (the first parameter
    off is named); below it as one vector within rtol + ``slack``."""
    params = [(name, p) for name, p in model.named_parameters()]
    low = precision.low(dtype)
    if low and sketch.pays(sum(p.numel() for _, p in params)):
        return _check_sketched_param_grads(result, [p for _, p in params], expected, group, extra, dtype, slack)
    diff_sq = scale_sq = 0.0
    summed_extra = None
    for bucket in _buckets([p for _, p in params]) or [[]]:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in (params[i][1] for i in bucket)]
        parts = comm.all_reduce_sums((extra if summed_extra is None else []) + grads, group)
        if summed_extra is None:
            summed_extra, parts = parts[: len(extra)], parts[len(extra):]
        def pairs(bucket=bucket, parts=parts):  # a generator each time: a missing gradient's zeros one run at a time
            return ((params[i][0], got, expected[i] if expected[i] is not None else torch.zeros_like(got))
                    for i, got in zip(bucket, parts))

        result.param_grad_err = max(result.param_grad_err, precision.max_abs_each(pairs()))
        if low:
            bucket_diff_sq, bucket_scale_sq = precision.squared_norms(pairs())
            diff_sq, scale_sq = diff_sq + bucket_diff_sq, scale_sq + bucket_scale_sq
        elif not any("param grads (summed over ranks)" in f for f in result.failures):
            _fail(result, precision.compare_each("param grads (summed over ranks)", pairs()))
    if low:
        _fail(result, precision.compare_vector("param grads (summed over ranks)", diff_sq, scale_sq, dtype, slack))
    return summed_extra


def _check_sketched_param_grads(result, params, expected, group, extra, dtype, slack) -> list[torch.Tensor]:
    """_check_param_grads for a tower with more parameters than vdpcp.sketch.WIDTH, below float64: the ranks sum
    count sketches of their gradients, not the gradients, so |summed - expected| is an estimate (vdpcp.sketch says
    how close) and no element-wise figure exists: ``param_grad_err`` is NaN, not measured (the report's "-")."""
    summed_extra = comm.all_reduce_sums(extra, group) if extra else []
    device = params[0].device
    mine, want = sketch.sketch(zip((p.grad for p in params), expected), device)
    diff_sq = (comm.all_reduce_sum(mine, group) - want).square().sum().item()
    scale_sq = sum(e.double().square().sum().item() for e in expected if e is not None)
    result.param_grad_err = math.nan
    _fail(result, precision.compare_vector("param grads (summed over ranks)", diff_sq, scale_sq, dtype, slack))
    return summed_extra


def _check_text(result, got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tokens, how: str) -> None:
    """The prompt tables' gradients (vdpcp.loss), bit for bit: they are the loss weights, odd sixteenths, exact in
    every dtype however ranks sum them. Which rows of the merged stream differ says where it was seen."""
    for name, want in expected.items():
        a, e = got[name].index_select(0, tokens[name]), want.index_select(0, tokens[name])  # in stream order
        differ = a.ne(e).reshape(e.shape[0], -1).any(dim=1)
        if bool(differ.any()):
            rows = differ.nonzero().flatten().tolist()
            vision = [r for r in rows if loss.TEXT_BEFORE <= r < e.shape[0] - loss.TEXT_AFTER]
            result.failures.append(
                f"{_label('text grads', name, expected)} ({how}): rank {result.rank} (CP rank {result.cp_rank})'s "
                f"gradient of the text stream the outputs merge into differs from the unsharded run's in {len(rows)} "
                f"of {e.shape[0]} rows, {len(vision)} of them vision rows (max abs {precision.max_abs(a, e):.3g}): "
                f"a consumer of the merged stream's gradient saw it changed")


def _check_rank_alone(result, model, expected, dtype, slack) -> None:
    """This rank's own parameter gradients against its own share of the unsharded ones (no collective)."""
    def pairs():  # a generator each time: a missing gradient's zeros one run at a time, never a tower's worth
        return ((name, p.grad if p.grad is not None else torch.zeros_like(p), want)
                for (name, p), want in zip(model.named_parameters(), expected))

    result.param_grad_err = max(result.param_grad_err, precision.max_abs_each(pairs()))
    if precision.low(dtype):
        _fail(result, precision.compare_vector("param grads (this rank alone)", *precision.squared_norms(pairs()),
                                               dtype, slack))
    else:
        _fail(result, precision.compare_each("param grads (this rank alone)", pairs()))


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


def ran_by_rank(ran: Execution, read: torch.Tensor, cp_rank: int, group) -> list[set[str]]:
    """The layers each CP rank ran (Execution.ran), exchanged in one collective that every rank takes."""
    mine = ran.ran()
    table = torch.zeros(read.shape[0], len(ran.names), dtype=torch.float64, device=read.device)
    table[cp_rank] = torch.tensor([float(name in mine) for name in ran.names], dtype=torch.float64)
    table = comm.all_reduce_sum(table, group)
    return [{name for name, hit in zip(ran.names, line.tolist()) if hit} for line in table]


def required_layers(reference_ran: set[str], ran: list[set[str]], read: torch.Tensor, cp_rank: int) -> set[str]:
    """The layers CP rank ``cp_rank`` must have run: those of the unsharded run that ran on EVERY CP rank holding
    real rows (``read``: the read table). A layer only some rows take (RADIO's separate video embedder, which a rank
    of images alone never runs) is then required only where every share took it; the trunk every row passes
    through (where a tensor-parallel or FSDP peer would hang) stays required on every rank.

    A rank holding only placeholders is the one such a layer can still wrong: a placeholder is a 1x1 image, so
    where every real share is video it takes the image embedder instead. Its rows visibly took another branch when
    it ran layers no rank holding real rows ran; each such layer excuses one required layer it did not run (a
    branch for a branch), so a rank that runs an embedder and skips the trunk still fails."""
    real = [r for r in range(read.shape[0]) if bool(read[r].any())]
    shared = set(reference_ran).intersection(*(ran[r] for r in real)) if real else set(reference_ran)
    if cp_rank in real:
        return shared
    skipped = shared - ran[cp_rank]
    own_branch = ran[cp_rank] - set().union(*(ran[r] for r in real))
    return shared & ran[cp_rank] if len(own_branch) >= len(skipped) else shared


def _check_layers_ran(result, required: set[str], ran: Execution, plan=None) -> None:
    """The tower ran on this rank: on some row, and through every layer ``required`` (required_layers); known from
    the forward alone, so no gradient is needed. A failure says what this rank read and ran, and what ``plan`` (the
    implementation's, where it states one that held) gave it."""
    skipped = sorted(required - ran.ran())
    whose = f"rank {result.rank} (CP rank {result.cp_rank})"
    if not ran.ran():
        read = f"read rows {result.read}" if result.read else "read no row"
        never = f"; layers never run: {', '.join(skipped[:3])}" if skipped else ""
        result.failures.append(f"execution: {whose} {read} and ran no layer of its tower ({_given(plan, result.cp_rank)}"
                               f"{never}); every rank must run its tower, placeholders included")
    elif skipped:
        result.failures.append(f"execution: {whose} skipped {len(skipped)} layer(s) that every rank holding real rows "
                               f"ran ({', '.join(skipped[:3])}); a rank must run its whole tower, placeholders included")


def _given(plan, cp_rank: int) -> str:
    """What the implementation's plan gives a rank, in words."""
    if plan is None:
        return "no plan says what it holds"
    rows = plan.rows_of(cp_rank)
    placeholders = plan.placeholders[cp_rank] if cp_rank < len(plan.placeholders) else 0
    return (f"its plan gives it {f'rows {rows}' if rows else 'no row'} and "
            f"{placeholders or 'no'} placeholder{'' if placeholders == 1 else 's'}")


def _check_param_grads_exist(result, reference_grads, model, required: set[str], layers: list[str]) -> None:
    """Every parameter the unsharded run gives a gradient has one here (a skipped tower leaves them None, which
    summing would read as zeros), where its layer is ``required`` on this rank; a parameter outside every layer
    Execution watches (the root's own) always."""
    watched = set(layers)
    missing = [name for (name, p), g in zip(model.named_parameters(), reference_grads)
               if g is not None and p.grad is None and (_layer_of(name) in required or _layer_of(name) not in watched)]
    if missing:
        result.failures.append(f"execution: rank {result.rank} (CP rank {result.cp_rank}) has no gradient for "
                               f"{len(missing)} parameter(s) the unsharded run gives one ({', '.join(missing[:3])})")


def _layer_of(parameter: str) -> str:
    """The module that holds a parameter itself, by its name ("blocks.0.attn.qkv.weight" -> "blocks.0.attn.qkv")."""
    return parameter.rpartition(".")[0]


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _param_grads(model, of: torch.Tensor) -> list[torch.Tensor]:
    """d of / d params, one per parameter, leaving the graph for the full backward."""
    params = list(model.parameters())
    grads = torch.autograd.grad(of, params, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


# --- what a rank held and how long it took ------------------------------------------------------------------


class Clock:
    """Seconds per phase of a case on this rank (build, unsharded, exact, sharded, gradients: their sums over ranks
    and comparison), into ``result.seconds``. On CUDA each lap waits for the device first: kernels run after the
    host queued them, so an unsynchronised lap bills a phase's GPU work to whichever later phase first waits for
    a result (on the H200 in float32, the exact run, which runs without deterministic algorithms, read 1.25 s or
    5.35 s by whether the arms before it ran under them: unsynchronised, the phases could not say which was slow)."""

    def __init__(self, result: RankResult, device: torch.device | None = None):
        self.result, self.device = result, device
        self.last = self._now()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.result.seconds[phase] = round(now - self.last, 4)
        self.last = now

    def _now(self) -> float:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class Memory:
    """On CUDA, this rank's peak allocated bytes over the case and what it held (vdpcp bench towers prints it)."""

    def __init__(self, device: torch.device):
        self.device, self.peaks = device, {}
        if device.type == "cuda":
            torch.cuda.init()  # a worker's first case: resetting the allocator's statistics needs CUDA up
            torch.cuda.reset_peak_memory_stats(device)

    def phase(self, name: str) -> None:
        """The peak since the last phase, as ``name``; the next phase's counted from now."""
        if self.device.type == "cuda":
            self.peaks[name] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def figures(self, model, unsharded: Unsharded | None) -> dict[str, int]:
        held = {"model": _bytes(model.parameters()) + _bytes(model.buffers())}
        if unsharded is not None:
            held["unsharded grads"] = _bytes(unsharded.grads)
            held["rank-alone grads"] = _bytes(unsharded.own_grads or [])
        if self.peaks:
            held.update(self.peaks)
            held["peak"] = max(self.peaks.values())
        return held


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
