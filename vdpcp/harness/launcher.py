"""Running under an outside launcher (torchrun, srun + env): one rank per process, no workers.

When ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are set in a process that is not one of vdpcp's own
workers, every rank of the job runs the same tests in the same order, and each run_ranks call runs the
body here, on this rank, in the job's default process group (initialised from env:// on first use). So
the same test files scale past one machine::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m pytest -p no:xdist tests/...

Run pytest without xdist there (ranks must meet the same cases in the same order). A case whose world
size is not the job's WORLD_SIZE is skipped, saying so. After the body, the ranks exchange their
outcomes in one collective, so every rank returns the same list of values, or raises the same
RankFailure naming the ranks that failed, or skips. A hang dumps every thread's stack to stderr and
exits at the per-case timeout; the launcher then takes the other ranks down.
"""

import faulthandler
import os
import pickle

from vdpcp.harness import config, state
from vdpcp.harness.context import RankContext
from vdpcp.harness.outcome import capture, pickled, settle

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def active() -> bool:
    return all(name in os.environ for name in LAUNCHER_ENV) and "VDPCP_HARNESS_WORKER" not in os.environ


def run_here(fn, world_size: int, args: tuple, kwargs: dict, backend: str | None, timeout: float, what: str) -> list:
    job_size = int(os.environ["WORLD_SIZE"])
    if world_size != job_size:
        import pytest

        pytest.skip(f"case needs world size {world_size}; this launch has WORLD_SIZE={job_size}")
    import torch.distributed as dist

    ctx = _context(backend)

    def body():
        with state.clean_case(ctx.rank):
            return fn(ctx, *args, **kwargs)

    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        outcome = capture(ctx.rank, body)
        everyones = [None] * ctx.world_size
        dist.all_gather_object(everyones, pickled(outcome), group=ctx.group)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return settle([pickle.loads(data) for data in everyones], f"{what} ({ctx.backend}, launched)")


def _context(backend: str | None) -> RankContext:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if not dist.is_initialized():
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        chosen = config.resolve_backend(backend, ranks_here)
        if chosen == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(chosen, init_method="env://")
    chosen = dist.get_backend()
    from vdpcp.harness.group import device as rank_device

    device = rank_device(chosen, local_rank)
    from vdpcp.harness.turns import shared

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return RankContext(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, chosen, device,
                       shared(chosen, device, ranks_here))

