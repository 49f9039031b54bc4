"""The exact run shared out over the CP ranks (vdpcp.oracle.compare.rounding.Share): each rank runs the chunks of the media it owns
and the figures are summed over the group. It must measure what each rank running it whole measures: each output
row's and microbatch row's figure bit for bit as its owner measures it whole (the same chunk, run by the same rank;
another rank's chunks group other media with it, which moves the last bits), the rank-alone figure bit for bit, and
the summed parameter gradients' figure to float64's rounding (summed in another order), or within the count sketch's
deviation where the tower takes the sketch."""

import math

import pytest
import torch

from vdpcp import oracle
from vdpcp.contract.protocol import Ownership, outputs_of
from vdpcp.feature import comm, loss
from vdpcp.impls import resolve
from vdpcp.matrix.case import Case
from vdpcp.matrix.scenarios import SCENARIOS, matrix
from vdpcp.oracle import arms
from vdpcp.oracle.compare import rounding, sketch, weights
from vdpcp.oracle.context import Arm

SPECS = {s.spec.name: s.spec for s in SCENARIOS}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _Raising:
    """The reference, whose exact run raises on one rank only (a chunk only that rank runs)."""

    def __init__(self, impl, raising: bool):
        self.impl, self.raising, self.name = impl, raising, impl.name

    def inputs(self, batch):
        return self.impl.inputs(batch)

    def encode(self, model, inputs):
        if self.raising:
            raise ValueError("this rank's chunk cannot be encoded")
        return self.impl.encode(model, inputs)


def _measured(ctx, spec_name: str, dtype: str, width: int | None, raise_on: int | None = None, parts: bool = False):
    """(whole, shared) Rounding on this rank, from one unsharded run of ``spec_name`` at CP = the world size.
    ``parts``: the shared run is handed no summed gradients, only this rank's own share (the oracle's _sum_split),
    and ``whole`` is measured against the shares' sum, taken here with a collective."""
    impl, case = resolve("reference"), Case(SPECS[spec_name], ctx.world_size, dtype=dtype)
    cpu, dt = torch.device("cpu"), DTYPES[dtype]
    model = impl.build_model(case, dt, cpu)
    batch = case.spec.tensors(dtype=dt)
    batch.patches.requires_grad_(True)
    out = {"features": impl.encode(model, impl.inputs(batch))}
    summed = {"features": loss.sixteenths(torch.randn(out["features"].shape, generator=torch.Generator().manual_seed(7),
                                                        dtype=torch.float64)).to(dt)}
    plan = impl.plan(case.spec, case.config)
    mine = oracle.own_token_mask(plan, ctx.rank, cpu).unsqueeze(-1)
    own_weights = {"features": summed["features"] * mine}
    own_grads = list(torch.autograd.grad((out["features"] * own_weights["features"]).sum(), list(model.parameters()),
                                         retain_graph=True))
    (out["features"] * summed["features"]).sum().backward()
    grads = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    kinds = oracle.own_media(plan, case.spec, ctx.rank)
    share = rounding.Share(None, ctx.rank, plan)
    ref = rounding.Reference(batch, out, grads, own_grads, summed, own_weights, True)
    if raise_on is not None:
        part = rounding.measure(Arm(_Raising(impl, ctx.rank == raise_on), model=model), ref, kinds=kinds, share=share)
        try:  # this rank's part never raises: its sums do, on every rank
            part.summed()
        except Exception as err:  # noqa: BLE001 - what each rank raised is the result
            return f"{type(err).__name__}: {err}"
        return "no error"
    saved = sketch.WIDTH
    sketch.WIDTH = width or saved  # a narrow sketch: the toy tower takes it; restored before the worker's next case
    try:
        if parts:
            ref = rounding.Reference(batch, out, comm.all_reduce_sums(own_grads), own_grads, summed, own_weights, True)
        whole = rounding.measure(Arm(impl, model=model), ref, kinds=kinds)
        if parts:
            ref = rounding.Reference(batch, out, None, own_grads, summed, own_weights, True)
        part = rounding.measure(Arm(impl, model=model), ref, kinds=kinds, share=share)
        shared = part.summed()
        held = part.own.numel() if isinstance(part.own, torch.Tensor) else sum(g.numel() for g in part.own)
    finally:
        sketch.WIDTH = saved
    return whole, shared, held, sum(p.numel() for p in model.parameters()), plan


def _owners(plan) -> tuple[list[int], list[int]]:
    """The CP rank that owns each output row and each microbatch row."""
    return [owner for owner, n in zip(plan.owner, plan.tokens) for _ in range(n)], list(plan.owner)


