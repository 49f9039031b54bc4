"""The zygote: ``python -m vdpcp.harness.zygote FD CALLER_PID POOL_DIR [--deathsig] [--preload=MODULE,...]
[--tolerate-threads=PREFIX,...] [--cuda]``.

One fresh process per pool imports torch once, then forks a rank worker whenever the caller asks, so a
worker costs milliseconds and shares torch's memory copy-on-write instead of paying a 2.5 s import and
about 280 MB of its own. It is safe to fork because it stays single-threaded, never touches CUDA and
never runs a case (its environment pins OpenMP/BLAS to one thread, so importing torch starts none).
Modules named by --preload are imported too, after torch; if that starts a thread, it refuses to run, unless
the thread's OS name starts with a prefix given by --tolerate-threads (for a thread shown harmless to fork
past, e.g. a driver's idle helper: the child does not get it, only what it left in memory).
`python -m vdpcp.harness.forkcheck MODULE...` says which import starts a thread and whether a child forked
after it can still run CUDA and gloo. Where the caller sees GPUs (--cuda) it also refuses a preload after
which torch marks forked children unable to initialise CUDA (asked of one throwaway child).

Over the SOCK_SEQPACKET socket FD, each message one pickle:
  caller -> zygote: ("fork", rank, log_path, stack_path) with the worker's end of a socketpair attached
  zygote -> caller: ("ready",) once, then ("forked", rank, pid) and ("exited", pid, exit_code)
The zygote reaps its workers and reports their exit codes, since the caller is not their parent.
It exits when the caller closes the socket or goes away (PR_SET_PDEATHSIG with SIGTERM when asked, and
a check of its parent on every loop), removing POOL_DIR, which a killed caller could not; its workers
follow it (their PR_SET_PDEATHSIG is SIGKILL).
"""

import contextlib
import gc
import importlib
import os
import pickle
import select
import shutil
import signal
import socket
import sys
import warnings

from vdpcp import third_party
from vdpcp.harness import forkcheck, worker

MAX_MESSAGE = 1 << 16
ZYGOTE_CANARY_S = 30.0  # a child that only reads a flag and exits: milliseconds, unless the machine is starved


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    caller_pid, pool_dir = int(argv[1]), argv[2]
    workers: dict[int, int] = {}  # pidfd -> pid

    def leave(*_):
        # The workers first: one still running could write into POOL_DIR after rmtree listed it (its log, the
        # rendezvous store), and the directory would outlive everyone. Their PDEATHSIG would come only as we exit.
        for pid in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in workers.values():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        shutil.rmtree(pool_dir, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; workers inherit this
    worker.die_with_parent(caller_pid, signal.SIGTERM if "--deathsig" in argv else None)  # no watch thread: we fork

    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    third_party.import_cpp_extension_quietly()  # on torch 2.6 megatron's import would print a notice in every rank
    preload = _option(argv, "--preload")
    for name in filter(None, preload.split(",")):
        importlib.import_module(name)
    tolerated = tuple(filter(None, _option(argv, "--tolerate-threads").split(",")))
    names = sorted(forkcheck.thread_names().values())  # the threads besides the main one
    others = [name for name in names if not name.startswith(tolerated)]
    if others:
        sys.exit(f"vdpcp zygote: after importing torch and {preload or 'nothing else'} this process has "
                 f"{len(others) + 1} threads ({', '.join(others)} besides the main one); forking it would be unsafe "
                 f"(`python -m vdpcp.harness.forkcheck {preload.replace(',', ' ')}` says which import starts them)")
    if torch.cuda.is_initialized():  # a forked child cannot use a CUDA context its parent made
        sys.exit(f"vdpcp zygote: importing {preload} initialised CUDA; forking it would be unsafe")
    if "--cuda" in argv and _child_in_bad_fork():
        sys.exit(f"vdpcp zygote: after importing torch and {preload or 'nothing else'} a forked child cannot initialise "
                 f"CUDA (torch marks it a "
                 f"bad fork: something counted devices through the CUDA runtime, e.g. torch.cuda.is_available(); "
                 f"with PYTORCH_NVML_BASED_CUDA_CHECK=1 that check asks NVML instead, which leaves forks usable)")
    if names:  # tolerated on purpose: Python's warning at every fork would only fill the log
        warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning)
    gc.freeze()  # keep the collector from dirtying shared pages in every worker

    def send(*message):
        try:
            sock.send(pickle.dumps(message))
        except ConnectionError:  # the caller is gone
            leave()

    send("ready")

    zygote_pid = os.getpid()
    while True:
        readable, _, _ = select.select([sock, *workers], [], [], 1.0)
        if os.getppid() != caller_pid:
            leave()
        for fd in readable:
            if fd is sock:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
                except ConnectionResetError:  # the caller died with a message of ours unread: closed all the same
                    data = b""
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


def _option(argv: list[str], name: str) -> str:
    return next((arg.split("=", 1)[1] for arg in argv if arg.startswith(f"{name}=")), "")


def _child_in_bad_fork() -> bool:
    """Whether torch says a child forked now could not initialise CUDA (its fork handler, registered when the
    CUDA runtime counted devices, marks every child so). Asked of a throwaway child that touches nothing."""
    import torch

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, b"1" if torch.cuda._is_in_bad_fork() else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1) if select.select([read], [], [], ZYGOTE_CANARY_S)[0] else b""
    os.close(read)
    if not answer:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return answer != b"0"  # no answer in time counts as bad too


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
