"""Cases that test_launcher.py runs under ``torchrun --nproc-per-node 2``; skipped anywhere else.

Not named test_*.py, so a plain pytest run does not collect them; torchrun's pytest is given the path.
"""

import os

import pytest

from vdpcp.harness import RankFailure, launcher, run_ranks

pytestmark = pytest.mark.skipif(not launcher.active(), reason="runs only under torchrun (see test_launcher.py)")


def rank_and_pid(ctx):
    return ctx.rank, ctx.world_size, os.getpid()


def test_each_rank_runs_the_body_in_its_own_process_and_every_rank_gets_all_results():
    results = run_ranks(rank_and_pid, 2)
    me = int(os.environ["RANK"])
    assert [(rank, size) for rank, size, _ in results] == [(0, 2), (1, 2)]
    assert results[me][2] == os.getpid() != results[1 - me][2]


def test_a_case_for_another_world_size_is_skipped():
    with pytest.raises(pytest.skip.Exception, match="needs world size 4; this launch has WORLD_SIZE=2"):
        run_ranks(rank_and_pid, 4)


def raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("only rank 1 saw this")
    return ctx.rank


def test_a_failure_on_one_rank_fails_the_case_on_every_rank():
    with pytest.raises(RankFailure) as failure:
        run_ranks(raise_on_rank_1, 2)
    assert "rank 1 raised ValueError: only rank 1 saw this" in str(failure.value)
    assert set(failure.value.failures) == {1}
    assert [rank for rank, _, _ in run_ranks(rank_and_pid, 2)] == [0, 1]  # and the job carries on
