"""A warm rank worker, forked by the zygote: runs one Task (a case body for its rank) at a time until it reads None or EOF.

Its output goes to a per-rank log file the caller reads; SIGUSR1 (and any fatal signal) writes every
thread's Python stack to a per-rank stack file, which is how a hung or crashed rank's stack reaches the
report. It dies with the zygote (PR_SET_PDEATHSIG), which dies with the caller.
"""

import ctypes
import faulthandler
import importlib
import os
import pickle
import signal
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import Connection

from vdpcp.harness import state
from vdpcp.harness.messages import READY, SET_UP, SETTING_UP, Task
from vdpcp.harness.outcome import capture, pickled

PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1
# gloo then connects a group's peers at its first collective, not when the group is made: MCore makes many groups
# a case and its vision path uses two, so an eager full mesh each is mostly waiting. A caller's value wins.
RANK_DEFAULTS = {"TORCH_GLOO_LAZY_INIT": "1"}
_conn: Connection | None = None  # to the caller, in a worker; None elsewhere (the caller's own process, torchrun)


def serve(fd: int, rank: int, log_path: str, stack_path: str, zygote_pid: int, warm_up=lambda: None) -> None:
    """Serve cases over ``fd``; ``warm_up()`` runs once, output set up, before the worker says it is ready (a
    failure there is the worker's start failing, with its traceback in its log)."""
    die_with_parent(zygote_pid, signal.SIGKILL, watch=True)
    ctypes.CDLL(None).prctl(PR_SET_NAME, f"vdpcp-rank{rank}".encode())  # what `ps -o comm` shows
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    stacks = open(stack_path, "w")
    faulthandler.enable(stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, stacks, all_threads=True)
    state.remember_fresh()

    warm_up()
    global _conn
    conn = _conn = Connection(fd)
    conn.send_bytes(READY)
    while True:
        try:
            case = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if case is None:
            return
        conn.send_bytes(run(case))


def run(case: Task) -> bytes:
    """Run one case on this rank; the pickled Outcome."""
    adopt_caller(case)
    outcome = capture(case.rank, lambda: call(case))
    sys.stdout.flush()
    sys.stderr.flush()
    return pickled(outcome)


def call(case: Task):
    import torch.distributed as dist

    from vdpcp.harness import group, turns
    from vdpcp.harness.context import RankContext

    group.ensure(case.group, case.rank)
    fn, args, kwargs = pickle.loads(case.call)
    backend = case.group.backend
    device = group.device(backend, case.rank)
    ctx = RankContext(case.rank, case.group.world_size, dist.group.WORLD, backend, device,
                      turns.shared(backend, device, case.group.world_size))
    with state.clean_case(case.rank):
        return fn(ctx, *args, **kwargs)


@contextmanager
def setting_up():
    """Mark the block as this rank's set-up: building its model, its device's first use, imports. A rank still
    setting up when a peer fails is behind, not hung: the caller's grace for it starts when the block ends (the
    case's timeout still bounds it). Set-up differs most between ranks when some are warm and some are not (a
    model cached on two ranks, built on the other two, each creating its CUDA context on a loaded machine), so
    no grace measured from the failed rank covers it. Outside a pool's worker it does nothing."""
    if _conn is None:
        yield
        return
    _conn.send_bytes(SETTING_UP)
    try:
        yield
    finally:
        _conn.send_bytes(SET_UP)


def adopt_caller(case: Task) -> None:
    """Import, resolve paths and read the environment as the caller does now, as torchrun ranks would."""
    if sys.path != case.sys_path:
        sys.path[:] = case.sys_path
        importlib.invalidate_caches()
    os.chdir(case.cwd)
    launcher_view = {"RANK": case.rank, "LOCAL_RANK": case.rank,
                     "WORLD_SIZE": case.group.world_size, "LOCAL_WORLD_SIZE": case.group.world_size}
    os.environ.clear()
    os.environ.update(case.environ)
    for name, value in RANK_DEFAULTS.items():
        os.environ.setdefault(name, value)
    os.environ.update({name: str(value) for name, value in launcher_view.items()})
    os.environ["VDPCP_HARNESS_WORKER"] = "1"


def die_with_parent(parent_pid: int, deathsig: int | None, watch: bool = False) -> None:
    """Exit when ``parent_pid`` goes: the kernel sends ``deathsig`` (PR_SET_PDEATHSIG). It follows the
    thread that started us, so it is only asked for when that was the parent's main thread (always so
    for the zygote's forks); if it is not in force and ``watch``, a thread polls our parent instead."""
    if deathsig is not None:
        deathsig = deathsig if ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, deathsig) == 0 else None
    if os.getppid() != parent_pid:  # the parent went before the kernel was told to watch it
        os._exit(1)
    if watch and deathsig is None:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="vdpcp-parent-watch", daemon=True).start()


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)
