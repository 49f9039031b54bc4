"""Warm rank workers for one caller process, grown on demand, discarded at the first unsound fault.

A zygote (zygote.py) imports torch once; each worker is forked from it in milliseconds. A case of
world size k runs on workers 0..k-1. Their process group is kept while cases pass, rebuilt when the
case's (world size, backend) differs from the previous case's. A rank that dies or hangs discards every
worker: all are killed and the next case forks fresh ones, so one broken case never leaks into the
next. A case in which every rank returned but some raised or skipped (they may have left it at
different collectives) keeps its workers only if a short check finds its process groups sound, and
rebuilds their group (soundness.py): a fresh worker would pay again for every import its cases make.

A preload after which forking would be unsafe (it starts a thread, say) is never forked past and never fatal: the
zygote names it and exits, and the pool starts one without it, so each worker imports that module itself after
the fork (torch too, where torch is the one). The verdicts are the same; the cost, that import at each worker's
start, is said once on stderr and kept in ``deferred`` for the reports.
"""

import os
import pickle
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

from vdpcp.harness import soundness
from vdpcp.harness.errors import RankFailure
from vdpcp.harness.messages import READY, SET_UP, SETTING_UP, GroupSpec, Task
from vdpcp.harness.outcome import DIED, FAULTS, HUNG, OK, RAISED, Outcome
from vdpcp.harness.process import UnsafeImport, WorkerProcess, Zygote, ZygoteGone, describe_exit

STARTUP_TIMEOUT_S = 120.0  # the zygote's torch import; forking a worker takes milliseconds
FAULT_GRACE_S = 3.0  # default: after one rank fails, the least time the others get to finish before their stacks are taken
STACK_WAIT_S = 2.0
# faulthandler writes a dump at once from its signal handler: two equal sizes this far apart say it is whole. Every
# known-limit case (a rank raises, the rest wait in a collective) waits for two polls.
STACK_POLL_S = 0.02
SOUNDNESS_TIMEOUT_S = 5.0  # each step of the check after a raise: milliseconds, unless a group is stuck
OUTPUT_TAIL_LINES = 30


@dataclass(frozen=True)
class Deferred:
    """A preload the zygote could not fork past, which every rank worker imports after the fork instead."""

    module: str
    why: str
    seconds: float  # what its import took in the zygote: what each worker's start now costs more

    @property
    def line(self) -> str:
        return (f"vdpcp harness: importing {self.module} makes forking unsafe ({self.why}), so rank workers import "
                f"it themselves after the fork: about {self.seconds:.1f} s more at each worker's start, verdicts unchanged")


