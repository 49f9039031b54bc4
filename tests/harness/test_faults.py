"""Every way a case can go wrong is reported with the rank it happened on, and the next case is clean."""

import ctypes
import multiprocessing
import os
import re
import signal
import time

import pytest
import torch.distributed as dist

from tests.harness.processes import alive
from vdpcp.harness import RankFailure, run_ranks, setting_up
from vdpcp.harness.process import WorkerProcess

GENEROUS_TIMEOUT = 60.0  # faults below must be reported long before it: they are noticed, not timed out
NOTICED_WITHIN_S = 15.0


def worker_pid(ctx):
    return os.getpid()


def raise_before_barrier(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 found a wrong shard")
    dist.barrier(group=ctx.group)


def test_a_raising_rank_fails_the_case_and_the_pool_is_rebuilt():
    before = run_ranks(worker_pid, 2)
    with pytest.raises(RankFailure) as failure:
        run_ranks(raise_before_barrier, 2, timeout=GENEROUS_TIMEOUT)
    message = str(failure.value)
    raised, waited = _rank_section(message, 1), _rank_section(message, 0)
    assert "rank 1 raised ValueError: rank 1 found a wrong shard" in message
    assert "Traceback" in raised and "in raise_before_barrier" in raised
    grace = re.search(r"hung: still running ([0-9.]+) s after rank 1 raised", waited)  # 3 s, or longer on a loaded
    assert grace and float(grace[1]) >= 3 and "in barrier" in waited, waited  # machine: as long as rank 1 had run
    assert set(failure.value.failures) == {0, 1}
    assert not any(alive(pid) for pid in before)
    after = run_ranks(worker_pid, 2)
    assert set(after).isdisjoint(before)


def raise_after(ctx, seconds):
    """Every rank raises the same error, each after its own seconds: a rank still building its model is behind."""
    time.sleep(seconds[ctx.rank])
    raise ValueError(f"rank {ctx.rank}: the documented error")


def test_a_peer_behind_the_failed_rank_gets_as_long_as_that_rank_had_run():
    # Rank 1 runs past the grace after rank 0 fails, but within the time rank 0 had run: a slow peer, not a hung one.
    with pytest.raises(RankFailure) as failure:
        run_ranks(raise_after, 2, (0.6, 0.9), timeout=GENEROUS_TIMEOUT, fault_grace=0.1)
    assert "rank 1 raised ValueError: rank 1: the documented error" in str(failure.value), failure.value.failures


def test_a_peer_stuck_after_the_failed_rank_costs_at_most_that_long_again():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(raise_after, 2, (0.6, 600.0), timeout=GENEROUS_TIMEOUT, fault_grace=0.1)
    took = time.monotonic() - start
    waited = re.match(r"hung: still running ([0-9.]+) s after rank 0 raised", failure.value.failures[1])
    assert waited and float(waited[1]) >= 0.6, failure.value.failures
    assert took < NOTICED_WITHIN_S, took


def raise_after_set_up(ctx, set_up, then):
    """Rank 0 raises at once; rank 1 sets up for ``set_up`` s, then raises the same error or sleeps ``then`` s."""
    if ctx.rank == 1:
        with setting_up():
            time.sleep(set_up)
        time.sleep(then)
    raise ValueError(f"rank {ctx.rank}: the documented error")


def test_a_peer_still_setting_up_when_its_peer_raised_is_behind_not_hung():
    # A rank still building its model when its peers raise is behind them, not hung, however long the build takes.
    with pytest.raises(RankFailure) as failure:
        run_ranks(raise_after_set_up, 2, 1.5, 0.0, timeout=GENEROUS_TIMEOUT, fault_grace=0.1)
    assert "rank 1 raised ValueError: rank 1: the documented error" in str(failure.value), failure.value.failures


def test_a_peer_stuck_after_its_set_up_is_hung_its_grace_after_it():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(raise_after_set_up, 2, 1.0, 600.0, timeout=GENEROUS_TIMEOUT, fault_grace=0.1)
    took = time.monotonic() - start
    waited = re.match(r"hung: still running ([0-9.]+) s after rank 0 raised", failure.value.failures[1])
    assert waited and float(waited[1]) >= 1.0, failure.value.failures  # from the fault: its set-up, then its grace
    assert took < NOTICED_WITHIN_S, took


def die(ctx, how):
    if ctx.rank == 1:
        if how == "exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            ctypes.string_at(0)
    dist.barrier(group=ctx.group)


@pytest.mark.parametrize("how, report", [
    ("exit", "rank 1 died: exited with code 3"),
    ("sigkill", "rank 1 died: killed by signal SIGKILL"),
    ("segfault", "rank 1 died: killed by signal SIGSEGV"),
])
def test_a_dying_rank_is_noticed_at_once(how, report):
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(die, 2, how, timeout=GENEROUS_TIMEOUT)
    assert time.monotonic() - start < NOTICED_WITHIN_S
    assert report in str(failure.value)
    if how == "segfault":  # faulthandler's dump says where it crashed
        assert "in die" in _rank_section(str(failure.value), 1)
    assert run_ranks(worker_pid, 2)


def hang(ctx):
    if ctx.rank == 0:
        time.sleep(3600)
    dist.barrier(group=ctx.group)


def test_a_hang_is_killed_at_the_timeout_with_every_ranks_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(hang, 2, timeout=2)
    assert 2 <= time.monotonic() - start < NOTICED_WITHIN_S
    sleeping, waiting = _rank_section(str(failure.value), 0), _rank_section(str(failure.value), 1)
    assert "hung: still running at the 2 s timeout" in sleeping and "in hang" in sleeping
    assert "hung: still running at the 2 s timeout" in waiting and "in barrier" in waiting
    assert run_ranks(worker_pid, 2)


def skip_on_rank_1(ctx):
    if ctx.rank == 1:
        pytest.skip("rank 1 has no widgets")


def xfail_everywhere(ctx):
    pytest.xfail("known bug 42")


def test_a_skip_or_xfail_in_a_rank_reaches_the_caller_and_keeps_the_workers():
    before = run_ranks(worker_pid, 2)
    with pytest.raises(pytest.skip.Exception, match="rank 1 has no widgets"):
        run_ranks(skip_on_rank_1, 2)
    with pytest.raises(pytest.xfail.Exception, match="known bug 42"):
        run_ranks(xfail_everywhere, 2)
    assert run_ranks(worker_pid, 2) == before


def return_unpicklable(ctx):
    return lambda: ctx.rank


def start_a_case_inside_a_rank(ctx):
    return run_ranks(worker_pid, 1)


@pytest.mark.parametrize("body, report", [
    (return_unpicklable, "returned a value that cannot be pickled"),
    (start_a_case_inside_a_rank, "run_ranks was called inside a rank"),
])
def test_misuse_inside_a_rank_fails_with_a_reason(body, report):
    with pytest.raises(RankFailure, match=report):
        run_ranks(body, 2)


def _rank_section(message: str, rank: int) -> str:
    """The part of a RankFailure message about one rank."""
    return message.split(f"----- rank {rank}: ", 1)[1].split("\n----- rank ", 1)[0]


def test_a_rank_killed_before_it_read_its_case_is_a_death_not_a_crash_of_the_caller(monkeypatch):
    """Its socket then reads as reset, not closed (a zygote sent SIGTERM stops every rank at once, one perhaps
    before it read its case: seen in CI as ConnectionResetError out of run_ranks)."""
    ours, theirs = multiprocessing.Pipe()
    ours.send_bytes(b"a case it never read")
    theirs.close()
    rank = object.__new__(WorkerProcess)
    rank.conn = ours
    monkeypatch.setattr(WorkerProcess, "_death", lambda self: "its death, as a DIED outcome")
    assert rank.poll() == "its death, as a DIED outcome"