@pytest.mark.distributed
@pytest.mark.parametrize("spec_name, cp, dtype", [
    ("three-images", 2, "float32"),
    ("video-and-images", 3, "float32"),  # a video split between two ranks (a "mixed" chunk on both)
    ("few-tubelets-t2", 3, "bfloat16"),  # rank 2 owns nothing: it runs no chunk and adds zeros
])
def test_a_shared_exact_run_measures_what_each_rank_measures_whole(run_ranks, spec_name, cp, dtype):
    got = run_ranks(_measured, cp, spec_name, dtype, None)
    token_owner, row_owner = _owners(got[0][4])
    owners_outputs = torch.stack([got[r][0].outputs["features"][i] for i, r in enumerate(token_owner)])
    owners_input = torch.stack([got[r][0].input[i] for i, r in enumerate(row_owner)])
    for rank, (whole, shared, held, params, _) in enumerate(got):
        assert not sketch.pays(params) and held == params  # summed as they are
        assert torch.equal(shared.outputs["features"], owners_outputs), rank
        assert torch.equal(shared.input, owners_input), rank
        assert shared.own_params == whole.own_params, rank
        assert shared.params == pytest.approx(whole.params, rel=1e-6), rank
        assert 0 < whole.params and float(whole.outputs["features"].max()) > 0
    plan = got[0][4]
    kinds = {kind for rank in range(cp) for kind in oracle.own_media(plan, SPECS[spec_name], rank)}
    assert kinds >= ({"own", "other"} if cp == 2 else {"mixed", "other"}), kinds



@pytest.mark.distributed
def test_a_shared_exact_run_sums_count_sketches_for_a_tower_over_the_sketch_width(run_ranks):
    """At a width the toy tower's parameters exceed, the summed figure is the sketches' estimate: within five of
    its deviations (sqrt(2 / width) of a squared norm, for each of the two norms the figure divides)."""
    width = 1 << 12
    got = run_ranks(_measured, 2, "three-images", "float32", width)
    for whole, shared, held, params, _ in got:
        assert params > width and held == width  # between its turn and the sums a rank holds the sketch alone
        assert shared.own_params == whole.own_params
        assert shared.params == pytest.approx(whole.params, rel=5 * math.sqrt(2 / width))
    assert got[0][1].params == got[1][1].params  # every rank reads the same figure


@pytest.mark.distributed
@pytest.mark.parametrize("width", [None, 1 << 12])
def test_handed_only_the_ranks_own_shares_it_measures_their_sum_as_if_it_were_handed_it(run_ranks, width):
    """Where each rank took the backward of its own share alone, the summed gradients' figure is against the shares'
    sum: summed with the exact run's own shares, in one collective (as they are, or as count sketches)."""
    got = run_ranks(_measured, 2, "three-images", "float32", width, None, True)
    for whole, shared, held, params, _ in got:
        assert held == (width or params)  # the exact run's shares and the ranks' own: as they are, or as sketches
        assert shared.own_params == whole.own_params
        deviation = 1e-6 if width is None else 5 * math.sqrt(2 / width)
        assert 0 < shared.params == pytest.approx(whole.params, rel=deviation)
    assert got[0][1].params == got[1][1].params


@pytest.mark.distributed
def test_an_exact_run_that_raises_on_one_rank_raises_on_every_rank_and_none_waits(run_ranks):
    said = run_ranks(_measured, 2, "three-images", "float32", None, 1)
    assert said[1] == "ValueError: this rank's chunk cannot be encoded"
    assert said[0] == ("RuntimeError: rounding.measure: the exact run raised on CP rank(s) [1] of the shared exact "
                       "run (its own error is in that rank's result)")


def test_a_shared_exact_run_without_the_media_s_owners_is_refused_before_any_collective():
    impl = resolve("reference")
    with pytest.raises(ValueError, match="a shared exact run needs the media's kinds"):
        rounding.measure(Arm(impl), rounding.Reference(None, {}, [], None, {}, None, True), kinds=None,
                         share=rounding.Share(None, 0, Ownership((0,), (1,), (0,))))


# --- where the oracle shares it ----------------------------------------------------------------------------------

THREE = Case(SPECS["three-images"], 2, dtype="bfloat16")
AUTOMODEL = next(c for c in matrix(impls=("automodel",)) if c.id == "video-and-images-cp4-automodel-contiguous-balanced")
SHIPPED = next(c for c in matrix(impls=("automodel-shipped",)) if c.id == "mixed-sizes-cp2-automodel-shipped-contiguous-balanced")


def _shared_by_oracle(ctx, case, turns: bool):
    """Whether this rank's exact run was shared (the share the oracle passed), whether any collective ran inside its
    turn, and the case's failures."""
    from contextlib import contextmanager

    from vdpcp.feature import comm
    from vdpcp.matrix import runner

    seen, inside, saved = [], [], (rounding.measure, arms._turns, comm.all_reduce_sums)

    def watched(*args, share=None, **kwargs):
        seen.append(share is not None)
        return saved[0](*args, share=share, **kwargs)

    @contextmanager
    def taking_turns(ctx, case, result):
        result.turns = True
        inside.append(False)
        yield
        inside.pop()

    def sums(*args, **kwargs):
        if inside:
            inside.append("a collective inside the turn")
        return saved[2](*args, **kwargs)

    rounding.measure, comm.all_reduce_sums = watched, sums
    if turns:
        arms._turns = taking_turns
    try:
        verdict = runner.rank_body(ctx, case)
    finally:  # a warm worker runs the next case with the real ones
        rounding.measure, arms._turns, comm.all_reduce_sums = saved
    return seen, inside, verdict.failures


