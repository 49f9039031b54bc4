"""``check``: one case on one rank, the two arms in order (the unsharded arm, then the sharded arm held to it on the
same weights), and the sharded arm's checks in the order they run; every collective a check takes is taken by every
CP rank alike, so a failing rank never leaves a peer waiting."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace

import torch

from vdpcp.contract.protocol import outputs_of
from vdpcp.feature import comm, loss
from vdpcp.feature.pixels import fresh, moves_pixels
from vdpcp.feature.tensor_parallel import held_part
from vdpcp.harness.turns import turn
from vdpcp.harness.worker import setting_up
from vdpcp.matrix import budget
from vdpcp.matrix.case import FAILURE, GRAD_WRITTEN, NOT_SHARDED, NOTE, UNBALANCED, Case, Finding, RankResult, Telemetry
from vdpcp.oracle import model_cache
from vdpcp.oracle.compare import determinism, precision, regrouped, rounding
from vdpcp.oracle.compare.gradients import (
    check_input_grads,
    check_param_grads,
    check_rank_alone,
    check_text,
    not_carried,
    pixel_extra,
)
from vdpcp.oracle.context import Arm, Sharded
from vdpcp.oracle.failures import found, label
from vdpcp.oracle.observe import declared_balance as load_balance
from vdpcp.oracle.observe import gloo_collectives, handed, reads, traffic
from vdpcp.oracle.observe.execution import Execution, check_layers_ran, check_param_grads_exist, ran_by_rank, required_layers
from vdpcp.oracle.observe.split import contradicts, describe, judge_distribution, read_table
from vdpcp.oracle.observe.telemetry import Clock, Memory
from vdpcp.oracle.unsharded import (
    TORCH_DTYPES,
    Unencodable,
    Unsharded,
    held_config,
    pixel_grads,
    replica_spec,
    run_unsharded,
    sum_shared,
)

# Ranks sharing a GPU take turns for the unsharded arm when the case's concurrent estimate is over this share of it.
TURNS_ABOVE = 0.8


def check(ctx, case: Case, impl, groups) -> RankResult:
    """Run ``case`` on this rank (its CP group in ``groups``) and compare with the unsharded encoder: every check's
    findings collected into the rank's result, in the order they ran."""
    dtype, device = TORCH_DTYPES[case.dtype], ctx.device
    result = RankResult(ctx.rank, groups.cp_rank, backend=ctx.backend, device=str(device),
                        precision=rounding.in_effect(dtype, device))
    figures = result.telemetry
    with setting_up():  # a rank first using its GPU (Memory, Clock) or building its model is behind, not hung
        clock, memory = Clock(figures, device), Memory(device)
        model, figures.model = model_cache.acquire(impl, case.impl, case, dtype, device)
    clock.lap("build")
    arm = Arm(impl, case, model, dtype, device, ctx.rank, groups.cp_rank, groups.cp, groups.tp_rank, clock, figures)
    try:
        with determinism.deterministic(device, figures, model):
            with _turns(ctx, case, figures):
                unsharded = _unsharded(arm, replica_spec(case, groups.dp_rank), result)
                if figures.turns:  # the next rank's turn needs what this one's cached; else it fits beside it
                    _give_back(ctx)
            sum_shared(unsharded)  # out of the turn: a collective, and a peer may be waiting for its own turn
            memory.phase("unsharded peak")
            if unsharded is not None:
                with gloo_collectives.on_gloo(groups.cp) as swap:  # uneven collectives on gloo, as on NCCL
                    result.add(_sharded(arm, unsharded, swap))
                figures.collectives = gloo_collectives.used(swap)
                memory.phase("sharded peak")
    finally:
        problem = model_cache.release(model)  # its weights proven unchanged: a fingerprint of every parameter
        clock.lap("release")
        _give_back(ctx)
        clock.lap("give back")
    result.add(found(FAILURE, ctx.rank, problem))
    figures.memory = memory.figures(model, unsharded)
    return result


def _unsharded(arm: Arm, spec, result: RankResult) -> Unsharded | None:
    """The unsharded arm, and what it says of the case into the rank's result: why its encoder could not encode the
    spec (None returned then), why the implementation's policy replicates it, why its gradients go unchecked."""
    try:
        ref = run_unsharded(arm, spec)
    except Unencodable as err:
        result.unsharded_error = str(err)
        return None
    result.replicated, result.unchecked_grads = ref.replicated, ref.unchecked_grads
    return ref


def _give_back(ctx) -> None:
    """On a GPU other ranks share, hand the memory this rank's allocator cached back to them: after its turn (its
    turn's peak would otherwise stay reserved in this process while the next rank takes its turn), and after the
    case (the next case's ranks may need it elsewhere). Not between the arms of a case that runs without turns:
    every rank's peak fits beside the others' there, and the sharded arm reuses what the unsharded one cached
    instead of asking the driver for it again."""
    if getattr(ctx, "shares_device", False):
        torch.cuda.empty_cache()


