"""Where the unsharded arm takes one backward a rank, of its own share, and the summed loss's gradients are the shares'
sum over the CP group (vdpcp.oracle.unsharded.splits): only where every rank has a share and the sum is cheap."""

import torch

from vdpcp.matrix.case import Case
from vdpcp.matrix.scenarios import SCENARIOS
from vdpcp.oracle.compare import sketch
from vdpcp.oracle.unsharded import splits

SPEC = next(s.spec for s in SCENARIOS if s.spec.name == "three-images")
GROUP = object()  # a CP group: splits only asks whether there is one
SHARE = {"features": torch.ones(2)}
TOY = torch.nn.Linear(4, 4)


def _splits_for(dtype="float64", cp=2, share=SHARE, sharded=True, kinds=("own", "other", "other"), model=TOY,
                group=GROUP) -> bool:
    return splits(Case(SPEC, cp, dtype=dtype), share, sharded, kinds, model, group)


def test_float64_splits_wherever_every_rank_has_a_share_and_the_gradients_are_cheap_to_send():
    assert _splits_for()
    assert _splits_for(sharded=False, kinds=None)  # encoded whole on every rank: each rank's share is its own loss
    assert not _splits_for(share={"features": None})  # no plan: no share to take the backward of
    assert not _splits_for(cp=1, group=None)
    width = sketch.WIDTH
    sketch.WIDTH = 8  # the toy layer's 20 parameters now cost more to send than to sketch
    try:
        assert not _splits_for()  # float64 is compared element by element: the summed loss's own backward instead
    finally:
        sketch.WIDTH = width


def test_below_float64_it_splits_only_where_the_exact_run_is_shared_out_too():
    assert _splits_for("bfloat16") and _splits_for("float32")
    assert not _splits_for("bfloat16", sharded=False, kinds=None)  # the whole exact run needs the sum in its turn
    assert not _splits_for("bfloat16", kinds=None)  # a plan that does not cover the microbatch: no shared run
