"""run_ranks hands every rank the same body and returns what each rank returned, in rank order."""

import os
import pickle
import sys
import types

import pytest
import torch
import torch.distributed as dist

from vdpcp.harness import run_ranks
from vdpcp.harness.pool import WorkerPool
from vdpcp.harness.state import CASE_SEED


def gather_ranks(ctx):
    gathered = [torch.zeros(1, dtype=torch.int64, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, torch.tensor([10 * ctx.rank], device=ctx.device), group=ctx.group)
    return [int(t) for t in gathered]


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_all_gather_sees_every_rank(world_size):
    assert run_ranks(gather_ranks, world_size) == [[10 * r for r in range(world_size)]] * world_size


def whoami(ctx, *args, **kwargs):
    return dict(rank=ctx.rank, world_size=ctx.world_size, group_size=ctx.group.size(), backend=ctx.backend,
                device=str(ctx.device), pid=os.getpid(), args=args, kwargs=kwargs)


def test_results_are_indexed_by_rank_and_every_rank_gets_the_arguments(on_the_cpu):
    results = run_ranks(whoami, 4, 1, "two", three=3.0)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {(r["world_size"], r["group_size"]) for r in results} == {(4, 4)}
    assert {(r["args"], tuple(r["kwargs"].items())) for r in results} == {((1, "two"), (("three", 3.0),))}
    for r in results:
        assert r["device"] == ("cpu" if r["backend"] == "gloo" else f"cuda:{r['rank']}")


def test_workers_stay_warm_across_cases():
    first = [r["pid"] for r in run_ranks(whoami, 2)]
    assert [r["pid"] for r in run_ranks(whoami, 2)] == first
    assert os.getpid() not in first


def draw_then_dirty(ctx):
    drawn = torch.rand(3)
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return drawn


def draw(ctx):
    return torch.rand(3), torch.get_default_dtype(), torch.is_grad_enabled()


def test_each_case_starts_from_fresh_torch_state_seeded_by_rank():
    expected = [torch.rand(3, generator=torch.Generator().manual_seed(CASE_SEED + rank)) for rank in (0, 1)]
    assert not torch.equal(*expected)
    for drawn, fresh in zip(run_ranks(draw_then_dirty, 2), expected):
        torch.testing.assert_close(drawn, fresh)
    for (drawn, dtype, grad), fresh in zip(run_ranks(draw, 2), expected):
        torch.testing.assert_close(drawn, fresh)
        assert (dtype, grad) == (torch.float32, True)


PARALLEL_STATE = "megatron.core.parallel_state"


def install_initialised_parallel_state(ctx):
    """Stand in for MCore's parallel_state (importing the real one costs seconds per rank)."""
    fake = types.ModuleType(PARALLEL_STATE)
    fake.replaced = sys.modules.get(PARALLEL_STATE)
    fake.initialised = True
    fake.is_initialized = fake.model_parallel_is_initialized = lambda: fake.initialised
    fake.destroy_model_parallel = lambda: setattr(fake, "initialised", False)
    sys.modules[PARALLEL_STATE] = fake


def parallel_state_initialised(ctx):
    fake = sys.modules.pop(PARALLEL_STATE)
    if fake.replaced is not None:
        sys.modules[PARALLEL_STATE] = fake.replaced
    return fake.initialised


def test_mcore_parallel_state_is_destroyed_after_each_case():
    run_ranks(install_initialised_parallel_state, 2)
    assert run_ranks(parallel_state_initialised, 2) == [False, False]


def install_parallel_state_holding_groups(ctx):
    """A parallel_state that made groups as MCore's does (one alone, some in a list) and, like MCore's
    destroy_model_parallel, only forgets them; what c10d holds, before and after."""
    import torch.distributed as dist

    from vdpcp.harness.soundness import census

    before = len(census(ctx))
    install_initialised_parallel_state(ctx)
    fake = sys.modules[PARALLEL_STATE]
    fake._CONTEXT_PARALLEL_GROUP = dist.new_group([0, 1])
    fake._DATA_PARALLEL_GROUPS = [dist.new_group([0]), dist.new_group([1])]
    fake._WORLD = dist.group.WORLD  # the default group: never the library's to destroy

    def forget():  # as MCore's destroy_model_parallel: its globals set to None, the groups left to c10d
        fake.initialised = False
        fake._CONTEXT_PARALLEL_GROUP = fake._DATA_PARALLEL_GROUPS = None

    fake.destroy_model_parallel = forget
    return before, len(census(ctx))


def groups_and_parallel_state(ctx):
    from vdpcp.harness.soundness import census

    return len(census(ctx)), parallel_state_initialised(ctx)


def test_the_groups_a_librarys_parallel_state_made_are_destroyed_with_it_after_each_case():
    # MCore's destroy_model_parallel forgets its groups, and c10d kept each (with a gloo group's threads and
    # sockets): 20 groups and 60 threads a rank per MCore case at CP 8, a load average of 250 here after a while.
    (before, during), _ = run_ranks(install_parallel_state_holding_groups, 2)
    assert during == before + 2  # rank 0 is in two of the three groups, rank 1 too
    assert run_ranks(groups_and_parallel_state, 2) == [(before, False)] * 2


def threads_around_release(ctx):
    """This rank's OS threads by name before a library's groups, with them, and at once after release_libraries
    with the garbage collector off: the groups' threads must be gone with the release itself."""
    import gc

    from vdpcp.harness.forkcheck import thread_names
    from vdpcp.harness.state import release_libraries

    def threads():
        return sorted(thread_names().values())

    before = threads()
    install_parallel_state_holding_groups(ctx)
    connect_the_libraries_groups(ctx)
    during = threads()
    gc.disable()
    try:
        release_libraries()
        after = threads()
    finally:
        gc.enable()
    parallel_state_initialised(ctx)
    return before, during, after


def gloo_threads(names):
    return [name for name in names if "gloo" in name.lower()]


def connect_the_libraries_groups(ctx):
    """Ranks' gloo connects lazily: a group has its threads once it is used. (A function of its own, so that no
    variable of the caller's is left holding a group the release must free.)"""
    fake = sys.modules[PARALLEL_STATE]
    for group in [fake._CONTEXT_PARALLEL_GROUP, *fake._DATA_PARALLEL_GROUPS]:
        if ctx.rank in dist.get_process_group_ranks(group):
            dist.barrier(group=group)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts native threads in /proc (Linux)")
def test_released_groups_and_their_gloo_threads_are_freed_by_the_release_not_by_a_later_garbage_collection():
    # A release that left a reference cycle to its groups kept their gloo threads until the collector's next pass,
    # whose thread joins then land mid-way through the next case on every rank.
    # Only gloo's threads are counted: others (torch's intra-op pool, a watchdog) may come and go on their own.
    for before, during, after in run_ranks(threads_around_release, 2):
        assert len(gloo_threads(during)) > len(gloo_threads(before)), during
        assert gloo_threads(after) == gloo_threads(before), (before, after)


def environment_view(ctx):
    return os.environ.get("VDPCP_PROBE"), os.environ["RANK"], os.environ["WORLD_SIZE"], os.getcwd()


def test_ranks_see_the_callers_environment_and_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("VDPCP_PROBE", "set by the caller")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(environment_view, 2) == [("set by the caller", str(r), "2", str(tmp_path)) for r in (0, 1)]


def lazy_gloo(ctx):
    return os.environ.get("TORCH_GLOO_LAZY_INIT")


@pytest.mark.parametrize("caller, rank", [(None, "1"), ("0", "0")], ids=["default", "callers-own"])
def test_gloo_connects_lazily_in_ranks_unless_the_caller_says_otherwise(monkeypatch, caller, rank):
    if caller is None:
        monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    else:
        monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", caller)
    assert run_ranks(lazy_gloo, 2) == [rank, rank]


def say_hello(ctx):
    print(f"hello from rank {ctx.rank}")


def test_what_ranks_print_reaches_the_callers_output(capsys):
    run_ranks(say_hello, 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out


def import_megatron(ctx):
    import megatron.core.models.multimodal.context_parallel  # noqa: F401


def test_megatrons_import_notices_are_not_among_what_ranks_print(capsys):
    pool = WorkerPool()  # its own, preloading nothing: the rank imports megatron itself, as on a GPU machine
    try:
        pool.run(pickle.dumps((import_megatron, (), {})), 1, "gloo", timeout=120, preload=())
    finally:
        pool.shutdown()
    out = capsys.readouterr().out
    assert "is not installed" not in out and "No CUDA runtime" not in out, out


def test_the_run_ranks_fixture_is_the_harness_function(run_ranks, request):
    assert run_ranks(whoami, 1)[0]["rank"] == 0
    assert request.node.get_closest_marker("distributed") is not None


def test_a_body_must_be_importable_by_the_ranks():
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(lambda ctx: None, 2)
