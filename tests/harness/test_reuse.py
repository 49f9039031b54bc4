"""A case whose ranks only raised keeps its workers when its process groups are sound, and only then.

Re-forking a worker costs every import its cases make (seconds on a GPU machine, where the zygote preloads
nothing), so keeping them matters; keeping them after an op was left pending would poison the next case, so
each unsound way out below must re-fork, and the next case must still get right answers.
"""

import json
import os
import pickle
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tests.harness.processes import alive
from vdpcp.harness import config, soundness
from vdpcp.harness import pool as pool_module
from vdpcp.harness.outcome import OK, RAISED, Outcome
from vdpcp.harness.pool import WorkerPool

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def pool():
    """One pool for the module, preloading nothing (cheap to start; a re-fork costs only a fork here)."""
    pool = WorkerPool()
    yield pool
    pool.shutdown()


def run(pool, fn, world_size=2, **options):
    return pool.run(pickle.dumps((fn, (), {})), world_size, "gloo", TIMEOUT, **options)


def pids(pool, world_size=2):
    outcomes = run(pool, worker_pid, world_size)
    assert [o.kind for o in outcomes] == [OK] * world_size, [o.summary for o in outcomes]
    return [o.value for o in outcomes]


def assert_gather_works(pool, world_size=2):
    """The next case's collectives see this case's values only: nothing stale, nothing pending."""
    assert [o.value for o in run(pool, gather_ranks, world_size)] == [list(range(world_size))] * world_size


def worker_pid(ctx):
    return os.getpid()


def gather_ranks(ctx):
    out = [torch.zeros(1) for _ in range(ctx.world_size)]
    dist.all_gather(out, torch.tensor([float(ctx.rank)]), group=ctx.group)
    return [int(t) for t in out]


def raise_after_a_collective(ctx):
    gather_ranks(ctx)
    raise ImportError(f"rank {ctx.rank}: cannot import name 'all_gather_single'")


def raise_on_rank_1_only(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 found a wrong shard")
    return ctx.rank  # rank 0 returns, waiting in no collective for rank 1


def raise_after_matched_async_ops(ctx):
    dist.all_reduce(torch.ones(3), group=ctx.group, async_op=True)  # every rank issued it: it completes anyway
    raise ValueError("raised before waiting")


def raise_after_building_subgroups(ctx):
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    dist.all_reduce(torch.ones(1), group=low if ctx.rank < 2 else high)
    raise ValueError("raised after its subgroup's collective")


@pytest.mark.parametrize("body, world_size", [
    (raise_after_a_collective, 2),
    (raise_on_rank_1_only, 2),
    (raise_after_matched_async_ops, 2),
    (raise_after_building_subgroups, 4),
])
def test_sound_raises_keep_the_workers(pool, body, world_size):
    before = pids(pool, world_size)
    outcomes = run(pool, body, world_size)
    assert RAISED in {o.kind for o in outcomes}
    assert pool.recovery.startswith("kept"), pool.recovery
    assert pids(pool, world_size) == before
    assert_gather_works(pool, world_size)


def raise_with_a_world_collective_pending(ctx):
    if ctx.rank == 0:  # issued, never waited for, and rank 1 never issues it
        dist.all_gather([torch.zeros(1) for _ in range(ctx.world_size)], torch.ones(1), group=ctx.group, async_op=True)
    raise ValueError("raised with a collective pending")


def raise_with_a_subgroup_collective_pending(ctx):
    pair = dist.new_group([0, 1])
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1), group=pair, async_op=True)
    raise ValueError("raised with a subgroup's collective pending")


_UNRECEIVED = []  # a rank's pending send, held: its worker is re-forked, so the Work is never destroyed mid-send


def raise_with_a_send_unreceived(ctx):
    if ctx.rank == 0:  # a later recv from rank 0 must not get this 7
        _UNRECEIVED.append(dist.isend(torch.full((1,), 7.0), 1, group=ctx.group))
    # Rank 1 raises only once the send is issued: raising at once, it raced rank 0's isend on a loaded machine
    # (rank 0 then never returned from it: 3 of 6 CI runs one afternoon). The barrier is on both ranks, the send on one.
    dist.barrier(group=ctx.group)
    raise ValueError("raised with a send unreceived")


def raise_after_mismatched_async_ops(ctx):
    # As many ops on every rank, so the counts agree, but not the same op: they never complete, and destroying
    # the group waits for them, so the next case's group rebuild would hang.
    if ctx.rank == 0:
        dist.all_gather([torch.zeros(1) for _ in range(ctx.world_size)], torch.ones(1), group=ctx.group, async_op=True)
    else:
        dist.all_reduce(torch.ones(3), group=ctx.group, async_op=True)
    raise ValueError("raised after mismatched collectives")


