"""The caller's handle on one warm worker process: start it, talk to it, read its files, kill it."""

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import vdpcp
from vdpcp.harness.outcome import DIED, RAISED, Outcome
from vdpcp.harness.protocol import READY, Case

_PACKAGE_ROOT = str(Path(vdpcp.__file__).resolve().parents[1])
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class WorkerProcess:
    """Rank ``rank``'s worker. Its output goes to DIR/rank<r>.log, its stack dumps to DIR/rank<r>.stack."""

    def __init__(self, rank: int, directory: Path):
        self.rank = rank
        self.log_path = directory / f"rank{rank}.log"
        self.stack_path = directory / f"rank{rank}.stack"
        self._log_offset = 0
        ours, theirs = socket.socketpair()
        env = dict(os.environ, **_ONE_THREAD, VDPCP_HARNESS_WORKER="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
        argv = [sys.executable, "-m", "vdpcp.harness.worker", str(theirs.fileno()), str(os.getpid()), str(self.stack_path)]
        if threading.current_thread() is threading.main_thread():
            argv.append("--deathsig")
        with open(self.log_path, "ab") as log, theirs:
            self.process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, env=env)
        self.conn = Connection(ours.detach())
        self.pidfd = os.pidfd_open(self.process.pid)  # readable once it exits, whoever holds its socket

    @property
    def pid(self) -> int:
        return self.process.pid

    def waitables(self) -> tuple:
        return self.conn, self.pidfd

    def send(self, case: Case) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(case))
        except OSError:
            pass  # it is dead; poll() reports how

    def poll_ready(self) -> Outcome | bool:
        """True once it said READY, False while still starting, the DIED outcome if it failed to start."""
        message = self.poll()
        return message if isinstance(message, Outcome) else message == READY

    def poll(self) -> Outcome | bytes | None:
        """The worker's next message (an Outcome, or raw READY), a DIED Outcome, or None while it works."""
        if self.conn.poll():
            try:
                data = self.conn.recv_bytes()
            except EOFError:
                return self._death()
            if data == READY:
                return data
            try:
                return pickle.loads(data)
            except Exception as err:  # noqa: BLE001 - e.g. a value of a class only the rank can import
                return Outcome(self.rank, RAISED, summary=f"returned a value the caller cannot unpickle: {err!r}")
        if self.process.poll() is not None:
            return self._death()
        return None

    def _death(self) -> Outcome:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its socket yet lives on: treat it as gone
            self.process.kill()
            code = self.process.wait()
        if code < 0:
            try:
                summary = f"died: killed by signal {signal.Signals(-code).name}"
            except ValueError:
                summary = f"died: killed by signal {-code}"
        else:
            summary = f"died: exited with code {code}"
        return Outcome(self.rank, DIED, summary=summary, detail=self.read_stack())

    def request_stack(self) -> None:
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass

    def read_stack(self) -> str:
        try:
            return self.stack_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def take_output(self) -> str:
        """What it printed since the last call."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            data = log.read()
        self._log_offset += len(data)
        return data.decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL without waiting; reap() collects it."""
        if self.process.poll() is None:
            self.process.kill()

    def reap(self) -> None:
        self.process.wait()
        self.conn.close()
        os.close(self.pidfd)
