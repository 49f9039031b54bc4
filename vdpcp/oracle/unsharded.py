"""The unsharded arm: the implementation's own unsharded encoder, forward and backward on this rank, its gradients
set aside and its rounding measured; what it leaves (Unsharded) is what the sharded arm is held to."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from vdpcp.contract.protocol import OutputsError, outputs_of
from vdpcp.feature import comm, loss
from vdpcp.feature.grads import grad_or_zeros, or_zeros
from vdpcp.feature.pixels import handed, loader_pixels, moves_pixels
from vdpcp.matrix.case import Case
from vdpcp.oracle.compare import determinism, precision, rounding, sketch
from vdpcp.oracle.compare.weights import dealt_ownership, own_media, owned_weight
from vdpcp.oracle.context import Arm
from vdpcp.oracle.observe import reads, traffic
from vdpcp.oracle.observe.execution import Execution

# A case's dtype names (vdpcp.matrix.case.DTYPES) as torch's dtypes.
TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
DP_SEED_STRIDE = 7919  # DP replica d encodes the case's microbatch drawn with seed + d * this


@dataclass
class Unsharded:
    """What the unsharded arm leaves for the sharded one to be held to."""

    batch: object
    out: dict[str, torch.Tensor]  # detached
    # the summed loss's parameter gradients, set aside; None while they are the CP ranks' own shares (``summed_over``),
    # and where too large to send, so the summed check sums the shares' sketches (vdpcp.oracle.compare.sketch)
    grads: list[torch.Tensor | None] | None
    own_grads: list[torch.Tensor] | None  # this rank's own share (None: no plan to say which rows are its own)
    ran: set[str]  # layers that ran
    index: reads.Index  # its tower-input rows by their bytes, for rows of the sharded arm that carry no code
    plan: object
    weights: dict[str, list[torch.Tensor]]
    sharded: bool
    rounding: rounding.Rounding | rounding.Shared  # Shared: this rank's part, until summed after its turn
    graph: dict[str, bool]  # which outputs had an autograd graph (an encoder may return a bare tensor for no rows)
    gradients: bool  # whether the arms' gradients are checked (gradients_checked)
    loss: loss.Loss
    text_grads: dict[str, torch.Tensor] | None  # the prompt tables' gradients under the summed loss
    given: list[bool] | None = None  # which parameters the summed loss gives a gradient
    summed_over: object = None  # the CP group whose ranks' own shares sum to the summed loss's gradients (_sum_split)
    host_copies: int | None = None  # bytes of host pixels its encode copied to the device (vdpcp.oracle.observe.traffic)
    replicated: str | None = None  # why the implementation's fallback policy encodes this microbatch whole (RankResult)
    unchecked_grads: str | None = None  # why a case that asks for gradients does not check them (RankResult)


class Unencodable(Exception):
    """The unsharded encoder raised: the spec cannot be encoded at all (RankResult.unsharded_error)."""


def sum_shared(unsharded: Unsharded | None) -> None:
    """What the unsharded arm left in parts summed over the CP group: the summed loss's gradients where each rank
    took the backward of its own share alone (_sum_split), and a shared exact run's parts into the Rounding every
    rank reads (rounding.Shared). Collectives: the oracle takes them outside any turn."""
    if unsharded is None:
        return
    with determinism.relaxed():  # sums held to nothing bit for bit (on CUDA: index_add_'s atomic kernel)
        if unsharded.summed_over is not None:
            _sum_split(unsharded)
        if isinstance(unsharded.rounding, rounding.Shared):
            unsharded.rounding = unsharded.rounding.summed()


def _sum_split(unsharded: Unsharded) -> None:
    """The summed loss's gradients from the CP ranks' own shares (splits): every row has one owner, so the shares
    add up to the summed loss, and its gradients are their sum. Summed here: which parameters any share gives a
    gradient, the pixels' gradient, and, where sending them costs less than sketching (vdpcp.oracle.compare.sketch.pays), the
    parameter gradients; a larger tower's summed check sums sketches of the shares instead (oracle.gradients)."""
    own, patches = unsharded.own_grads, unsharded.batch.patches
    device = own[0].device if own else patches.device
    flags = torch.tensor([float(g) for g in unsharded.given] + [float(patches.grad is not None)], dtype=torch.float64,
                         device=device)
    pixels = [grad_or_zeros(patches).to(device)] if patches.requires_grad else []
    whole = not sketch.pays(sum(g.numel() for g in own))
    summed = comm.all_reduce_sums([flags] + pixels + (own if whole else []), unsharded.summed_over)
    flags, rest = summed[0].tolist(), summed[1:]
    unsharded.given = [bool(f) for f in flags[:-1]]
    if pixels:
        grad = rest.pop(0)
        patches.grad = grad.to(patches.device) if flags[-1] else None
    if whole:
        unsharded.grads = [g if given else None for g, given in zip(rest, unsharded.given)]