class WorkerPool:
    def __init__(self):
        self.deferred: dict[tuple[str, tuple[str, ...]], Deferred] = {}  # (module, tolerated threads) -> why
        self._dir: Path | None = None
        self._zygote: Zygote | None = None
        self._requested: tuple[str, ...] = ()  # the preload asked for, of which the zygote holds what it could
        self._workers: list[WorkerProcess] = []
        self._generation = 0
        self._group: GroupSpec | None = None
        self.recovery = ""  # after a faulted case: whether its workers were kept or re-forked, and why

    def run(self, call: bytes, world_size: int, backend: str, timeout: float, preload: tuple[str, ...] = (),
            fault_grace: float = FAULT_GRACE_S, reuse_after_raise: bool = True,
            tolerate_threads: tuple[str, ...] = ()) -> list[Outcome]:
        """Run the pickled ``call`` on ranks 0..world_size-1; one Outcome per rank, in rank order.

        ``preload``: the modules the zygote must have imported (see config.configure). ``fault_grace``:
        seconds the other ranks get to finish once one rank failed, or as long as it had run if that is longer.
        ``reuse_after_raise``: keep the workers of a case whose ranks only raised (none died or hung) when its
        process groups check sound; False re-forks them after every fault. ``tolerate_threads``: OS thread-name
        prefixes the zygote accepts after its preload (see config.configure).
        """
        try:
            self._grow(world_size, preload, tolerate_threads)
            workers = self._workers[:world_size]
            spec = self._group_spec(world_size, backend)
            outcomes = self._run_on(workers, spec, call, timeout, fault_grace)
            if any(o.kind in FAULTS for o in outcomes):
                self._fail_if_zygote_gone(world_size)
            self._report_output(workers, outcomes)
            self.recovery = self._recover(workers, spec, {o.kind for o in outcomes}, reuse_after_raise)
        except BaseException:  # Ctrl-C, or a fault of the harness itself: leave no worker mid-case
            self.shutdown()
            raise
        return outcomes

    def _recover(self, workers: list[WorkerProcess], spec: GroupSpec, kinds: set[str], reuse_after_raise: bool) -> str:
        """Make the pool fit for the next case after one that ended in ``kinds``; what was done, unless all passed."""
        if kinds == {OK}:
            return ""
        if kinds & {DIED, HUNG}:
            unsound = "a rank died or hung"
        elif RAISED in kinds and not reuse_after_raise:
            unsound = "reuse after a raise is off"
        else:  # raised, skipped or xfailed, and returned: the ranks may stand at different collectives
            unsound = self._unsound(workers, spec)
        if unsound:
            self._discard_workers()
            return f"re-forked: {unsound}"
        return "kept: every rank returned and its process groups checked sound"

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

    def _grow(self, world_size: int, preload: tuple[str, ...], tolerate_threads: tuple[str, ...]) -> None:
        if (self._zygote is None or not self._zygote.alive()
                or (self._requested, self._zygote.tolerate_threads) != (preload, tolerate_threads)):
            self.shutdown()
            self._dir = Path(tempfile.mkdtemp(prefix="vdpcp-pool-"))
            self._zygote, self._requested = self._start_zygote(preload, tolerate_threads), preload
        starting = []
        try:
            for rank in range(len(self._workers), world_size):
                starting.append(WorkerProcess(rank, self._zygote, self._dir))
                self._workers.append(starting[-1])  # at once: a Ctrl-C at the next fork must not leave this one unowned
        except ZygoteGone:
            self._fail_if_zygote_gone(world_size)
            raise  # alive, but it did not answer
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while starting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank workers {[w.rank for w in starting]} not ready after {STARTUP_TIMEOUT_S:g} s")
            wait([x for w in starting for x in w.waitables()], timeout=deadline - time.monotonic())
            for w in list(starting):
                message = w.poll()
                if isinstance(message, Outcome):
                    self._fail_if_zygote_gone(world_size)
                    raise RuntimeError(f"rank {w.rank}'s worker failed to start ({message.summary}); "
                                       f"its output:\n{w.take_output()}")
                if message == READY:
                    starting.remove(w)

    def _start_zygote(self, preload: tuple[str, ...], tolerate_threads: tuple[str, ...]) -> Zygote:
        """A zygote with every module of ``preload`` it can fork past; each one it cannot is deferred, once."""
        while True:
            after_fork = tuple(name for name in ("torch", *preload) if (name, tolerate_threads) in self.deferred)
            if "torch" in after_fork:  # every preload imports torch: the zygote imports nothing
                after_fork = tuple(dict.fromkeys(("torch", *preload)))
            kept = tuple(name for name in preload if name not in after_fork)
            try:
                return Zygote(self._dir, kept, STARTUP_TIMEOUT_S, tolerate_threads, after_fork)
            except UnsafeImport as unsafe:
                if unsafe.module in after_fork:  # cannot happen: the zygote never imports those
                    raise
                deferred = self.deferred[unsafe.module, tolerate_threads] = Deferred(unsafe.module, unsafe.why,
                                                                                     unsafe.seconds)
                print(deferred.line, file=sys.stderr, flush=True)

    def _fail_if_zygote_gone(self, world_size: int) -> None:
        """Raise the case's RankFailure, in one line, when the zygote exited under it (killed, or sent SIGTERM, as
        `timeout` sends its whole process group): every worker died with it. run() then shuts the pool down, so
        the next case starts a new zygote."""
        if self._zygote.alive():
            return
        line = (f"the rank zygote is gone ({describe_exit(self._zygote.process.wait())}), and every rank with it; "
                f"the next case starts a new one")
        raise RankFailure(line, dict.fromkeys(range(world_size), line))

    def _group_spec(self, world_size: int, backend: str) -> GroupSpec:
        if self._group is None or (self._group.world_size, self._group.backend) != (world_size, backend):
            self._generation += 1
            store = self._dir / f"store-{self._generation}"
            self._group = GroupSpec(self._generation, world_size, backend, str(store))
        return self._group

    def _run_on(self, workers: list[WorkerProcess], spec: GroupSpec, call: bytes, timeout: float, grace: float,
                stacks: bool = True) -> list[Outcome]:
        for w in workers:
            w.send(Task(w.rank, spec, call, list(sys.path), os.getcwd(), dict(os.environ)))
        return self._collect(workers, timeout, grace, stacks)

    def _unsound(self, workers: list[WorkerProcess], spec: GroupSpec) -> str | None:
        """Why these workers' process groups may not carry the next case, or None if they are sound (soundness.py).

        The echo runs in a rebuilt world group: destroying the old groups waits for any op still in flight in
        them (mismatched async ops on all ranks leave equal counts, which the census cannot tell), so that wait
        falls inside this check's short timeout instead of the next case's long one.
        """
        census = self._run_on(workers, spec, pickle.dumps((soundness.census, (), {})), SOUNDNESS_TIMEOUT_S, 0.0, False)
        unsound = soundness.census_verdict(census)
        if unsound is None:
            self._group = None
            fresh = self._group_spec(len(workers), spec.backend)
            nonce = secrets.randbits(62)  # fresh each time: a stale all_gather cannot pass for this one
            echo = self._run_on(workers, fresh, pickle.dumps((soundness.echo, (nonce,), {})), SOUNDNESS_TIMEOUT_S, 0.0, False)
            unsound = soundness.echo_verdict(echo, nonce)
        for w in workers:
            w.take_output()  # what the check printed is no case's output
        return unsound

    def _collect(self, workers: list[WorkerProcess], timeout: float, grace: float, stacks: bool = True) -> list[Outcome]:
        """Wait for every rank's outcome; stop early once a rank failed and the others had their grace.

        The grace is at least as long as the failed rank had run: a peer merely behind it reaches the same point in
        about that time, and a peer stuck on the failed one costs at most that long again. A peer still in a
        stretch its case marked as set-up (worker.setting_up: building its model, creating its CUDA context) is
        behind whatever its grace: it gets its grace from when that stretch ends (peers with their model cached
        can raise long before the ones still building theirs are done).
        """
        pending = {w.rank: w for w in workers}
        outcomes: dict[int, Outcome] = {}
        setting_up: set[int] = set()
        started = time.monotonic()
        cutoff = deadline = started + timeout
        fault = None  # (when, the grace given, what failed)
        while pending and time.monotonic() < (limit := deadline if setting_up else cutoff):
            wait([x for w in pending.values() for x in w.waitables()], timeout=limit - time.monotonic())
            for rank, w in list(pending.items()):
                outcome = w.poll()
                while outcome in (SETTING_UP, SET_UP):
                    if outcome == SETTING_UP:
                        setting_up.add(rank)
                    else:
                        setting_up.discard(rank)
                        if fault:
                            cutoff = min(deadline, max(cutoff, time.monotonic() + fault[1]))
                    outcome = w.poll()
                if outcome is None:
                    continue
                outcomes[rank] = outcome
                del pending[rank]
                setting_up.discard(rank)
                if outcome.kind in FAULTS and fault is None:
                    now = time.monotonic()
                    fault = (now, max(grace, now - started), f"rank {rank} {outcome.summary}")
                    cutoff = min(deadline, now + fault[1])
        late = f"hung: still running at the {timeout:g} s timeout"
        if fault and time.monotonic() < deadline:
            waited = f"{cutoff - fault[0]:.1f}".removesuffix(".0")
            late = f"hung: still running {waited} s after {fault[2]}"
        late_stacks = _stacks(list(pending.values())) if stacks else {rank: "" for rank in pending}
        for rank, stack in late_stacks.items():
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
        time.sleep(STACK_POLL_S)
        now = [len(w.read_stack()) for w in workers]
        if all(now) and now == sizes:
            break
        sizes = now
    return {w.rank: w.read_stack() or "(no stack: it did not answer SIGUSR1)" for w in workers}

