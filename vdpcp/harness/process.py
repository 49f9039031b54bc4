"""The caller's handles on its zygote and on each warm worker the zygote forks."""

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

import vdpcp
from vdpcp.harness import config
from vdpcp.harness.messages import READY, SET_UP, SETTING_UP, Task
from vdpcp.harness.outcome import DIED, RAISED, Outcome

_PACKAGE_ROOT = str(Path(vdpcp.__file__).resolve().parents[1])
# TORCHINDUCTOR_COMPILE_THREADS: torch 2.6's inductor, which megatron-core's parallel_state imports, warms a
# compile-worker pool at import time (a subprocess and a reader thread) when it may use more than one thread.
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
_HARNESS_DIR = str(Path(__file__).resolve().parent) + os.sep
ZYGOTE_REPLY_S = 30.0  # how long the zygote may take to fork or to report an exit: milliseconds, unless starved


class ZygoteGone(RuntimeError):
    """The zygote exited: its workers are gone too (they die with it) and the pool must start over."""


class UnsafeImport(RuntimeError):
    """The zygote found forking unsafe after importing ``module`` (``why``; the import took ``seconds``) and exited
    before forking anything: a zygote without that module can be started instead."""

    def __init__(self, module: str, why: str, seconds: float):
        super().__init__(f"importing {module} in the rank zygote: {why}")
        self.module, self.why, self.seconds = module, why, seconds


CUDA_DRIVER_THREAD = "cuda"  # the prefix of the CUDA driver's thread's OS name


