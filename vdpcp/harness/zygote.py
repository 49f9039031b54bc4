"""The zygote: ``python -m vdpcp.harness.zygote FD CALLER_PID POOL_DIR [--deathsig] [--preload=MODULE,...]``.

One fresh process per pool imports torch once, then forks a rank worker whenever the caller asks, so a
worker costs milliseconds and shares torch's memory copy-on-write instead of paying a 2.5 s import and
about 280 MB of its own. It is safe to fork because it stays single-threaded, never touches CUDA and
never runs a case (its environment pins OpenMP/BLAS to one thread, so importing torch starts none).
Modules named by --preload are imported too, after torch; if that starts a thread, it refuses to run.

Over the SOCK_SEQPACKET socket FD, each message one pickle:
  caller -> zygote: ("fork", rank, log_path, stack_path) with the worker's end of a socketpair attached
  zygote -> caller: ("ready",) once, then ("forked", rank, pid) and ("exited", pid, exit_code)
The zygote reaps its workers and reports their exit codes, since the caller is not their parent.
It exits when the caller closes the socket or goes away (PR_SET_PDEATHSIG with SIGTERM when asked, and
a check of its parent on every loop), removing POOL_DIR, which a killed caller could not; its workers
follow it (their PR_SET_PDEATHSIG is SIGKILL).
"""

import gc
import importlib
import os
import pickle
import select
import shutil
import signal
import socket
import sys

from vdpcp import third_party
from vdpcp.harness import worker

MAX_MESSAGE = 1 << 16


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    caller_pid, pool_dir = int(argv[1]), argv[2]

    def leave(*_):
        shutil.rmtree(pool_dir, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; workers inherit this
    worker.die_with_parent(caller_pid, signal.SIGTERM if "--deathsig" in argv else None)  # no watch thread: we fork

    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    third_party.import_cpp_extension_quietly()  # on torch 2.6 megatron's import would print a notice in every rank
    preload = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--preload=")), "")
    for name in filter(None, preload.split(",")):
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        sys.exit(f"vdpcp zygote: after importing torch and {preload or 'nothing else'} this process has "
                 f"{threads} threads; forking it would be unsafe")
    if torch.cuda.is_initialized():  # a forked child cannot use a CUDA context its parent made
        sys.exit(f"vdpcp zygote: importing {preload} initialised CUDA; forking it would be unsafe")
    gc.freeze()  # keep the collector from dirtying shared pages in every worker
    send = lambda *message: sock.send(pickle.dumps(message))  # noqa: E731
    send("ready")

    zygote_pid = os.getpid()
    workers: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([sock, *workers], [], [], 1.0)
        if os.getppid() != caller_pid:
            leave()
        for fd in readable:
            if fd is sock:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
                if not data:  # the caller closed its end
                    leave()
                _, rank, log_path, stack_path = pickle.loads(data)
                pid = os.fork()
                if pid == 0:
                    _become_worker(sock, workers, fds[0], rank, log_path, stack_path, zygote_pid)
                os.close(fds[0])
                workers[os.pidfd_open(pid)] = pid
                send("forked", rank, pid)
            else:
                pid = workers.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                send("exited", pid, os.waitstatus_to_exitcode(status))


def _become_worker(sock, workers: dict[int, int], fd: int, rank: int, log_path: str, stack_path: str, zygote_pid: int):
    """In the forked child: drop the zygote's descriptors and serve cases; never return to its loop."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sock.close()
        for pidfd in workers:
            os.close(pidfd)
        worker.serve(fd, rank, log_path, stack_path, zygote_pid)
        os._exit(0)
    except BaseException:  # noqa: BLE001 - whatever happens, this child must not run the zygote's loop
        import traceback

        traceback.print_exc()
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
