"""Did it shard, row by row (vdpcp.oracle.observe.split.judge_distribution): a row whose patches reached the towers of two CP
ranks was encoded twice, which is not-sharded even where every other row is on one rank and the run is not a
replicated one; the verdict counts such rows and names each with its ranks. Two ranks is the least that is
"more than one": at CP 2 it is every rank, at CP 4 half of them."""

import pytest
import torch

from vdpcp.matrix.case import RankResult
from vdpcp.oracle.observe import split


@pytest.mark.parametrize("read, said", [
    ([[True, False, True], [True, True, False]], "row 0 on ranks [0, 1]"),
    ([[True, False, False], [False, True, False], [False, False, True], [False, True, False]], "row 1 on ranks [1, 3]"),
])
def test_a_row_encoded_on_two_ranks_is_not_sharded_and_named_with_its_ranks(read, said):
    result = RankResult(0)
    result.add(split.judge_distribution(result.rank, torch.tensor(read), None, True, False))
    assert result.not_sharded == [f"not sharded: 1 of 3 rows encoded on more than one rank ({said})"], result.not_sharded
    assert result.failures == [] and result.plan_mismatch == []


def test_rows_each_on_one_rank_are_sharded():
    result = RankResult(0)
    result.add(split.judge_distribution(result.rank, torch.tensor([[True, False, True], [False, True, False]]), None,
                                        True, False))
    assert (result.not_sharded, result.failures, result.plan_mismatch) == ([], [], [])
