"""Warm rank workers for one caller process, grown on demand, discarded at the first fault.

A zygote (zygote.py) imports torch once; each worker is forked from it in milliseconds. A case of
world size k runs on workers 0..k-1. Their process group is rebuilt only when the case's (world size,
backend) differs from the previous case's, or after a case some rank skipped (the ranks may have left
it at different collectives). A rank that raises, dies or hangs discards every worker: all are killed
and the next case forks fresh ones, so one broken case never leaks into the next.
"""

import os
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

from vdpcp.harness.outcome import DIED, FAULTS, HUNG, OK, Outcome
from vdpcp.harness.process import WorkerProcess, Zygote
from vdpcp.harness.protocol import READY, Case, GroupSpec

STARTUP_TIMEOUT_S = 120.0  # the zygote's torch import; forking a worker takes milliseconds
FAULT_GRACE_S = 3.0  # default: after one rank fails, how long the others get to finish before their stacks are taken
STACK_WAIT_S = 2.0
OUTPUT_TAIL_LINES = 30


class WorkerPool:
    def __init__(self):
        self._dir: Path | None = None
        self._zygote: Zygote | None = None
        self._workers: list[WorkerProcess] = []
        self._generation = 0
        self._group: GroupSpec | None = None

    def run(self, call: bytes, world_size: int, backend: str, timeout: float, preload: tuple[str, ...] = (),
            fault_grace: float = FAULT_GRACE_S) -> list[Outcome]:
        """Run the pickled ``call`` on ranks 0..world_size-1; one Outcome per rank, in rank order.

        ``preload``: the modules the zygote must have imported (see config.configure). ``fault_grace``:
        seconds the other ranks get to finish once one rank failed.
        """
        try:
            self._grow(world_size, preload)
            workers = self._workers[:world_size]
            spec = self._group_spec(world_size, backend)
            for w in workers:
                w.send(Case(w.rank, spec, call, list(sys.path), os.getcwd(), dict(os.environ)))
            outcomes = self._collect(workers, timeout, fault_grace)
            self._report_output(workers, outcomes)
        except BaseException:  # Ctrl-C, or a fault of the harness itself: leave no worker mid-case
            self.shutdown()
            raise
        if any(o.kind in FAULTS for o in outcomes):
            self._discard_workers()
        elif any(o.kind != OK for o in outcomes):
            self._group = None
        return outcomes

    def shutdown(self) -> None:
        """Kill every worker and the zygote; the next run starts from nothing."""
        self._discard_workers()
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _discard_workers(self) -> None:
        for w in self._workers:
            w.kill()
        for w in self._workers:
            w.reap()
        self._workers.clear()
        self._group = None

    def _grow(self, world_size: int, preload: tuple[str, ...]) -> None:
        if self._zygote is None or not self._zygote.alive() or self._zygote.preload != preload:
            self.shutdown()
            self._dir = Path(tempfile.mkdtemp(prefix="vdpcp-pool-"))
            self._zygote = Zygote(self._dir, preload, STARTUP_TIMEOUT_S)
        starting = []
        for rank in range(len(self._workers), world_size):
            starting.append(WorkerProcess(rank, self._zygote, self._dir))
            self._workers.append(starting[-1])  # at once: a Ctrl-C at the next fork must not leave this one unowned
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while starting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank workers {[w.rank for w in starting]} not ready after {STARTUP_TIMEOUT_S:g} s")
            wait([x for w in starting for x in w.waitables()], timeout=deadline - time.monotonic())
            for w in list(starting):
                message = w.poll()
                if isinstance(message, Outcome):
                    raise RuntimeError(f"rank {w.rank}'s worker failed to start ({message.summary}); "
                                       f"its output:\n{w.take_output()}")
                if message == READY:
                    starting.remove(w)

    def _group_spec(self, world_size: int, backend: str) -> GroupSpec:
        if self._group is None or (self._group.world_size, self._group.backend) != (world_size, backend):
            self._generation += 1
            store = self._dir / f"store-{self._generation}"
            self._group = GroupSpec(self._generation, world_size, backend, str(store))
        return self._group

    def _collect(self, workers: list[WorkerProcess], timeout: float, grace: float) -> list[Outcome]:
        """Wait for every rank's outcome; stop early once a rank failed and the others had their grace."""
        pending = {w.rank: w for w in workers}
        outcomes: dict[int, Outcome] = {}
        cutoff = deadline = time.monotonic() + timeout
        late = f"hung: still running at the {timeout:g} s timeout"
        while pending and time.monotonic() < cutoff:
            wait([x for w in pending.values() for x in w.waitables()], timeout=cutoff - time.monotonic())
            for rank, w in list(pending.items()):
                outcome = w.poll()
                if outcome is None:
                    continue
                outcomes[rank] = outcome
                del pending[rank]
                if outcome.kind in FAULTS and cutoff == deadline:
                    cutoff = min(deadline, time.monotonic() + grace)
                    late = f"hung: still running {grace:g} s after rank {rank} {outcome.summary}"
        for rank, stack in _stacks(list(pending.values())).items():
            outcomes[rank] = Outcome(rank, HUNG, summary=late, detail=stack)
        return [outcomes[w.rank] for w in workers]

    def _report_output(self, workers: list[WorkerProcess], outcomes: list[Outcome]) -> None:
        """Echo what each rank printed (pytest captures it per test); dead and hung ranks' last lines go in the report."""
        for w, outcome in zip(workers, outcomes):
            lines = w.take_output().splitlines()
            sys.stdout.write("".join(f"[rank {w.rank}] {line}\n" for line in lines))
            if outcome.kind in (DIED, HUNG) and lines:
                tail = "\n".join(lines[-OUTPUT_TAIL_LINES:])
                outcome.detail += f"\nlast {min(len(lines), OUTPUT_TAIL_LINES)} lines it printed:\n{tail}"


def _stacks(workers: list[WorkerProcess]) -> dict[int, str]:
    """Every worker's Python stack, through faulthandler's SIGUSR1 dump."""
    for w in workers:
        w.request_stack()
    deadline = time.monotonic() + STACK_WAIT_S
    sizes = None
    while workers and time.monotonic() < deadline:
        time.sleep(0.05)
        now = [len(w.read_stack()) for w in workers]
        if all(now) and now == sizes:
            break
        sizes = now
    return {w.rank: w.read_stack() or "(no stack: it did not answer SIGUSR1)" for w in workers}

