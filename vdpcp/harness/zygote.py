"""The zygote: ``python -m vdpcp.harness.zygote FD CALLER_PID POOL_DIR [--deathsig] [--preload=MODULE,...]
[--after-fork=MODULE,...] [--tolerate-threads=PREFIX,...] [--cuda]``.

One fresh process per pool imports torch once, then forks a rank worker whenever the caller asks, so a
worker costs milliseconds and shares torch's memory copy-on-write instead of paying torch's import and
memory of its own. It is safe to fork because it stays single-threaded, never touches CUDA and
never runs a case (its environment pins OpenMP/BLAS to one thread, so importing torch starts none).
Modules named by --preload are imported too, after torch, one at a time. The first import after which forking
would be unsafe (it left a thread, unless the thread's OS name starts with a prefix given by --tolerate-threads,
for a thread shown harmless to fork past; it initialised CUDA; or, where the caller sees GPUs (--cuda), torch now
marks forked children unable to initialise CUDA, asked of one throwaway child) is reported to the caller as
("unsafe", module, why, seconds it took) and the zygote exits without forking anything: the caller starts a new
one with that module in --after-fork, which every worker imports right after it is forked, before it says it is
ready. torch itself may be the one: with torch in --after-fork the zygote imports nothing, and its workers import
torch and every preload themselves. `python -m vdpcp.harness.forkcheck
MODULE...` says which import inside a module starts the thread and whether a child forked after it still runs
CUDA and gloo.

Over the SOCK_SEQPACKET socket FD, each message one pickle:
  caller -> zygote: ("fork", rank, log_path, stack_path) with the worker's end of a socketpair attached
  zygote -> caller: ("ready",) once, then ("forked", rank, pid) and ("exited", pid, exit_code); or, instead of
  ("ready",), ("unsafe", module, why, seconds) and its exit
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
import time
import warnings

from vdpcp import third_party
from vdpcp.harness import forkcheck, worker

MAX_MESSAGE = 1 << 16
ZYGOTE_CANARY_S = 30.0  # a child that only reads a flag and exits: milliseconds, unless the machine is starved


def main(argv: list[str]) -> None:
    zygote = Zygote(socket.socket(fileno=int(argv[0])), int(argv[1]), argv[2])
    signal.signal(signal.SIGTERM, zygote.leave)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; workers inherit this
    worker.die_with_parent(zygote.caller_pid, signal.SIGTERM if "--deathsig" in argv else None)  # no watch thread: we fork
    after_fork = tuple(filter(None, _option(argv, "--after-fork").split(",")))
    if "torch" not in after_fork:
        _preload(zygote.sock, _option(argv, "--preload"), _option(argv, "--tolerate-threads"), "--cuda" in argv)
    if forkcheck.thread_names():  # tolerated on purpose: Python's warning at every fork would only fill the log
        warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning)
    gc.freeze()  # keep the collector from dirtying shared pages in every worker
    zygote.send("ready")
    zygote.serve(after_fork)


def _preload(sock, preload: str, tolerate: str, cuda: bool) -> None:
    """Import torch and each preload in turn; at the first that leaves this process unsafe to fork, say why and exit."""
    tolerated = tuple(filter(None, tolerate.split(",")))
    for name in ("torch", *filter(None, preload.split(","))):
        started = time.perf_counter()
        _import(name)
        why = _unsafe_to_fork(tolerated, cuda)
        if why:  # the caller starts a zygote without it in the same folder; nothing was forked from this one
            with contextlib.suppress(ConnectionError):
                sock.send(pickle.dumps(("unsafe", name, why, time.perf_counter() - started)))
            os._exit(0)


class Zygote:
    """The forking loop: a worker per request from the caller, and word of each worker's exit back to it."""

    def __init__(self, sock, caller_pid: int, pool_dir: str):
        self.sock, self.caller_pid, self.pool_dir = sock, caller_pid, pool_dir
        self.workers: dict[int, int] = {}  # pidfd -> pid

    def leave(self, *_):
        # The workers first: one still running could write into POOL_DIR after rmtree listed it (its log, the
        # rendezvous store), and the directory would outlive everyone. Their PDEATHSIG would come only as we exit.
        for pid in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in self.workers.values():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        shutil.rmtree(self.pool_dir, ignore_errors=True)
        os._exit(0)

    def send(self, *message):
        try:
            self.sock.send(pickle.dumps(message))
        except ConnectionError:  # the caller is gone
            self.leave()

    def serve(self, after_fork: tuple[str, ...]) -> None:
        zygote_pid = os.getpid()
        while True:
            readable, _, _ = select.select([self.sock, *self.workers], [], [], 1.0)
            if os.getppid() != self.caller_pid:
                self.leave()
            for fd in readable:
                if fd is self.sock:
                    self._fork(zygote_pid, after_fork)
                else:
                    self._reap(fd)

    def _fork(self, zygote_pid: int, after_fork: tuple[str, ...]) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
        except ConnectionResetError:  # the caller died with a message of ours unread: closed all the same
            data = b""
        if not data:  # the caller closed its end
            self.leave()
        _, rank, log_path, stack_path = pickle.loads(data)
        pid = os.fork()
        if pid == 0:
            _become_worker(self.sock, self.workers, fds[0], rank, log_path, stack_path, zygote_pid, after_fork)
        os.close(fds[0])
        self.workers[os.pidfd_open(pid)] = pid
        self.send("forked", rank, pid)

    def _reap(self, fd: int) -> None:
        pid = self.workers.pop(fd)
        os.close(fd)
        _, status = os.waitpid(pid, 0)
        self.send("exited", pid, os.waitstatus_to_exitcode(status))


def _import(name: str) -> None:
    importlib.import_module(name)
    if name == "torch":  # what every worker inherits: one thread, and no notice from megatron's import of its builder
        import torch

        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        third_party.import_cpp_extension_quietly()


def _unsafe_to_fork(tolerated: tuple[str, ...], cuda: bool) -> str:
    """Why forking this process now would be unsafe, or "" if it is not."""
    others = sorted(name for name in forkcheck.thread_names().values() if not name.startswith(tolerated))
    if others:
        return f"it leaves {len(others)} thread(s) besides the main one ({', '.join(others)})"
    torch = sys.modules.get("torch")
    if torch is None:
        return ""
    if torch.cuda.is_initialized():  # a forked child cannot use a CUDA context its parent made
        return "it initialises CUDA"
    if cuda and _child_in_bad_fork():
        return ("a forked child can no longer initialise CUDA (torch marks it a bad fork: something counted devices "
                "through the CUDA runtime, e.g. torch.cuda.is_available(); with PYTORCH_NVML_BASED_CUDA_CHECK=1 that "
                "check asks NVML instead, which leaves forks usable)")
    return ""


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


def _become_worker(sock, workers: dict[int, int], fd: int, rank: int, log_path: str, stack_path: str, zygote_pid: int,
                   after_fork: tuple[str, ...]):
    """In the forked child: drop the zygote's descriptors, import what the zygote could not, and serve cases; never
    return to its loop."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sock.close()
        for pidfd in workers:
            os.close(pidfd)
        worker.serve(fd, rank, log_path, stack_path, zygote_pid, lambda: [_import(name) for name in after_fork])
        os._exit(0)
    except BaseException:  # noqa: BLE001 - whatever happens, this child must not run the zygote's loop
        import traceback

        traceback.print_exc()
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
