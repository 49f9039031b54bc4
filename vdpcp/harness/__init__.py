"""A self-launching rank harness: write a case body and a world size; the harness runs it on every rank.

    from vdpcp.harness import run_ranks

    def gather_ranks(ctx):  # module level: workers import it by name
        out = [torch.zeros(1) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(out, torch.tensor([float(ctx.rank)]), group=ctx.group)
        return [int(t) for t in out]

    def test_gather():
        assert run_ranks(gather_ranks, 4) == [[0, 1, 2, 3]] * 4

Ranks are warm worker processes owned by the calling process (one pool per process, so one per
xdist worker): forked in milliseconds from a zygote that imported torch once, grown to the largest
world size asked for, their process group kept across cases of one world size (pool.py). Each case
starts with torch seeded CASE_SEED + rank and MCore's parallel state released (state.py).

A rank that raises, dies or hangs fails the case with a RankFailure naming every failing rank with its
traceback or stack (a rank inside ``setting_up()``, building its model, say, is not yet counted as
hung); the workers are replaced before the next case, unless every rank returned (raised
or not) and a short check finds their process groups sound (soundness.py). pytest.skip/xfail in a rank
skips/xfails the caller. Defaults (config.py): backend auto (NCCL with a GPU per rank, else gloo),
timeout 120 s, set by configure(), the pytest plugin's options or VDPCP_BACKEND / VDPCP_TIMEOUT /
VDPCP_PRELOAD. Under torchrun each process is one rank instead (launcher.py). Nothing in here knows
about vision.
"""

from vdpcp.harness.config import configure
from vdpcp.harness.context import RankContext
from vdpcp.harness.errors import BackendUnavailable, RankFailure
from vdpcp.harness.run import deferred_imports, run_ranks, shutdown
from vdpcp.harness.worker import setting_up

__all__ = ["BackendUnavailable", "RankContext", "RankFailure", "configure", "deferred_imports", "run_ranks", "setting_up",
           "shutdown"]
