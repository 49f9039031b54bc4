"""What the oracle counts as a layer having run, and how much of a long failure it prints: the survivors of the
mutation run of vdpcp/oracle.py (docs/mutation.md), each pinned by the behaviour it changed.

- A layer's rows are its input's leading elements over one row's, whatever the rank of its input: a tower whose
  first layer takes [batch, tokens, hidden] reads tokens, not hidden units; a 0-d or zero-width input is no rows.
- A layer called on zero rows did not run; only modules that hold parameters themselves are layers, not the
  containers around them; a closed Execution leaves no hook on the (cached, reused) model.
- The ownership table is said once, by CP rank 0; a failure lists a fixed number of rows, layers or parameters
  and says there are more only when there are.
- A plan may list placeholders for fewer ranks than the CP group: the others have none.
- The layers a rank must run are those every rank holding real rows ran (a branch only some rows take is not
  required elsewhere); a rank of placeholders alone may swap required layers for as many of its own branch's.
"""

import pytest
import torch

from vdpcp import oracle
from vdpcp.contract.protocol import Ownership
from vdpcp.feature import comm
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.harness import run_ranks
from vdpcp.matrix.case import RankResult
from vdpcp.oracle.compare import gradients
from vdpcp.oracle.context import Arm
from vdpcp.oracle.observe import execution, split


def _at(result: RankResult, model=None) -> Arm:
    """The arm a check runs in, on ``result``'s rank, its figures going to ``result``'s telemetry."""
    return Arm(model=model, rank=result.rank, cp_rank=result.cp_rank, telemetry=result.telemetry)


HIDDEN = 6


def test_a_layer_on_batched_tokens_reads_its_tokens_not_its_hidden_units():
    layer = torch.nn.Linear(HIDDEN, 3)
    assert oracle.input_rows(layer, torch.zeros(1, 10, HIDDEN)) == 10
    assert oracle.input_rows(layer, torch.zeros(2, 5, HIDDEN)) == 10
    assert oracle.input_rows(layer, torch.zeros(10, HIDDEN)) == 10


def test_a_scalar_input_is_no_rows():
    assert oracle.input_rows(torch.nn.Linear(1, 1), torch.tensor(1.0)) == 0
    assert oracle.input_rows(torch.nn.Linear(1, 1), None) == 0


class Tower(torch.nn.Module):
    """A block (a container with parameters below it) and a head called apart, as encode and project are."""

    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN))
        self.head = torch.nn.Linear(HIDDEN, 2)


def test_a_layer_called_on_zero_rows_did_not_run():
    tower = Tower()
    ran = oracle.Execution(tower)
    tower.block(torch.zeros(4, HIDDEN))
    tower.head(torch.zeros(0, HIDDEN))
    assert ran.rows == 4
    assert ran.ran() == {"block.0", "block.2"}


def test_layers_are_the_modules_holding_parameters_themselves_not_their_containers():
    tower = Tower()
    ran = oracle.Execution(tower)
    tower.head(tower.block(torch.zeros(3, HIDDEN)))
    assert ran.ran() == {"block.0", "block.2", "head"}
    assert ran.first == "block.0" and ran.rows == 3


def test_a_skipped_tower_lists_three_of_its_layers_and_parameters():
    reference = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(5)))
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(5)))
    reference_ran, ran = oracle.Execution(reference), oracle.Execution(model)
    reference(torch.ones(1, 2)).sum().backward()  # every layer ran, every parameter has a gradient
    result = RankResult(rank=3, cp_rank=1)
    result.add(execution.check_layers_ran(_at(result), reference_ran.ran(), ran))
    given = [p.grad is not None for p in reference.parameters()]
    result.add(execution.check_param_grads_exist(_at(result, model), given, reference_ran.ran(), ran.names))
    skipped, missing = result.failures
    assert skipped == ("execution: rank 3 (CP rank 1) read no row and ran no layer of its tower (no plan says what it "
                       "holds; layers never run: 0, 1, 2); every rank must run its tower, placeholders included"), skipped
    assert "has no gradient for 10 parameter(s) the unsharded run gives one (0.weight, 0.bias, 1.weight)" in missing, missing