def _turns(ctx, case: Case, figures: Telemetry):
    """On a shared GPU, the unsharded arm a few ranks at a time, where all of them at once would not fit: as many at
    once as fit (at least one), each rank in a slot of its own, so that the ranks of each slot go in turn (and
    ``figures.turns`` says this rank took one)."""
    if not getattr(ctx, "shares_device", False):
        return nullcontext()
    need = budget.need(case, device="cuda")
    limit = TURNS_ABOVE * torch.cuda.get_device_properties(ctx.device).total_memory
    if need.colocated(turns=False) <= limit:
        return nullcontext()
    figures.turns = True
    at_once = max((k for k in range(2, case.world_size) if need.colocated(turns=k) <= limit), default=1)
    sharing = ctx.rank // max(torch.cuda.device_count(), 1)  # its place among the ranks on its GPU (rank % GPUs)
    return turn(ctx.device, sharing % at_once)


def _sharded(arm: Arm, ref: Unsharded, swap=None) -> list[Finding]:
    """The sharded arm on the same weights, and every check against the unsharded one, in the order they run: their
    findings, in that order."""
    run, said = _encode_sharded(arm, ref, swap)
    run, seen = _what_ran(run)
    go_on, compared = _outputs(run)
    said += seen + compared
    if not go_on:
        return said  # every rank stops here alike: no collective hangs
    written, wrote = _backward(run)
    arm.lap("sharded")
    # The comparisons below hold the gradients within tolerances, not bit for bit: deterministic algorithms off
    # (on CUDA the count sketch's index_add_ then takes its atomic kernel, not a sorting one).
    with determinism.relaxed():
        pixels, held = _gradients(run, written)
    said += wrote + held
    arm.lap("gradients")
    if run.owned:
        said += regrouped.hold(run, grads=True, pixels=pixels)
        arm.lap("regrouped")
    return said


def _encode_sharded(arm: Arm, ref: Unsharded, swap) -> tuple[Sharded, list[Finding]]:
    """The sharded encode on fresh pixels, with what it ran and the collectives it issued watched; with sharding
    off, no collective may be issued on the CP group."""
    impl, case = arm.impl, arm.case
    config = held_config(impl, case)
    device = ref.batch.device  # the tower's: the pixels may be on the host (vdpcp.feature.pixels)
    arm = replace(arm, model=impl.subject_model(arm.model, case, arm.dtype, device), device=device)
    batch = replace(ref.batch, patches=fresh(ref.batch.patches, pixel_grads(impl)))
    prompt = ref.loss.prompt()  # before the encode, as a VLM embeds its tokens first (vdpcp.feature.loss: why it matters)
    copies = traffic.Copies(batch.patches, device) if moves_pixels(impl, case.pixels) else nullcontext()
    with Execution(arm.model, ref.index) as ran, comm.Collectives(arm.cp_group, _own(swap)) as issued, \
            reads.coded(batch) as coded, copies:
        out = outputs_of(impl.encode_sharded(arm.model, impl.inputs(coded), case.config, arm.cp_group),
                         f"{impl.name}.encode_sharded")
    arm.telemetry.encoded = ran.rows
    said = []
    if not config.shard_vision and case.cp > 1 and issued.count:  # CP 1 configured, or the opt-out: the no-op
        said = found(FAILURE, arm.rank, f"execution: rank {arm.rank} issued {issued.count} collective(s) on its CP "
                                        f"group where vision_dp_over_cp is off ({_off(config)}): it must be a no-op")
    return Sharded(arm, ref, batch, prompt, out, ran, copies), said


