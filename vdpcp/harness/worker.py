"""A warm rank: ``python -m vdpcp.harness.worker FD CALLER_PID STACK_FILE [--deathsig]``.

Started fresh by the pool (never forked from a torch-laden caller), it imports torch once, says READY
over the socket FD, then runs one Case at a time until it reads None or EOF. It dies with its caller:
the kernel kills it when the caller goes (PR_SET_PDEATHSIG, asked for only when the caller spawned it
from its main thread, since the signal follows the spawning thread) and a watchdog thread exits when
its parent changes. SIGUSR1 writes every thread's Python stack to STACK_FILE; so does a fatal signal.
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
from multiprocessing.connection import Connection

from vdpcp.harness import state
from vdpcp.harness.outcome import RAISED, Outcome, capture
from vdpcp.harness.protocol import READY, Case

PR_SET_PDEATHSIG = 1
_WORKER_ENV = {"VDPCP_HARNESS_WORKER": "1"}


def main(argv: list[str]) -> None:
    fd, caller_pid, stack_path = int(argv[0]), int(argv[1]), argv[2]
    tie_life_to(caller_pid, deathsig="--deathsig" in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; it kills us on its way out
    stacks = open(stack_path, "w")
    faulthandler.enable(stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, stacks, all_threads=True)

    import torch

    torch.set_num_threads(1)  # 8 ranks share 2 cores; OMP/MKL were set to 1 in our environment
    torch.set_num_interop_threads(1)
    state.remember_fresh()

    conn = Connection(fd)
    conn.send_bytes(READY)
    while True:
        try:
            case = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if case is None:
            return
        conn.send_bytes(run(case))


def run(case: Case) -> bytes:
    """Run one case on this rank; the pickled Outcome."""
    adopt_caller(case)
    outcome = capture(case.rank, lambda: call(case))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return pickle.dumps(outcome)
    except Exception as err:  # noqa: BLE001 - the value is the body's; say what was wrong with it
        return pickle.dumps(Outcome(case.rank, RAISED, summary=f"returned a value that cannot be pickled: {err!r}"))


def call(case: Case):
    import torch.distributed as dist

    from vdpcp.harness import group
    from vdpcp.harness.context import RankContext

    group.ensure(case.group, case.rank)
    state.reset()
    fn, args, kwargs = pickle.loads(case.call)
    backend = case.group.backend
    ctx = RankContext(case.rank, case.group.world_size, dist.group.WORLD, backend, group.device(backend, case.rank))
    try:
        return fn(ctx, *args, **kwargs)
    finally:
        state.release_libraries()


def adopt_caller(case: Case) -> None:
    """Import, resolve paths and read the environment as the caller does now, as torchrun ranks would."""
    if sys.path != case.sys_path:
        sys.path[:] = case.sys_path
        importlib.invalidate_caches()
    os.chdir(case.cwd)
    launcher_view = {"RANK": case.rank, "LOCAL_RANK": case.rank,
                     "WORLD_SIZE": case.group.world_size, "LOCAL_WORLD_SIZE": case.group.world_size}
    os.environ.clear()
    os.environ.update(case.environ)
    os.environ.update({name: str(value) for name, value in launcher_view.items()})
    os.environ.update(_WORKER_ENV)


def tie_life_to(caller_pid: int, deathsig: bool) -> None:
    if deathsig:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != caller_pid:  # the caller went before the kernel was told to watch it
        os._exit(1)
    threading.Thread(target=_exit_when_orphaned, args=(caller_pid,), name="vdpcp-caller-watch", daemon=True).start()


def _exit_when_orphaned(caller_pid: int) -> None:
    while os.getppid() == caller_pid:
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
