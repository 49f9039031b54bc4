"""vdpcp.oracle.observe.gloo_collectives against the definitions of its collectives, by hand: what each rank must receive (what
NCCL gives: output i holds rank i's tensor, bytes as sent), and the gradient each rank's inputs must get, with
uneven (and empty) sizes, on the CP groups of a CP x DP world (not ranks 0..n-1) and on the whole world, at CP 2
and 4, in several dtypes; torch's names restored after, raise or not, and in the next case; sizes the ranks
disagree on raise one error on every rank; a case that ran a stand-in says so in its report.

torch.distributed.nn's own gloo fallback fails each of these layouts but the even, first-group one, and gloo's own
all_gather and all_to_all refuse every uneven one (the module's docstring says why); tests/impls/test_mcore_on_gloo.py
shows MCore's gather backward running on gloo through it.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from vdpcp.feature.layout import Layout, groups
from vdpcp.matrix import scenarios
from vdpcp.matrix.runner import run_judged
from vdpcp.oracle.observe import gloo_collectives

pytestmark = pytest.mark.distributed
TORCHS = dist_nn._AlltoAll  # torch's class, as the test process imported it (the rank workers import the same)
TORCHS_ALL_GATHER, TORCHS_ALL_TO_ALL = dist.all_gather, dist.all_to_all
LAYOUTS = [(2, 1), (4, 1), (2, 2)]  # (cp, dp): CP 2 and 4, and the second CP group of CP 2 x DP 2 (ranks 1 and 3)
DTYPES = [torch.float64, torch.bfloat16, torch.complex64, torch.int64]
WIDTH = 3


def rows(sender: int, receiver: int) -> int:
    """Rows sender sends receiver: uneven, some zero."""
    return (sender + 2 * receiver) % 3


def sent(sender: int, receiver: int, dtype) -> torch.Tensor:
    """What ``sender`` sends ``receiver``: values that name both, so a tensor in the wrong place shows."""
    k = torch.arange(rows(sender, receiver) * WIDTH, dtype=torch.float64).reshape(-1, WIDTH)
    return (100 * sender + 10 * receiver + k / 8).to(dtype)  # exact in bf16 too (8 significant bits suffice)


def weight(receiver: int, sender: int, dtype) -> torch.Tensor:
    """The loss weight on what ``receiver`` got from ``sender``: its gradient, which must come back to sender."""
    return (sent(sender, receiver, torch.float64) / 4 - receiver).to(dtype)


def all_to_all_by_definition(ctx, cp: int, dp: int, dtype):
    """Each rank of a CP group sends its group peer j ``sent(i, j)`` through torch.distributed.nn's all_to_all
    (as MCore's gather does) within gloo_collectives.on_gloo; checks outputs and input gradients by hand."""
    mine, on = groups(Layout(cp=cp, dp=dp)), dict(device=ctx.device)  # a GPU shared by gloo ranks: VDPCP_DEVICE=cuda
    i = mine.cp_rank
    inputs = [sent(i, j, dtype).to(**on).requires_grad_(True) for j in range(cp)]
    outputs = [torch.empty(rows(j, i), WIDTH, dtype=dtype, **on) for j in range(cp)]
    with gloo_collectives.on_gloo(mine.cp) as swap:
        assert dist_nn._AlltoAll is swap and swap is not None
        got = dist_nn.all_to_all(outputs, inputs, group=mine.cp)
        sum((weight(i, j, dtype).to(**on) * out).sum() for j, out in enumerate(got)).backward()
    assert torchs_own()  # restored
    for j, out in enumerate(got):  # rank j's message to me, in my slot j
        assert torch.equal(out.cpu(), sent(j, i, dtype)), f"cp rank {i} got {out} from {j}"
    for j, x in enumerate(inputs):  # what I sent j was weighted on j by weight(j, i): that is its gradient
        assert torch.equal(x.grad.cpu(), weight(j, i, dtype)), f"cp rank {i}: grad of what it sent {j}"
    return swap.calls[gloo_collectives.NOTE], gloo_collectives.used(swap)


def torchs_own() -> bool:
    """Whether every name vdpcp.oracle.observe.gloo_collectives swaps holds torch's own again."""
    return (dist_nn._AlltoAll, dist.all_gather, dist.all_to_all) == (TORCHS, TORCHS_ALL_GATHER, TORCHS_ALL_TO_ALL)


@pytest.mark.parametrize("cp, dp", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_all_to_all_sends_each_peer_its_tensor_and_returns_each_its_gradient(run_ranks, cp, dp, dtype):
    got = run_ranks(all_to_all_by_definition, cp * dp, cp, dp, dtype, backend="gloo")
    assert got == [(1, gloo_collectives.NOTE)] * (cp * dp)  # one call through torch's name (its backward is ours), reported


def all_gather_backward(ctx, cp: int, dp: int):
    """torch.distributed.nn's all_gather on a CP group of a CP x DP world: its backward (an all_to_all, then a
    sum) must give each rank the sum over its peers of the weight they put on its tensor."""
    mine = groups(Layout(cp=cp, dp=dp))
    i = mine.cp_rank
    x = torch.full((2, WIDTH), float(i), dtype=torch.float64, device=ctx.device, requires_grad=True)
    with gloo_collectives.on_gloo(mine.cp) as swap:
        shards = dist_nn.all_gather(x, group=mine.cp)
        sum((10.0 ** r) * (j + 1) * shard.sum() for j, shard in enumerate(shards) for r in [i]).backward()
    assert [float(s[0, 0]) for s in shards] == list(range(cp))
    expected = (i + 1) * sum(10.0 ** r for r in range(cp))  # peer r weights my slot i by 10^r * (i + 1)
    assert torch.equal(x.grad, torch.full_like(x, expected)), f"cp rank {i}: {x.grad}"
    return swap.calls[gloo_collectives.NOTE]


@pytest.mark.filterwarnings("ignore:torch.distributed.nn.functional.all_gather is deprecated")
def test_all_gather_backward_reduces_over_the_peers_of_a_second_cp_group(run_ranks):
    assert run_ranks(all_gather_backward, 4, 2, 2, backend="gloo") == [1] * 4  # its backward's one exchange


def held(rank: int, replica: int, dtype) -> torch.Tensor:
    """What CP rank ``rank`` of DP replica ``replica`` contributes to an all_gather: uneven (one rank's is empty at
    CP 4), values that name both, so a tensor from the wrong rank or the wrong replica shows."""
    k = torch.arange(rows(rank, 0) * WIDTH, dtype=torch.float64).reshape(-1, WIDTH)
    return (1000 * replica + 10 * rank + k / 8).to(dtype)


def uneven_all_gather(ctx, cp: int, dp: int):
    """Plain torch.distributed.all_gather of each CP rank's own size, as Megatron-Bridge's gather calls it, in each
    of DTYPES and with async_op both ways: output j holds CP peer j's tensor, bytes as sent (NCCL's result)."""
    mine, on = groups(Layout(cp=cp, dp=dp)), dict(device=ctx.device)
    i, replica = mine.cp_rank, mine.dp_rank
    with gloo_collectives.on_gloo(mine.cp) as swap:
        for dtype in DTYPES:
            for async_op in (False, True):
                outputs = [torch.full((rows(j, 0), WIDTH), -1, dtype=dtype, **on) for j in range(cp)]
                work = dist.all_gather(outputs, held(i, replica, dtype).to(**on), group=mine.cp, async_op=async_op)
                assert (work is None) != async_op, f"all_gather(async_op={async_op}) returned {work}"
                if async_op:
                    assert isinstance(work, dist.Work) and work.wait() and work.is_completed()
                for j, out in enumerate(outputs):
                    assert torch.equal(out.cpu(), held(j, replica, dtype)), f"cp rank {i}, {dtype}: slot {j} {out}"
        even = [torch.empty(2, dtype=torch.int64) for _ in range(cp)]
        dist.all_gather(even, torch.full((2,), i), group=mine.cp)  # one shape: gloo's own runs it
        assert [int(t[0]) for t in even] == list(range(cp))
    assert torchs_own()
    return dict(swap.calls), gloo_collectives.used(swap)


@pytest.mark.parametrize("cp, dp", LAYOUTS)
def test_an_uneven_all_gather_gives_each_rank_every_peers_tensor_as_nccl_does(run_ranks, cp, dp):
    got = run_ranks(uneven_all_gather, cp * dp, cp, dp, backend="gloo")
    ran = {gloo_collectives.ALL_GATHER_NOTE: 2 * len(DTYPES)}  # the even one went to gloo's own
    assert got == [(ran, gloo_collectives.ALL_GATHER_NOTE)] * (cp * dp)


def uneven_in_a_later_dimension(ctx, cp: int):
    """all_gather and all_to_all of tensors with one row count whose widths differ (a rank's feature width, a
    video's frames in a later axis): gloo refuses those shapes as it refuses uneven rows, so the stand-in runs."""
    mine = groups(Layout(cp=cp))
    i = mine.cp_rank

    def wide(sender: int, receiver: int = 0) -> torch.Tensor:
        return (100 * sender + 10 * receiver + torch.arange(2 * (WIDTH + sender), dtype=torch.float64) / 8).reshape(
            2, WIDTH + sender)

    with gloo_collectives.on_gloo(mine.cp) as swap:
        gathered = [torch.full((2, WIDTH + j), -1.0, dtype=torch.float64) for j in range(cp)]
        dist.all_gather(gathered, wide(i), group=mine.cp)
        exchanged = [torch.full((2, WIDTH + j), -1.0, dtype=torch.float64) for j in range(cp)]
        dist.all_to_all(exchanged, [wide(i, j) for j in range(cp)], group=mine.cp)
    assert all(torch.equal(out, wide(j)) for j, out in enumerate(gathered)), gathered
    assert all(torch.equal(out, wide(j, i)) for j, out in enumerate(exchanged)), exchanged
    return dict(swap.calls)


def test_tensors_uneven_in_a_later_dimension_only_go_to_the_stand_in(run_ranks):
    got = run_ranks(uneven_in_a_later_dimension, 2, 2, backend="gloo")
    assert got == [{gloo_collectives.ALL_GATHER_NOTE: 1, gloo_collectives.ALL_TO_ALL_NOTE: 1}] * 2


def uneven_all_to_all(ctx, cp: int, dp: int):
    """Plain torch.distributed.all_to_all (list form) of uneven, some empty, tensors in each of DTYPES: output j holds
    what CP peer j sent this rank."""
    mine, on = groups(Layout(cp=cp, dp=dp)), dict(device=ctx.device)
    i = mine.cp_rank
    with gloo_collectives.on_gloo(mine.cp) as swap:
        for dtype in DTYPES:
            outputs = [torch.full((rows(j, i), WIDTH), -1, dtype=dtype, **on) for j in range(cp)]
            assert dist.all_to_all(outputs, [sent(i, j, dtype).to(**on) for j in range(cp)], group=mine.cp) is None
            for j, out in enumerate(outputs):
                assert torch.equal(out.cpu(), sent(j, i, dtype)), f"cp rank {i}, {dtype}: from {j} {out}"
    assert torchs_own()
    return dict(swap.calls), gloo_collectives.used(swap)


@pytest.mark.parametrize("cp, dp", LAYOUTS)
def test_an_uneven_all_to_all_gives_each_rank_what_each_peer_sent_it(run_ranks, cp, dp):
    got = run_ranks(uneven_all_to_all, cp * dp, cp, dp, backend="gloo")
    assert got == [({gloo_collectives.ALL_TO_ALL_NOTE: len(DTYPES)}, gloo_collectives.ALL_TO_ALL_NOTE)] * (cp * dp)


def sizes_disagree(ctx):
    """CP rank 1 expects two rows from rank 0, which sends none: every rank raises, none waits. (Both see uneven
    sizes: a rank that saw one shape would take gloo's own all_gather, a collective its peers do not take.)"""
    mine = groups(Layout(cp=2, dp=2))
    expected = [rows(0, 0) + 2 * mine.cp_rank, rows(1, 0)]
    outputs = [torch.empty(n, WIDTH, dtype=torch.float64) for n in expected]
    with pytest.raises(ValueError) as raised:
        with gloo_collectives.on_gloo(mine.cp):
            dist.all_gather(outputs, held(mine.cp_rank, mine.dp_rank, torch.float64), group=mine.cp)
    assert torchs_own()
    return str(raised.value)


def test_sizes_the_ranks_disagree_on_raise_one_error_on_every_rank(run_ranks):
    said = ("all_gather on gloo: group rank 0 sends group rank 1 0 bytes, which expects 48: their rows differ (0 sent, "
            "2 expected, of torch.float64); each rank sent group rank 0 torch.float64, group rank 1 torch.float64 "
            "(1 pair(s) of ranks disagree on sizes; NCCL's result is undefined there)")
    assert run_ranks(sizes_disagree, 4, backend="gloo") == [said] * 4


def dtypes_disagree(ctx):
    """Every rank gathers rows of its own count in its own dtype (CP rank 0 float64, rank 1 bfloat16), as ranks
    whose empty embeddings are made apart from their features do: the rows agree, the bytes do not."""
    mine = groups(Layout(cp=2, dp=2))
    dtype = (torch.float64, torch.bfloat16)[mine.cp_rank]
    outputs = [torch.empty(n, WIDTH, dtype=dtype) for n in (2, 3)]
    with pytest.raises(ValueError) as raised:
        with gloo_collectives.on_gloo(mine.cp):
            dist.all_gather(outputs, torch.zeros(2 + mine.cp_rank, WIDTH, dtype=dtype), group=mine.cp)
    return str(raised.value)


def test_ranks_that_send_other_dtypes_are_told_their_rows_agree_and_which_dtype_each_sent(run_ranks):
    said = ("all_gather on gloo: group rank 0 sends group rank 1 48 bytes, which expects 12: their rows agree (2), "
            "their dtypes differ (torch.float64 sent, torch.bfloat16 expected); each rank sent group rank 0 "
            "torch.float64, group rank 1 torch.bfloat16 (2 pair(s) of ranks disagree on sizes; NCCL's result is "
            "undefined there)")
    assert run_ranks(dtypes_disagree, 4, backend="gloo") == [said] * 4


REFERENCE = {case.id: case for case in scenarios.matrix(cps=(2,), impls=("reference",))}
UNEVEN = "tests.distributed.uneven_gather:uneven_gather"


@pytest.mark.parametrize("case_id", ["three-images-cp2-reference-count", "three-images-cp2-dp2-reference-count"])
def test_a_gather_by_uneven_all_gather_passes_on_gloo_and_its_report_names_the_stand_in(case_id):
    judged = run_judged(REFERENCE[case_id].with_(impl=UNEVEN), backend="gloo")
    assert judged.verdict == "pass", judged.result.summary()
    assert judged.result.collectives == gloo_collectives.ALL_GATHER_NOTE
    assert f"collectives: {gloo_collectives.ALL_GATHER_NOTE}" in judged.result.summary()


def worker_and_names(ctx):
    return os.getpid(), torchs_own()


def test_nothing_of_a_case_that_raised_inside_the_swap_reaches_the_next_case(run_ranks):
    case = REFERENCE["three-images-cp2-reference-count"].with_(impl="tests.distributed.uneven_gather:miscounted_gather")
    before = run_ranks(worker_and_names, 2, backend="gloo")
    judged = run_judged(case, backend="gloo")
    assert judged.verdict == "error" and "group rank 0 sends group rank 1" in judged.result.error, judged.result.summary()
    after = run_ranks(worker_and_names, 2, backend="gloo")
    assert after == before and {names for _, names in after} == {True}  # the same warm workers, torch's names


def restored_after_a_raise(ctx):
    with pytest.raises(ValueError, match="inside"):
        with gloo_collectives.on_gloo(ctx.group):
            raise ValueError("raised inside the block")
    return torchs_own()


def test_torchs_class_is_back_after_the_block_raises(run_ranks):
    assert run_ranks(restored_after_a_raise, 2, backend="gloo") == [True, True]


def swapped_only_for_gloo(ctx):
    """One rank's all_to_all through torch.distributed.nn and an all_gather whose output shape is not its input's
    (gloo refuses that; NCCL takes it), on the world, within a swap made for a gloo group: on a gloo world vdpcp's
    run them; on an NCCL world (the GPU job) torch's own do, never vdpcp's."""
    gloo = ctx.group if ctx.backend == "gloo" else dist.new_group(backend="gloo")
    x = torch.ones(2, device=ctx.device, requires_grad=True)
    out = torch.empty(1, 2, device=ctx.device)
    with gloo_collectives.on_gloo(gloo) as swap:
        (exchanged,) = dist_nn.all_to_all([torch.empty(2, device=ctx.device)], [x], group=ctx.group)
        (3 * exchanged).sum().backward()
        assert dist.all_gather([out], torch.arange(2.0, device=ctx.device), group=ctx.group) is None
    with gloo_collectives.on_gloo(ctx.group) as unswapped:
        assert (unswapped is None) == (ctx.backend == "nccl") and torchs_own() == (unswapped is None)
    assert torch.equal(x.grad, torch.full_like(x, 3.0)) and torch.equal(out.cpu(), torch.tensor([[0.0, 1.0]]))
    return ctx.backend, sorted(swap.calls.items()), gloo_collectives.used(swap)


def test_the_swap_runs_on_gloo_groups_only(run_ranks):
    """On the suite's backend (gloo on CPU, NCCL in the GPU job: tox -e gpu)."""
    ((backend, calls, note),) = run_ranks(swapped_only_for_gloo, 1)
    if backend == "gloo":
        assert calls == sorted({gloo_collectives.NOTE: 1, gloo_collectives.ALL_GATHER_NOTE: 1}.items())
        assert note == f"{gloo_collectives.NOTE}; {gloo_collectives.ALL_GATHER_NOTE}"
    else:
        assert (calls, note) == ([], "")