def _what_ran(run: Sharded) -> tuple[Sharded, list[Finding]]:
    """What really ran, on every rank: the rows whose patches reached each rank's tower, with or without a graph (a
    collective, so every rank takes it and decides alike); the host copies, the distribution and the balance held
    to what the case expects; and the layers this rank ran held to those it must have."""
    arm, ref = run.arm, run.ref
    case, cp_rank, figures = arm.case, arm.cp_rank, arm.telemetry
    read = read_table(run.batch.spec, run.ran, case.cp, cp_rank, arm.cp_group, arm.device)
    figures.read = [row for row in range(read.shape[1]) if read[cp_rank, row]]
    replicated_run = case.cp > 1 and bool(read.all()) and read.shape[1] > 0
    said = _copies(run, replicated_run) if isinstance(run.copies, traffic.Copies) else []
    plan = ref.plan
    if case.cp > 1 and cp_rank == 0:  # said once: every rank sees the same table
        said += judge_distribution(arm.rank, read, plan, ref.sharded, replicated_run, ref.replicated)
        if ref.sharded and not replicated_run:  # held to the partition the implementation says it balances
            said += found(UNBALANCED, arm.rank, load_balance.judge(read.tolist(), run.batch.spec,
                                                                   arm.impl.balance(case)))
    rank_alone = ref.own_grads is not None
    if plan is not None and contradicts(read, plan):
        plan, rank_alone = None, False  # the plan is not what ran: its per-rank checks would blame gradients
    describe(figures, run.batch.spec, plan, cp_rank)
    owned = held_config(arm.impl, case).shard_vision and not replicated_run  # the same on every rank
    may_skip = getattr(arm.impl, "empty_rank_may_skip", False) and not figures.read  # a rank with no real rows
    # What ran is known from the forward alone, so outputs-only cases are held to it too. Where the unsharded encode
    # ran no layer and returned no graph (a bare empty tensor for an empty microbatch) no rank need run one either.
    required = None
    if owned and (ref.ran or any(ref.graph.values())):  # the same on every rank: the exchange is a collective
        required = required_layers(ref.ran, ran_by_rank(run.ran, read, cp_rank, arm.cp_group), read, cp_rank)
        if not may_skip:
            said += check_layers_ran(arm, required, run.ran, plan)
    return replace(run, read=read, replicated_run=replicated_run, plan=plan, rank_alone=rank_alone, owned=owned,
                   may_skip=may_skip, required=required), said


def _copies(run: Sharded, replicated_run: bool) -> list[Finding]:
    """The host pixels this rank copied to its device: outputs made in host memory, and more copied than its share."""
    copies, ref, arm = run.copies, run.ref, run.arm
    arm.telemetry.host_copies = copies.bytes
    said = _in_host_memory(arm, run.out, copies)
    if ref.sharded and not replicated_run and ref.host_copies is not None:  # encoded whole on purpose: moved whole
        said += found(NOT_SHARDED, arm.rank, traffic.judge(copies.bytes, ref.host_copies, arm.telemetry.read,
                                                           run.batch.spec, arm.rank, arm.case.cp))
    return said


def _outputs(run: Sharded) -> tuple[bool, list[Finding]]:
    """The gathered outputs against the unsharded ones: whether the gradient checks go on (the same on every rank),
    and the findings."""
    out, ref, arm = run.out, run.ref, run.arm
    if list(out) != list(ref.out):
        return False, found(FAILURE, arm.rank, f"outputs: the sharded encode returned {list(out)}, the unsharded "
                                               f"{list(ref.out)}")
    said = _as_unsharded(arm, out, ref.out)
    for name, expected in ref.out.items():
        what = label("outputs", name, ref.out)
        said += found(FAILURE, arm.rank, precision.compare_rows(what, out[name], expected,
                                                                ref.rounding.outputs.get(name), "token")
                      if precision.low(arm.dtype) else precision.compare(what, out[name], expected))
        arm.telemetry.out_err = max(arm.telemetry.out_err, precision.max_abs(out[name], expected))
    if any(out[n].shape != ref.out[n].shape for n in ref.out) or not ref.gradients:
        if not ref.gradients and ref.sharded and not run.replicated_run:  # shapes that differ stop every rank alike
            said += regrouped.hold(run, grads=False)
        return False, said  # every rank gathered the same shapes, so every rank stops here
    stop, bare = _graphless(arm, out, ref.graph, arm.cp_group)  # decided over the CP group: every rank alike
    return not stop, said + bare


def _backward(run: Sharded) -> tuple[dict, list[Finding]]:
    """This rank's loss backward, with the gradient each output's backward is handed kept, and what it wrote into
    it: a finding of its own, or a note where the implementation says its model's merges copy."""
    arm = run.arm
    with handed.Handed(run.out) as kept:
        loss.rank_loss(run.out, run.ref.loss, run.prompt, arm.cp_rank).backward()
    written = kept.written()
    if not written:
        return written, []
    return written, found(NOTE if getattr(arm.impl, "merges_copy", False) else GRAD_WRITTEN, arm.rank,
                          handed.line(arm, written))


