"""An outputs-only exact run shared out over the CP ranks (vdpcp.oracle.compare.rounding.Share, Shared.summed): every rank reads
each output row's slack as that row's owner measured it, not only its own rows' (a rank's part is zeros on the
others' rows: read as it is, every row another rank owns would be held to the dtype's rtol alone, and bf16 and
float32 outputs-only cases would fail correct towers).

In one process: both ranks' parts are measured here, and the sum over the group is a stand-in that adds the other
rank's part (monkeypatched, so nothing leaks out of the test)."""

from types import SimpleNamespace

import torch

from vdpcp import oracle
from vdpcp.feature import comm
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls import resolve
from vdpcp.matrix.case import Case
from vdpcp.oracle.compare import rounding
from vdpcp.oracle.context import Arm

SPEC = MicrobatchSpec(images=((8, 8), (8, 16), (16, 8)), seed=5, name="three-small")


class Pair:
    """A stand-in CP group of two ranks, as one rank sees it: its own part (``me``) and the other rank's (``peer``)."""

    me: rounding.Shared
    peer: rounding.Shared


def _sums(tensors, group: Pair):
    """The sum over ``group`` of tensors of this rank's part: each plus the other rank's same figure; any other
    tensor (the flags of which rank's run raised) plus the zeros of a peer that raised nothing."""
    def theirs(t):
        for name, mine in group.me.outputs.items():
            if t is mine:
                return group.peer.outputs[name]
        return group.peer.input if group.me.input is not None and t is group.me.input else torch.zeros_like(t)

    return [t + theirs(t) for t in tensors]


def test_an_outputs_only_shared_exact_run_gives_every_rank_every_rows_owners_figure(monkeypatch):
    monkeypatch.setattr(comm, "all_reduce_sums", _sums)
    monkeypatch.setattr(rounding, "dist", SimpleNamespace(get_world_size=lambda group: 2))
    impl, case, cpu = resolve("reference"), Case(SPEC, 2, dtype="float32", grads=False), torch.device("cpu")
    model = impl.build_model(case, torch.float32, cpu)
    batch = SPEC.tensors(dtype=torch.float32)  # Shared.summed reads no dtype: bf16's is the same path
    out = {"features": impl.encode(model, impl.inputs(batch)).detach()}
    plan = impl.plan(SPEC, case.config)
    kinds = [oracle.own_media(plan, SPEC, rank) for rank in range(2)]
    arm, ref = Arm(impl, model=model), rounding.Reference(batch, out, None, None, {}, None, False)
    whole = [rounding.measure(arm, ref, kinds=k) for k in kinds]
    groups = [Pair(), Pair()]
    parts = [rounding.measure(arm, ref, kinds=kinds[rank], share=rounding.Share(groups[rank], rank, plan))
             for rank in range(2)]
    for rank in range(2):
        groups[rank].me, groups[rank].peer = parts[rank], parts[1 - rank]
    owner = [r for r, n in zip(plan.owner, plan.tokens) for _ in range(n)]
    owners = torch.stack([whole[r].outputs["features"][i] for i, r in enumerate(owner)])
    assert set(owner) == {0, 1} and bool((owners > 0).all())  # each rank owns rows; every row has its slack
    for rank in range(2):
        assert parts[rank].input is None  # outputs only: no gradient figures
        summed = parts[rank].summed()
        assert torch.equal(summed.outputs["features"], owners), (rank, summed.outputs["features"], owners)