@pytest.mark.parametrize("placeholders, given", [(1, "no row and 1 placeholder"), (0, "no row and no placeholders")])
def test_a_rank_that_ran_no_layer_is_told_what_it_read_and_what_its_plan_gave_it(placeholders, given):
    plan = Ownership(owner=(0,), tokens=(4,), placeholders=(0, placeholders))
    result = RankResult(rank=1, cp_rank=1)
    result.read = []
    with oracle.Execution(Tower()) as ran:
        pass
    result.add(execution.check_layers_ran(_at(result), {"block.0"}, ran, plan))
    assert result.failures == [f"execution: rank 1 (CP rank 1) read no row and ran no layer of its tower (its plan gives "
                               f"it {given}; layers never run: block.0); every rank must run its tower, placeholders "
                               f"included"]


def ownership_on_every_rank(ctx):
    """Every rank's input gradient non-zero on all six rows: each row on both ranks, so six rows are wrong."""
    spec = MicrobatchSpec(images=((4, 4),) * 6, name="six")
    batch = spec.tensors()
    grad = torch.ones_like(batch.patches)
    read = torch.ones(ctx.world_size, 6, dtype=torch.bool)
    result = RankResult(ctx.rank, cp_rank=ctx.rank)
    holders = comm.all_reduce_sum(gradients._holding(batch, grad, ctx.world_size, ctx.rank), ctx.group)
    result.add(gradients._check_ownership(_at(result), batch, grad, grad, None, read, holders, 0.0))
    return result.failures


@pytest.mark.distributed
def test_the_ownership_table_is_said_once_by_cp_rank_0_and_lists_four_rows():
    first, second = run_ranks(ownership_on_every_rank, 2, backend="gloo")
    assert second == []
    (said,) = first
    assert said == ("input grads: an image's gradient must be non-zero on exactly its owner's rank: row 0 on ranks "
                    "[0, 1]; row 1 on ranks [0, 1]; row 2 on ranks [0, 1]; row 3 on ranks [0, 1] ..."), said


def test_a_long_list_in_a_message_names_four_and_counts_the_rest():
    assert split._few([str(i) for i in range(6)]) == "0; 1; 2; 3 (and 2 more)"
    assert split._few(["a", "b", "c", "d"]) == "a; b; c; d"


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_a_layer_fed_a_zero_width_input_saw_no_rows():
    assert oracle.input_rows(torch.nn.Linear(0, 3), torch.zeros(5, 0)) == 0


def test_a_layer_of_width_one_reads_a_row_per_element():
    assert oracle.input_rows(torch.nn.Linear(1, 3), torch.zeros(5, 1)) == 5
    assert oracle.input_rows(torch.nn.Conv1d(1, 2, kernel_size=1), torch.zeros(1, 1, 7)) == 7


def test_an_execution_leaves_no_hook_on_the_model_once_closed():
    tower = Tower()  # a cached model is borrowed by case after case: each case's hooks must go with it
    with oracle.Execution(tower) as ran:
        tower.block(torch.zeros(2, HIDDEN))
    assert not any(m._forward_pre_hooks for m in tower.modules())
    tower.block(torch.zeros(3, HIDDEN))
    assert ran.rows == 2


def _ownership_of(rows: int) -> str:
    """CP rank 0's ownership failure when each of ``rows`` rows has its gradient on both of two ranks."""
    batch = MicrobatchSpec(images=((4, 4),) * rows, name="rows").tensors()
    grad = torch.ones_like(batch.patches)
    both = torch.ones(2, rows)
    result = RankResult(0, cp_rank=0)
    result.add(gradients._check_ownership(_at(result), batch, grad, grad, None, both.bool(), both, 0.0))
    (said,) = result.failures
    return said


@pytest.mark.parametrize("rows, more", [(4, False), (5, True)])
def test_the_ownership_table_says_there_are_more_only_past_four_rows(rows, more):
    said = _ownership_of(rows)
    assert said.count("on ranks [0, 1]") == 4 and said.endswith(" ...") is more, said


def test_a_plan_that_lists_placeholders_for_fewer_ranks_gives_the_others_none():
    plan = Ownership(owner=(0, 0), tokens=(4, 4), placeholders=(1,))
    spec = MicrobatchSpec(images=((8, 8), (8, 8)), name="two")
    first, second = RankResult(0, cp_rank=0), RankResult(1, cp_rank=1)
    split.describe(first, spec, plan, 0)
    split.describe(second, spec, plan, 1)
    assert (first.images, first.placeholders) == (2, 1) and (second.images, second.placeholders) == (0, 0)


def _ownership(cp_rank, holders, read, grad, ref_grad):
    """What CP rank ``cp_rank`` says of ownership without a plan, over three one-patch-grid images."""
    batch = MicrobatchSpec(images=((4, 4),) * 3, name="three").tensors()
    result = RankResult(cp_rank, cp_rank=cp_rank)
    grad, ref_grad = grad(batch.patches), ref_grad(batch.patches)
    result.add(gradients._check_ownership(_at(result), batch, grad, ref_grad, None, torch.tensor(read),
                                          torch.tensor(holders, dtype=torch.float64), 0.0))
    return result.failures