def held_config(impl, case: Case):
    """The configuration the case holds the implementation to: the case's own, except that an implementation with
    no opt-out (``has_opt_out`` False: it shards at every CP above 1, by design) is held to sharding where the case
    turns the feature off; its encode is still handed the case's own configuration."""
    config = case.config
    if not getattr(impl, "has_opt_out", True) and not config.vision_dp_over_cp and config.context_parallel_size > 1:
        return replace(config, vision_dp_over_cp=True)
    return config


def run_unsharded(arm: Arm, spec) -> Unsharded:
    """The unsharded arm, forward and backward, then its gradients set aside and its rounding measured.

    If the unsharded encoder raises, every rank raises Unencodable alike before any collective (no rank hangs):
    the case is unsharded_error, not a sharding failure. It finishes, backward too, before the sharded run: collectives
    inside a model (a tensor-parallel tower) then never interleave with the sharded run's. ``arm.cp_group``: the CP
    group its rounding measurement may be shared out over (rounding.Share; None: this rank measures it whole);
    then its ``rounding`` is this rank's part, which sum_shared sums."""
    impl, case, model = arm.impl, arm.case, arm.model
    batch = handed(spec, case.pixels, arm.dtype, arm.device, host=loader_pixels(impl) == "host")
    batch.patches.requires_grad_(pixel_grads(impl))
    refused, index = None, reads.Index()
    copies = traffic.Copies(batch.patches, arm.device) if moves_pixels(impl, case.pixels) else nullcontext()
    with Execution(model, index, learn=True) as ran, reads.coded(batch) as coded, copies:
        try:
            out = outputs_of(impl.encode(model, impl.inputs(coded)), f"{impl.name}.encode")
        except OutputsError:
            raise
        except Exception as err:
            refused = err
    if refused is not None:
        if determinism.lacking(model, refused, arm.telemetry):  # an op with no deterministic kernel: again, allowed
            return run_unsharded(arm, spec)
        raise Unencodable(f"{type(refused).__name__}: {refused}") from refused
    try:
        whole = copies.bytes if isinstance(copies, traffic.Copies) else None
        return replace(_unsharded_rest(arm, spec, batch, out, ran), host_copies=whole)
    except RuntimeError as err:  # its backward (or its measuring run) ran an op with no deterministic kernel
        if not determinism.lacking(model, err, arm.telemetry):
            raise
        for p in model.parameters():
            p.grad = None
        return run_unsharded(arm, spec)