@pytest.mark.parametrize("body, why", [
    (raise_with_a_world_collective_pending, "after different numbers of collectives (rank 0: "),
    (raise_with_a_subgroup_collective_pending, "after different numbers of collectives (rank 0: 1, rank 1: 0)"),
    (raise_with_a_send_unreceived, "after different numbers of collectives"),
    (raise_after_mismatched_async_ops, "check hung: still running at the 1 s timeout"),
])
def test_unsound_raises_re_fork_the_workers(pool, monkeypatch, body, why):
    monkeypatch.setattr(pool_module, "SOUNDNESS_TIMEOUT_S", 1.0)  # the mismatched ops hang the check this long
    before = pids(pool)
    # Every rank raises at once: 30 s of grace after the first, not the default 3, so a rank starved of CPU on a loaded
    # machine is not read as hung; a rank that does hang shows its stack in the message.
    outcomes = run(pool, body, fault_grace=30.0)
    assert {o.kind for o in outcomes} == {RAISED}, [(o.kind, o.summary, o.detail) for o in outcomes]
    assert pool.recovery.startswith("re-forked") and why in pool.recovery, pool.recovery
    assert not any(alive(pid) for pid in before)
    assert set(pids(pool)).isdisjoint(before)
    assert_gather_works(pool)


def test_with_reuse_off_every_raise_re_forks(pool):
    before = pids(pool)
    run(pool, raise_after_a_collective, reuse_after_raise=False)
    assert pool.recovery == "re-forked: reuse after a raise is off"
    assert set(pids(pool)).isdisjoint(before)


def raise_after_a_device_side_assert(ctx):
    values = torch.zeros(2, device="cuda")
    values[torch.tensor([5], device="cuda")] = 1.0  # out of range: a device-side assert, sticky for the process
    torch.cuda.synchronize()


@pytest.mark.skipif(config.cuda_device_count() == 0, reason="needs a GPU")
def test_a_sticky_cuda_error_re_forks_the_workers(pool):
    before = pids(pool)
    outcomes = run(pool, raise_after_a_device_side_assert)
    assert {o.kind for o in outcomes} == {RAISED}, [(o.rank, o.kind, o.summary) for o in outcomes]
    assert pool.recovery.startswith("re-forked: rank 0's check raised"), pool.recovery
    assert set(pids(pool)).isdisjoint(before)


def echo_as_if_on_a_shared_gpu(ctx):
    return soundness.echo(replace(ctx, device=torch.device("cuda", 0)), 42)


def test_the_echo_of_gloo_ranks_stays_on_the_cpu_whatever_their_device(pool):
    """A gloo rank told to use a GPU (VDPCP_DEVICE=cuda) whose case never touched CUDA must not create a CUDA
    context in the check: on this machine, without CUDA, it would raise; on a GPU, it costs seconds."""
    outcomes = run(pool, echo_as_if_on_a_shared_gpu)
    assert [o.value for o in outcomes] == [[[0, 42], [1, 42]]] * 2, [o.summary for o in outcomes]


def census_of(*groups_by_rank) -> list[Outcome]:
    return [Outcome(rank, OK, value=groups) for rank, groups in enumerate(groups_by_rank)]


@pytest.mark.parametrize("census, why", [
    (census_of({"0": ([0, 1], 3)}, {"0": ([0, 1], 3)}), None),
    (census_of({"0": ([0, 1, 2], 3), "1": ([0, 1], 1)}, {"0": ([0, 1, 2], 3), "1": ([0, 1], 1)}, {"0": ([0, 1, 2], 3)}), None),
    (census_of({"0": ([0, 1], 3)}, {"0": ([0, 1], 2)}), "after different numbers of collectives (rank 0: 3, rank 1: 2)"),
    (census_of({"0": ([0, 1], 3), "1": ([0, 1], 0)}, {"0": ([0, 1], 3)}), "process group '1' differs between ranks"),
    (census_of({"0": ([0, 1], 3), "1": ([0, 1], 0)}, {"0": ([0, 1], 3), "1": ([1, 0], 0)}), "rank 1 sees members [1, 0]"),
    ([Outcome(0, OK, value={}), Outcome(1, RAISED, summary="raised AttributeError: _world")],
     "rank 1's check raised AttributeError: _world"),
])
def test_the_census_verdict(census, why):
    found = soundness.census_verdict(census)
    assert found == why if why is None else why in found


def test_the_echo_verdict_wants_every_ranks_fresh_nonce():
    right = [[0, 42], [1, 42]]
    assert soundness.echo_verdict([Outcome(0, OK, value=right), Outcome(1, OK, value=right)], 42) is None
    stale = [Outcome(0, OK, value=right), Outcome(1, OK, value=[[0, 41], [1, 42]])]
    assert "rank 1's check all_gather returned [[0, 41], [1, 42]]" in soundness.echo_verdict(stale, 42)


def test_bench_faults_measures_each_way_and_says_what_happened_to_the_workers(tmp_path, capsys):
    from vdpcp.cli import main

    figures = tmp_path / "faults.json"
    argv = ["bench", "faults", "--modules", "", "--passes", "1", "--repeats", "1", "--grace", "0.2",
            "--config", "none/off", "--config", "none/on", "--json", str(figures)]
    assert main(argv) == 0
    rows = {row["config"]: row for row in json.loads(figures.read_text())["rows"]}
    assert [rows[c]["every"]["workers"] for c in ("none/off", "none/on")] == ["re-forked", "kept"]
    assert [rows[c]["one"]["workers"] for c in ("none/off", "none/on")] == ["re-forked", "re-forked"]  # rank 0 hung
    assert all(row["pass_s"] > 0 and "error" not in row for row in rows.values())
    assert "what a faulted case adds to a passing one" in capsys.readouterr().out