def _gradients(run: Sharded, written: dict) -> tuple[bool, list[Finding]]:
    """The gradient checks: parameters summed over ranks (with the text streams and pixel flags in the same
    collectives), the text stream's, the pixels', every required parameter's, this rank's own; whether the pixels'
    gradients were compared (the same on every rank), and the findings."""
    arm, ref, figures = run.arm, run.ref, run.arm.telemetry
    held = _held(ref.grads, arm)
    shares = _held(ref.own_grads, arm) if ref.grads is None else None
    texts = run.prompt.grads()
    wrote = handed.in_tables(written, ref.loss)  # what the write added to the text stream's gradient, if it read it
    streams = list(texts.values()) + list(wrote.values())
    pixels = pixel_grads(arm.impl)
    extra = (pixel_extra(run.batch, ref.batch, arm.case.cp, arm.cp_rank, run.owned) if pixels else []) + streams
    shares_sketch = ref.rounding.own_share_sketch(arm.case.tp, arm.device) if shares is not None else None
    summed, said = check_param_grads(arm, held, extra, ref.rounding.params, shares, shares_sketch)
    summed, summed_texts, summed_wrote = (summed[: len(summed) - len(streams)],
                                          summed[len(summed) - len(streams) : len(summed) - len(wrote)],
                                          summed[len(summed) - len(wrote):])
    said += check_text(arm, texts, ref.loss.table_grads(arm.cp_rank), ref.loss.tokens, "this rank alone", wrote)
    said += check_text(arm, dict(zip(texts, summed_texts)), ref.text_grads, ref.loss.tokens, "summed over ranks",
                       dict(zip(texts, summed_wrote)))
    uncarried = not_carried(summed[0]) if pixels else ""  # the same on every rank: the flags were summed over them
    figures.input_grads = uncarried or figures.input_grads
    pixels = pixels and not uncarried
    if pixels:
        said += check_input_grads(run, summed[1:])
    else:
        figures.input_grad_err = math.nan  # not compared: RankResult.input_grads says why
        figures.input_grads = figures.input_grads or "pixels are data (the implementation declares no pixel_grads)"
    if run.owned and not run.may_skip and run.required is not None:
        said += check_param_grads_exist(arm, ref.given, run.required, run.ran.names)
    if run.rank_alone and run.replicated_run == (not ref.sharded):
        said += check_rank_alone(arm, shares or _held(ref.own_grads, arm), ref.rounding.own_params)
    return pixels, said


def _held(grads: list | None, arm: Arm) -> list | None:
    """The plain tower's gradients as the parts the subject's parameters hold on this TP rank (all of them at TP 1)."""
    if grads is None:
        return None
    return [held_part(g, p, arm.tp_rank, arm.case.tp) if g is not None else None
            for p, g in zip(arm.model.parameters(), grads)]


def _as_unsharded(arm: Arm, out: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[Finding]:
    """Each output in the unsharded one's dtype and on its device, or a failure saying which is not (an empty rank's
    placeholder built like the pixels, say: a VLM's merge into its text stream takes neither). The output is then
    cast and moved, differentiably, so every rank runs the same checks after (no collective is skipped)."""
    said = []
    for name, want in expected.items():
        got = out[name]
        if (got.dtype, got.device) != (want.dtype, want.device):
            said += found(FAILURE, arm.rank, f"{label('outputs', name, expected)}: {got.dtype} on {got.device}, where "
                                             f"the unsharded encode's are {want.dtype} on {want.device}")
            out[name] = got.to(device=want.device, dtype=want.dtype)
    return said


def _in_host_memory(arm: Arm, out: dict[str, torch.Tensor], copies: traffic.Copies) -> list[Finding]:
    """On the stand-in (no accelerator: vdpcp.oracle.observe.traffic), outputs made in host memory, as a placeholder
    built on the pixels' device is; on a GPU the device check (_as_unsharded) says it."""
    return found(FAILURE, arm.rank, *(f"{label('outputs', name, out)}: made in host memory from the host pixels, not "
                                      f"on the tower's device (the stand-in's host: no accelerator here)"
                                      for name, t in out.items() if copies.stand_in and copies.hosts(t)))


def _own(swap):
    """The running count of the collectives vdpcp's gloo stand-ins issued of their own (none where none is in force)."""
    return (lambda: swap.own) if swap is not None else (lambda: 0)


def _off(config) -> str:
    return "context_parallel_size=1" if config.context_parallel_size == 1 else "the opt-out"


def _graphless(arm: Arm, out: dict[str, torch.Tensor], graph: dict[str, bool], group) -> tuple[bool, list[Finding]]:
    """Whether any CP rank's sharded outputs lack the autograd graph the unsharded ones have (outputs with rows: an
    empty one has no gradient to carry, graph or not). This rank says which of its own do, in one line, with what
    it saw: no gradient can reach any tower through them, so the gradient checks are not run; the outputs and what
    ran were judged already."""
    bare = [name for name, t in out.items() if graph[name] and t.numel() and not t.requires_grad]
    said = []
    if bare:
        rows, seen = next(iter(out.values())).shape[0], arm.telemetry.read
        read = f"its tower read rows {seen}" if seen else "its tower read no row"
        said = found(FAILURE, arm.rank, f"outputs {', '.join(map(repr, bare))} on {arm.whose} hold {rows} rows and "
                                        f"require no grad, where the unsharded ones carry an autograd graph ({read}): "
                                        f"no gradient flows back through them")
    flag = torch.tensor([float(bool(bare))], dtype=torch.float64, device=next(iter(out.values())).device)
    return (bool(comm.all_reduce_sum(flag, group).item()) if group is not None else bool(bare)), said