def _unsharded_rest(arm: Arm, spec, batch, out, ran: Execution) -> Unsharded:
    """The unsharded arm after its forward: the backward, its gradients set aside, its rounding measured."""
    impl, case = arm.impl, arm.case
    config = held_config(impl, case)
    graph = {name: t.requires_grad for name, t in out.items()}
    gradients, unchecked = gradients_checked(impl, case, out)
    if not gradients:  # no backward: let its graph (every activation of the arm) go now
        out = {name: t.detach() for name, t in out.items()}
    # What the case expects: sharded, or encoded whole on every rank (CP=1, the opt-out, or the implementation's
    # own fallback policy below some size).
    replicated = impl.replicated(spec, config) if config.shard_vision else None
    sharded = config.shard_vision and replicated is None
    plan = impl.plan(spec, config) if sharded else None
    case_loss = loss.case_loss(case, spec, {name: t.shape for name, t in out.items()}, arm.dtype, arm.device)
    taken = _backward(arm, spec, out, case_loss, plan, sharded, gradients)
    params = list(arm.model.parameters())
    grads = [p.grad for p in params]
    given = [g is not None for g in grads]
    for p in params:
        p.grad = None  # set aside: the sharded arm's gradients accumulate afresh on the same weights
    own_grads = taken.own_grads
    if taken.summed_over is not None:
        own_grads, grads = or_zeros(grads, params), None  # this rank's share; the sum comes after (_sum_split)
    arm.lap("unsharded")
    measured = rounding.Rounding()
    if precision.low(arm.dtype):
        with determinism.relaxed():
            summed = {name: sum(w) for name, w in case_loss.weights.items()}
            ref = rounding.Reference(batch, out, grads, own_grads, summed, taken.own_weights, gradients)
            measured = _measure(arm, spec, ref, plan, sharded, case_loss.weights)
        arm.lap("exact")
    return Unsharded(batch, {n: t.detach() for n, t in out.items()}, grads, own_grads, ran.ran(), ran.index,
                     plan, case_loss.weights, sharded, measured, graph, gradients, case_loss, taken.text_grads, given,
                     taken.summed_over, replicated=replicated, unchecked_grads=unchecked)


@dataclass(frozen=True)
class _Taken:
    """What the unsharded backward took: the rank's own loss weights, its own share's gradients (None: not taken
    apart), the prompt tables' gradients, and the CP group the summed loss's gradients are the shares' sum over."""

    own_weights: dict | None = None
    own_grads: list | None = None
    text_grads: dict | None = None
    summed_over: object = None


def _backward(arm: Arm, spec, out, case_loss, plan, sharded: bool, gradients: bool) -> _Taken:
    """The unsharded backward, where gradients are checked: of this rank's own share alone where the summed loss's
    gradients are the shares' sum (splits), else of the summed loss (and, with an own share, its gradients apart)."""
    if not gradients:
        return _Taken()
    weights, model = case_loss.weights, arm.model
    own_weights = {name: owned_weight(plan, sharded, w, arm.cp_rank, arm.device) for name, w in weights.items()}
    if splits(arm.case, own_weights, sharded, own_media(plan, spec, arm.cp_rank), model, arm.cp_group):
        # one backward, of this rank's own share: the summed loss's gradients are the shares' sum
        loss.features_loss(out, own_weights).backward()
        return _Taken(own_weights, None, case_loss.table_grads(), arm.cp_group)  # the prompt's gradient: the weights
    own_grads = None
    if all(w is not None for w in own_weights.values()):
        own_grads = _param_grads(model, loss.features_loss(out, own_weights))
    prompt = case_loss.prompt()
    loss.merged_loss(out, prompt, case_loss.stream_weights()).backward()
    return _Taken(own_weights, own_grads, prompt.grads())