def zygote_command(fd: int, directory: Path, preload: tuple[str, ...],
                   tolerate_threads: tuple[str, ...], after_fork: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """The zygote's command line and environment, given its end of the socket (fd) and the pool's folder: one
    place, so a test that starts a zygote by hand starts it as the pool does (on a GPU machine: --cuda and the
    CUDA driver's thread tolerated). ``after_fork``: what each worker imports itself once forked (torch among
    them: the zygote imports nothing)."""
    env = dict(os.environ, **_ONE_THREAD, VDPCP_HARNESS_WORKER="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
    # A preload that asks torch.cuda.is_available() at import (megatron-core does) then asks NVML, which torch
    # documents as fork-safe, not the CUDA runtime, whose fork handler would leave every later worker without CUDA.
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    argv = [sys.executable, "-m", "vdpcp.harness.zygote", str(fd), str(os.getpid()), str(directory)]
    if threading.current_thread() is threading.main_thread():
        argv.append("--deathsig")
    if preload:
        argv.append(f"--preload={','.join(preload)}")
    if after_fork:
        argv.append(f"--after-fork={','.join(after_fork)}")
    if config.cuda_device_count() > 0:
        # The NVML-based device count leaves the CUDA driver's own thread behind, which children forked past can
        # live with: so it is tolerated here, and the zygote proves each start's forks usable (--cuda).
        tolerate_threads = tuple(dict.fromkeys((*tolerate_threads, CUDA_DRIVER_THREAD)))
        argv.append("--cuda")
    if tolerate_threads:
        argv.append(f"--tolerate-threads={','.join(tolerate_threads)}")
    return argv, env


class Zygote:
    """The pool's forking server (see zygote.py); its output goes to DIR/zygote.log."""

    def __init__(self, directory: Path, preload: tuple[str, ...], startup_timeout: float,
                 tolerate_threads: tuple[str, ...] = (), after_fork: tuple[str, ...] = ()):
        """Raises UnsafeImport where a module of ``preload`` (or torch) would make forking unsafe."""
        self.log_path = directory / "zygote.log"
        self.preload, self.tolerate_threads = preload, tolerate_threads
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv, env = zygote_command(theirs.fileno(), directory, preload, tolerate_threads, after_fork)
        with open(self.log_path, "ab") as log, theirs:
            self.process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, env=env)
        self._sock = ours
        self._forked: dict[int, int] = {}  # rank -> pid, until fork() hands it out
        self._exit_codes: dict[int, int] = {}  # pid -> exit code (negative: killed by that signal)
        self._ready = False
        deadline = time.monotonic() + startup_timeout
        try:
            while not self._ready:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the rank zygote was not ready after {startup_timeout:g} s; its output:\n"
                                       f"{self.output()}")
                self._receive(deadline - time.monotonic())
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, rank: int, log_path: Path, stack_path: Path) -> tuple[int, Connection]:
        """Fork rank ``rank``'s worker; its pid and the caller's end of its socket."""
        ours, theirs = socket.socketpair()
        with theirs:
            try:
                socket.send_fds(self._sock, [pickle.dumps(("fork", rank, str(log_path), str(stack_path)))],
                                [theirs.fileno()])
            except OSError as err:
                raise ZygoteGone(self._obituary()) from err
        deadline = time.monotonic() + ZYGOTE_REPLY_S
        while rank not in self._forked:
            if time.monotonic() > deadline:
                raise ZygoteGone(f"the rank zygote did not fork rank {rank} within {ZYGOTE_REPLY_S:g} s")
            self._receive(deadline - time.monotonic())
        return self._forked.pop(rank), Connection(ours.detach())

    def exit_code(self, pid: int) -> int | None:
        """The exit code of a worker that has exited, once the zygote reaped it; None if it cannot say."""
        deadline = time.monotonic() + ZYGOTE_REPLY_S
        while pid not in self._exit_codes and time.monotonic() < deadline:
            try:
                self._receive(deadline - time.monotonic())
            except ZygoteGone:
                return None
        return self._exit_codes.pop(pid, None)

    def close(self) -> None:
        """Let it go (it exits when its socket closes); kill it if it lingers."""
        self._sock.close()
        try:
            self.process.wait(timeout=ZYGOTE_REPLY_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _receive(self, timeout: float) -> None:
        if not wait([self._sock], timeout=max(timeout, 0)):
            if not self.alive():
                raise ZygoteGone(self._obituary())
            return
        try:
            data = self._sock.recv(4096)
        except ConnectionResetError:  # it exited with a request of ours unread
            data = b""
        if not data:
            raise ZygoteGone(self._obituary())
        kind, *rest = pickle.loads(data)
        if kind == "ready":
            self._ready = True
        elif kind == "forked":
            self._forked[rest[0]] = rest[1]
        elif kind == "exited":
            self._exit_codes[rest[0]] = rest[1]
        elif kind == "unsafe":
            raise UnsafeImport(*rest)

    def _obituary(self) -> str:
        code = self.process.wait()
        return f"the rank zygote exited ({describe_exit(code)}); its output:\n{self.output()}"

    def output(self) -> str:
        """What it printed. A zygote sent SIGTERM removes its folder, log and all, on its way out."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return f"(not kept: {self.log_path.parent} is gone)"


class WorkerProcess:
    """Rank ``rank``'s worker. Its output goes to DIR/rank<r>.log, its stack dumps to DIR/rank<r>.stack."""

    def __init__(self, rank: int, zygote: Zygote, directory: Path):
        self.rank = rank
        self.log_path = directory / f"rank{rank}.log"
        self.stack_path = directory / f"rank{rank}.stack"
        self._log_offset = 0
        self._zygote = zygote
        self.pid, self.conn = zygote.fork(rank, self.log_path, self.stack_path)
        self.pidfd = os.pidfd_open(self.pid)  # readable once it exits; signals through it never hit a reused pid
        self.exit_code: int | None = None
        self._reaped = False

    def waitables(self) -> tuple:
        return self.conn, self.pidfd

    def send(self, case: Task) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(case))
        except OSError:
            pass  # it is dead; poll() reports how

    def poll(self) -> Outcome | bytes | None:
        """Its next message (an Outcome, READY, SETTING_UP or SET_UP), a DIED Outcome, or None while it works."""
        if self.conn.poll():
            try:
                data = self.conn.recv_bytes()
            except (EOFError, ConnectionResetError):  # reset: it died with a message of ours still unread
                return self._death()
            if data in (READY, SETTING_UP, SET_UP):
                return data
            try:
                return pickle.loads(data)
            except Exception as err:  # noqa: BLE001 - e.g. a value of a class only the rank can import
                return Outcome(self.rank, RAISED, summary=f"returned a value the caller cannot unpickle: {err!r}")
        if wait([self.pidfd], timeout=0):
            return self._death()
        return None

    def _death(self) -> Outcome:
        self.kill()  # it may have closed its socket yet live on
        self._reap()
        return Outcome(self.rank, DIED, summary=f"died: {describe_exit(self.exit_code)}", detail=self.read_stack())

    def request_stack(self) -> None:
        self._signal(signal.SIGUSR1)

    def read_stack(self) -> str:
        """What faulthandler wrote, less the harness's own frames (every rank has the same ones)."""
        try:
            dump = self.stack_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(line for line in dump.splitlines() if _HARNESS_DIR not in line and "<frozen runpy>" not in line)

    def take_output(self) -> str:
        """What it printed since the last call."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                data = log.read()
        except FileNotFoundError:
            return ""
        self._log_offset += len(data)
        return data.decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL, without waiting; reap() confirms."""
        self._signal(signal.SIGKILL)

    def reap(self) -> None:
        """Wait until it is gone and the zygote has reaped it, then drop our descriptors."""
        self._reap()
        self.conn.close()
        os.close(self.pidfd)

    def _reap(self) -> None:
        if not self._reaped:
            wait([self.pidfd], timeout=ZYGOTE_REPLY_S)
            self.exit_code = self._zygote.exit_code(self.pid)
            self._reaped = True

    def _signal(self, signum: int) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, signum)
        except ProcessLookupError:
            pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown: the zygote that reaps it did not report it"
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"
