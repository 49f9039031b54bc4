"""The CP group's collectives kept local for a backward (vdpcp.tools.mutants.collectives): what the generic mutants of
the field's gather-backward bugs stand on. Local means what the collective leaves when this rank is alone, only
for the span of the outputs' backward, only on the CP group's ranks, and torch.distributed as it was after."""

import pytest

from vdpcp.harness import run_ranks


def gathered_backward(ctx, kept_local: bool):
    """Each rank gathers rank+1 rows and weighs every gathered row by (its rank + 1): the gradient its rows get
    back, whether torch.distributed.all_reduce is the real one afterwards, and the collectives kept local."""
    import torch
    import torch.distributed as dist

    from vdpcp.feature import comm
    from vdpcp.tools.mutants import gradient_changed
    from vdpcp.tools.mutants.collectives import LocalBackward

    original, ended = dist.all_reduce, []
    counts = [r + 1 for r in range(ctx.world_size)]
    local = torch.ones(counts[ctx.rank], 2, dtype=torch.float64, requires_grad=True)
    out = comm.gather_features(local, counts, ctx.group)
    if kept_local:
        out = gradient_changed(out, LocalBackward(ctx.group, ended=ended.append).opened)
    (out * (ctx.rank + 1)).sum().backward()
    restored = dist.all_reduce is original
    after = torch.ones(1)
    dist.all_reduce(after, group=ctx.group)  # the real one: a sum over every rank
    return local.grad[:, 0].tolist(), restored, ended, after.item()


@pytest.mark.distributed
def test_a_backward_kept_local_sums_nothing_and_puts_torch_distributed_back():
    ranks = run_ranks(gathered_backward, 2, True)
    assert [grad for grad, *_ in ranks] == [[1.0], [2.0, 2.0]]  # each rank's own weight, not 1 + 2
    assert all(restored and ended == [1] and after == 2.0 for _, restored, ended, after in ranks), ranks


@pytest.mark.distributed
def test_without_it_the_same_gather_sums_every_ranks_gradient():
    assert [grad for grad, *_ in run_ranks(gathered_backward, 2, False)] == [[3.0], [3.0, 3.0]]


@pytest.mark.distributed
def test_a_subject_whose_backward_crosses_no_rank_has_nothing_the_mutant_changes_and_says_so():
    from vdpcp.matrix import scenarios
    from vdpcp.tools.mutants.hunt import hunt

    case = {c.id: c for c in scenarios.matrix()}["eight-equal-cp2-reference-count"]
    found = hunt("gather-backward-unsummed", [case.with_(impl="tests.oracle.subjects:replicating")])
    assert not found.killed and not found.survived, found
    assert found.not_applicable.startswith("mutant does not apply: replicating's backward runs no torch.distributed "
                                           "collective over the CP group"), found
