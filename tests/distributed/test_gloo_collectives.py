"""vdpcp.gloo_collectives against the definition of all_to_all, by hand: what each rank must receive, and the
gradient each rank's inputs must get, with uneven (and empty) sizes, on the CP groups of a CP x DP world (not
ranks 0..n-1) and on the whole world, at CP 2 and 4, in float64 and bf16; and torch's name restored after.

torch.distributed.nn's own gloo fallback fails each of these layouts but the even, first-group one (the module's
docstring says why); tests/impls/test_mcore_on_gloo.py shows MCore's gather backward running on gloo through it.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from vdpcp import gloo_collectives
from vdpcp.layout import Layout, groups

pytestmark = pytest.mark.distributed
TORCHS = dist_nn._AlltoAll  # torch's class, as the test process imported it (the rank workers import the same)
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
    assert dist_nn._AlltoAll is TORCHS  # restored
    for j, out in enumerate(got):  # rank j's message to me, in my slot j
        assert torch.equal(out.cpu(), sent(j, i, dtype)), f"cp rank {i} got {out} from {j}"
    for j, x in enumerate(inputs):  # what I sent j was weighted on j by weight(j, i): that is its gradient
        assert torch.equal(x.grad.cpu(), weight(j, i, dtype)), f"cp rank {i}: grad of what it sent {j}"
    return swap.calls, gloo_collectives.used(swap)


@pytest.mark.parametrize("cp, dp", [(2, 1), (4, 1), (2, 2)])
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
    return swap.calls


@pytest.mark.filterwarnings("ignore:torch.distributed.nn.functional.all_gather is deprecated")
def test_all_gather_backward_reduces_over_the_peers_of_a_second_cp_group(run_ranks):
    assert run_ranks(all_gather_backward, 4, 2, 2, backend="gloo") == [1] * 4  # its backward's one exchange


def restored_after_a_raise(ctx):
    with pytest.raises(ValueError, match="inside"):
        with gloo_collectives.on_gloo(ctx.group):
            raise ValueError("raised inside the block")
    return dist_nn._AlltoAll is TORCHS


def test_torchs_class_is_back_after_the_block_raises(run_ranks):
    assert run_ranks(restored_after_a_raise, 2, backend="gloo") == [True, True]


def swapped_only_for_gloo(ctx):
    """One rank's all_to_all through torch.distributed.nn on the world, within a swap made for a gloo group: on a
    gloo world vdpcp's runs it; on an NCCL world (the GPU job) torch's own does, never vdpcp's."""
    gloo = ctx.group if ctx.backend == "gloo" else dist.new_group(backend="gloo")
    x = torch.ones(2, device=ctx.device, requires_grad=True)
    with gloo_collectives.on_gloo(gloo) as swap:
        (out,) = dist_nn.all_to_all([torch.empty(2, device=ctx.device)], [x], group=ctx.group)
        (3 * out).sum().backward()
    with gloo_collectives.on_gloo(ctx.group) as unswapped:
        assert (unswapped is None) == (ctx.backend == "nccl") and (dist_nn._AlltoAll is TORCHS) == (unswapped is None)
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    return ctx.backend, swap.calls, gloo_collectives.used(swap)


def test_the_swap_runs_on_gloo_groups_only(run_ranks):
    """On the suite's backend (gloo on CPU, NCCL in the GPU job: tox -e gpu)."""
    ((backend, calls, note),) = run_ranks(swapped_only_for_gloo, 1)
    assert (calls, note) == ((1, gloo_collectives.NOTE) if backend == "gloo" else (0, ""))