@pytest.mark.distributed
@pytest.mark.parametrize("case, turns, shared", [
    (THREE, False, True),  # sharded, with a plan: the ranks split the exact run
    (THREE.with_(vision_dp_over_cp=False), False, False),  # the opt-out: no plan, every rank measures it whole
    (THREE, True, True),  # ranks taking turns: each runs its part in its turn, and the sums after it
    (THREE.with_(grads=False), False, True),  # outputs only: the forward is shared too
    (AUTOMODEL.with_(dtype="bfloat16"), False, True),  # no plan, but the rows each media item gives: dealt out
    (AUTOMODEL.with_(dtype="float32", grads=False), False, True),
    (SHIPPED.with_(dtype="bfloat16"), False, False),  # replicated by its policy: each rank's own loss needs it all
])
def test_the_oracle_shares_the_exact_run_where_a_plan_says_whose_each_image_is(run_ranks, case, turns, shared):
    for seen, inside, failures in run_ranks(_shared_by_oracle, case.world_size, case, turns):
        assert seen == [shared] and failures == [], (seen, failures)
        assert inside == [], inside  # no collective inside a turn: a peer may be waiting for its own


def _wrong_tokens(ctx):
    """A plan with a row more than the outputs have, on one rank only: its figures raise, on every rank alike."""
    impl, case = resolve("reference"), Case(SPECS["three-images"], 2, dtype="float32")
    model = impl.build_model(case, torch.float32, torch.device("cpu"))
    batch = case.spec.tensors(dtype=torch.float32)
    out = {"features": impl.encode(model, impl.inputs(batch)).detach()}
    plan = impl.plan(case.spec, case.config)
    extra = () if ctx.rank == 0 else (1,)  # a row past the microbatch's: its chunks run, its masks cannot be laid
    share = rounding.Share(None, ctx.rank, Ownership(plan.owner + extra, plan.tokens + extra, plan.placeholders))
    part = rounding.measure(Arm(impl, model=model), rounding.Reference(batch, out, None, None, {}, None, False),
                            kinds=oracle.own_media(plan, case.spec, ctx.rank), share=share)
    try:
        part.summed()
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        return type(err).__name__, str(err)
    return "no error"


@pytest.mark.distributed
def test_a_part_whose_figures_raise_raises_on_every_rank_and_none_waits(run_ranks):
    said = run_ranks(_wrong_tokens, 2)
    assert said[0] == ("RuntimeError", "rounding.measure: the exact run raised on CP rank(s) [1] of the shared exact "
                                       "run (its own error is in that rank's result)"), said
    assert said[1][0] != "no error" and "CP rank(s)" not in said[1][1], said


class _Miscounting:
    """automodel, saying one row too many for its first media item."""

    def __init__(self):
        self.impl = resolve("automodel")
        self.name = self.impl.name

    def media_tokens(self, spec):
        tokens = self.impl.media_tokens(spec)
        return (tokens[0] + 1,) + tokens[1:]


def _dealt(ctx, impl):
    case = AUTOMODEL.with_(dtype="bfloat16")
    spec = case.spec
    model = resolve("automodel").build_model(case, torch.bfloat16, torch.device("cpu"))
    out = outputs_of(resolve("automodel").encode(model, resolve("automodel").inputs(spec.tensors(dtype=torch.bfloat16))),
                     "automodel.encode")
    try:
        deal = weights.dealt_ownership(impl, spec, out, None)
    except ValueError as err:
        return str(err)
    rows = [i for i, hit in enumerate(deal.own_tokens(ctx.rank)) if hit]
    return deal.owner, oracle.own_media(deal, spec, ctx.rank), rows, out["features"].shape[0]


@pytest.mark.distributed
def test_vdpcps_own_deal_gives_every_media_item_and_row_to_one_rank_and_a_miscount_is_one_clear_error(run_ranks):
    got = run_ranks(_dealt, 4, resolve("automodel"))
    owner, _, _, total = got[0]
    assert all(rank_owner == owner for rank_owner, *_ in got)  # every rank deals alike
    assert sorted(owner) == list(owner) and set(owner) == {0, 1, 2, 3}, owner  # contiguous runs, by the items' middles
    for rank, (_, kinds, rows, _) in enumerate(got):
        assert ("own" in kinds) == bool(rows), (rank, kinds)
    assert sorted(row for *_, rows, _ in got for row in rows) == list(range(total))  # each row once
    said = run_ranks(_dealt, 2, _Miscounting())
    assert said[0] == said[1] and said[0].startswith("automodel.media_tokens: [") and "its unsharded encode returned" in said[0]
