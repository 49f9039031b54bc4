"""A self-launching rank harness: write a case body and a world size; the harness runs it on every rank.

    from vdpcp.harness import run_ranks

    def gather_ranks(ctx):  # module level: workers import it by name
        out = [torch.zeros(1) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(out, torch.tensor([float(ctx.rank)]), group=ctx.group)
        return [int(t) for t in out]

    def test_gather():
        assert run_ranks(gather_ranks, 4) == [[0, 1, 2, 3]] * 4

Ranks are warm worker processes (torch imported once, process group kept across cases of one world
size) owned by the calling process; see pool.py. Under torchrun each process is one rank instead; see
launcher.py. Nothing in here knows about vision.
"""

from vdpcp.harness.config import configure
from vdpcp.harness.context import RankContext
from vdpcp.harness.errors import BackendUnavailable, RankFailure
from vdpcp.harness.run import run_ranks, shutdown

__all__ = ["BackendUnavailable", "RankContext", "RankFailure", "configure", "run_ranks", "shutdown"]