def _measure(arm: Arm, spec, ref: rounding.Reference, plan, sharded: bool, weights: dict):
    """The exact run that measures the arms' rounding: shared out over the CP group where ownership is known (the
    plan's, or vdpcp's own deal of whole media items), else this rank's whole. ``weights``: each CP rank's loss
    weights by output name, for an own share under vdpcp's deal."""
    group, kinds = arm.cp_group, own_media(plan, spec, arm.cp_rank)  # the exact run's chunks kept to one owner
    share = _share(plan, kinds, ref.gradients, ref.own_grads, group, arm.cp_rank)
    split = ref.own_weights if ref.own_grads is not None else None
    dealt = share is None and plan is None and sharded and group
    deal = dealt_ownership(arm.impl, spec, ref.out, group) if dealt else None
    if deal is not None:  # no plan: vdpcp's own deal of whole media items, for the exact run alone
        kinds, share = own_media(deal, spec, arm.cp_rank), rounding.Share(group, arm.cp_rank, deal)
        split = {name: owned_weight(deal, True, w, arm.cp_rank, arm.device) for name, w in weights.items()}
    return rounding.measure(arm, replace(ref, own_weights=split), kinds=kinds, share=share)


def splits(case: Case, own_weights: dict, sharded: bool, kinds, model, group) -> bool:
    """Whether each CP rank takes the unsharded arm's backward of its own share alone, and the summed loss's
    gradients are the shares' sum over the CP group (_sum_split): one whole-microbatch backward a rank, not two (the
    rank-alone expectation's, then the summed loss's). Where every rank has an own share (a plan, or no sharding)
    and the sum is cheap beside a backward: in float64 where the gradients are sent as they are (a sketch would
    not do: float64 is compared element by element), below it where the exact run is shared out too
    (rounding.Share: an exact run of the whole microbatch on each rank would need the sum inside its turn). Every
    rank of the group decides alike: the same case, plan and tower."""
    if group is None or case.cp < 2 or any(w is None for w in own_weights.values()):
        return False
    if precision.low(TORCH_DTYPES[case.dtype]):
        return sharded and kinds is not None
    return not sketch.pays(sum(p.numel() for p in model.parameters()))


def _share(plan, kinds, gradients: bool, own_grads, group, cp_rank: int) -> rounding.Share | None:
    """The rounding measurement shared out over the CP group (rounding.Share), where the plan says whose every
    media item is and, with gradients, this rank holds its own share's expectation: every rank of the group decides
    alike (the same plan, case and group). None: this rank measures it whole."""
    if group is None or kinds is None or (gradients and own_grads is None):
        return None
    return rounding.Share(group, cp_rank, plan)


def gradients_checked(impl, case: Case, out: dict[str, torch.Tensor]) -> tuple[bool, str | None]:
    """Whether this case's gradients are checked, and where a case that asks for them does not get them, why
    (RankResult.unchecked_grads): a forward-only implementation has none to check, and unsharded outputs with no
    autograd graph have none to compare with. Outputs with no rows and no graph (an encoder's bare empty tensor for
    an empty microbatch) have no gradient at all: nothing is left unchecked, and nothing runs backward."""
    if not case.grads:
        return False, None
    if getattr(impl, "forward_only", False):
        return False, "forward-only implementation (an inference tower: no backward)"
    if not any(t.requires_grad for t in out.values()):
        if not any(t.numel() for t in out.values()):
            return False, None
        return False, "the unsharded encode's outputs have no autograd graph"
    return True, None


def pixel_grads(impl) -> bool:
    """Whether the implementation declares its path differentiable in its pixels (Implementation.pixel_grads): its
    pixels are then handed over requiring grad, and their gradients held where its sharded path carries them."""
    return bool(getattr(impl, "pixel_grads", False))


def replica_spec(case: Case, dp_rank: int):
    """The microbatch DP replica ``dp_rank`` encodes: the case's shapes, its own pixels."""
    return case.spec if dp_rank == 0 else replace(case.spec, seed=(case.spec.seed + DP_SEED_STRIDE * dp_rank) % 2**64)


def _param_grads(model, of: torch.Tensor) -> list[torch.Tensor]:
    """d of / d params, one per parameter, leaving the graph for the full backward."""
    params = list(model.parameters())
    grads = torch.autograd.grad(of, params, retain_graph=True, allow_unused=True)
    return or_zeros(grads, params)