def test_without_a_plan_an_images_gradient_must_be_on_the_one_rank_that_read_it():
    ones = torch.ones_like
    said = _ownership(0, [[1, 1, 0], [0, 0, 1]], [[True, False, False], [False, True, True]], ones, ones)
    assert said[0].startswith("input grads: an image's gradient must be non-zero on exactly its owner's rank: row 1 on "
                              "ranks [0] (encoded on rank 1)"), said
    unread = _ownership(0, [[1, 0, 0], [0, 1, 1]], [[False, False, False], [False, True, True]], ones, ones)
    assert unread == [], unread  # a row no tower read has no owner to hold it to (its own check says so)


def test_without_a_plan_each_rank_compares_the_images_whose_gradient_it_holds():
    def off(patches):  # the gradient rank 1 holds: right on image 0, 10% off on image 2 (the last of three alike)
        grad = torch.ones_like(patches)
        grad[:, 2 * patches.shape[1] // 3 :] *= 1.1
        return grad

    said = _ownership(1, [[0, 1, 0], [1, 0, 1]], [[False, True, False], [True, False, True]], off, torch.ones_like)
    assert len(said) == 1 and said[0].startswith("input grads (own images): Tensor-likes are not close!"), said


# --- which layers a rank must run (required_layers) -------------------------------------------------------------

TRUNK = {"embed", "block", "head"}
READ = torch.tensor([[True, False], [False, True], [False, False]])  # CP ranks 0 and 1 hold a row each, 2 placeholders


def _required(ran, cp_rank, reference=TRUNK | {"video"}):
    return oracle.required_layers(reference, ran, READ, cp_rank)


def test_a_layer_only_some_real_shares_took_is_required_nowhere():
    ran = [TRUNK, {"video", "block", "head"}, TRUNK]  # rank 1's row is a video: it took the video embedder only
    assert [_required(ran, r) for r in range(3)] == [{"block", "head"}] * 3


def test_every_layer_every_real_share_took_is_required_on_a_placeholder_rank():
    ran = [TRUNK, TRUNK, {"embed"}]  # rank 2 embeds its placeholder, then skips the trunk
    assert _required(ran, 2) == TRUNK
    result = RankResult(rank=2, cp_rank=2)
    tower = torch.nn.ModuleDict({"embed": torch.nn.Linear(2, 2), "block": torch.nn.Linear(2, 2),
                                 "head": torch.nn.Linear(2, 2)})
    with oracle.Execution(tower) as seen:
        tower["embed"](torch.ones(1, 2))
    result.add(execution.check_layers_ran(_at(result), _required(ran, 2), seen))
    assert result.failures == ["execution: rank 2 (CP rank 2) skipped 2 layer(s) that every rank holding real rows "
                               "ran (block, head); a rank must run its whole tower, placeholders included"]


def test_a_placeholder_rank_may_swap_a_branch_for_its_own_one_for_one():
    videos = {"video", "block", "head"}  # every real share is video; the placeholder is an image
    assert _required([videos, videos, TRUNK], 2) == {"block", "head"}
    # the image embedder ran, the video embedder and the trunk did not: one branch does not excuse three layers
    assert _required([videos, videos, {"embed"}], 2) == videos


def test_a_real_share_is_held_to_what_it_ran_itself_and_the_reference_ran():
    assert _required([TRUNK | {"extra"}, TRUNK | {"extra"}, TRUNK], 0) == TRUNK  # "extra": not the reference's


def test_a_parameter_of_a_layer_not_required_here_may_have_no_gradient():
    tower = torch.nn.ModuleDict({"embed": torch.nn.Linear(2, 2), "video": torch.nn.Linear(2, 2)})
    tower["embed"](torch.ones(1, 2)).sum().backward()
    given = [True for _ in tower.parameters()]  # unsharded, both embedders ran
    result = RankResult(rank=0, cp_rank=0)
    result.add(execution.check_param_grads_exist(_at(result, tower), given, {"embed"}, ["embed", "video"]))
    assert result.failures == []
    result.add(execution.check_param_grads_exist(_at(result, tower), given, {"embed", "video"}, ["embed", "video"]))
    assert result.failures == ["execution: rank 0 (CP rank 0) has no gradient for 2 parameter(s) the unsharded run "
                               "gives one (video.weight, video.bias)"]
