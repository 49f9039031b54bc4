"""Did it shard, counting work autograd never sees: a tower that takes rows outside autograd (torch.no_grad,
inference_mode, a detached input) beyond its own share is not-sharded work; placeholders and padding, constant
rows, are not."""

from dataclasses import replace

import pytest
import torch

from vdpcp import oracle
from vdpcp.case import Case, RankResult
from vdpcp.impls.reference import Reference
from vdpcp.runner import run_judged
from vdpcp.scenarios import SCENARIOS

SPECS = {s.spec.name: s.spec for s in SCENARIOS}
MUTANT = "whole-microbatch-encoded-without-grad"


def _tower():
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "detached"])
def test_rows_taken_outside_autograd_are_counted_whatever_switched_it_off(how):
    tower, x = _tower(), torch.randn(5, 6, requires_grad=True)
    with oracle.Execution(tower) as ran:
        tower(x)  # tracked: not counted
        if how == "detached":
            tower(x.detach())
        else:
            with getattr(torch, how)():
                tower(x.view(5, 6))  # a view made without grad still says requires_grad
    assert (ran.rows, ran.untracked) == (10, 5)


def test_placeholder_and_padding_rows_are_constant_and_not_counted():
    tower = _tower()
    rows = torch.cat([torch.zeros(2, 6), torch.full((1, 6), 0.5), torch.randn(3, 6)])
    with oracle.Execution(tower) as ran, torch.no_grad():
        tower(rows)
    assert (ran.rows, ran.untracked) == (6, 3)


@pytest.mark.distributed
@pytest.mark.parametrize("impl, spec, cp", [("reference", "three-images", 2), ("mcore", "eight-equal", 4),
                                            ("qwen2_5_vl", "three-images", 2), ("automodel", "video-and-images", 2)])
def test_encoding_the_whole_microbatch_without_grad_beside_its_share_is_not_sharded_naming_rank_and_rows(impl, spec, cp):
    from vdpcp.scenarios import matrix

    case = next(c for c in matrix(impls=(impl,), cps=(cp,)) if c.id.startswith(f"{spec}-cp{cp}-{impl}-") and c.grads
                and c.loss == "rank" and c.dp == c.tp == 1 and c.vision_dp_over_cp)
    judged = run_judged(case.with_(mutant=MUTANT), backend="gloo")
    assert judged.verdict == "not-sharded", judged.result.summary()
    said = " ".join(judged.result.failures)
    assert "CP rank 0's tower took" in said and "patch rows outside autograd" in said and "beyond the" in said, said


@pytest.mark.distributed
def test_a_correct_implementation_has_nothing_outside_autograd():
    judged = run_judged(Case(SPECS["video-and-images"], 4, "reference"), backend="gloo")
    assert judged.verdict == "pass" and all(r.untracked == 0 for r in judged.result.ranks), judged.result.summary()


def test_even_one_row_taken_outside_autograd_is_not_sharded():
    batch = SPECS["three-images"].tensors()
    read = torch.tensor([[True, False, True], [False, True, False]])
    result = RankResult(0)
    oracle._judge_untracked(result, [0, 1], read, batch)
    (said,) = result.not_sharded
    assert "CP rank 1's tower took 1 patch rows outside autograd" in said and "CP rank 0" not in said, said


class PreviewsWithoutGrad(Reference):
    """Runs its tower once outside autograd on the whole microbatch (a preview, say) before every encode, unsharded
    as sharded: work its own unsharded encode does too, so the sharded run is not judged on it."""

    name = "previews-without-grad"

    def encode(self, model, batch):
        with torch.no_grad():
            super().encode(model, replace(batch, patches=batch.patches.detach()))
        return super().encode(model, batch)

    def encode_sharded(self, model, batch, config, group):
        with torch.no_grad():
            super().encode(model, replace(batch, patches=batch.patches.detach()))
        return super().encode_sharded(model, batch, config, group)


previews_without_grad = PreviewsWithoutGrad()


@pytest.mark.distributed
def test_rows_the_unsharded_encode_takes_outside_autograd_too_are_not_judged():
    judged = run_judged(Case(SPECS["three-images"], 2, "tests.oracle.test_untracked:previews_without_grad"), backend="gloo")
    assert judged.verdict == "pass", judged.result.summary()
    assert all(r.untracked > 0 for r in judged.result.ranks), judged.result.summary()
