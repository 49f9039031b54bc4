"""Progress a CI log can read, and reports that a killed job still leaves behind.

On a terminal (stderr), rich's progress bar, as before. Off one (a CI log: stdout is a file or a pipe), one line
per case as it ends, flushed at once, so a job that times out shows where it was:

    [  3/104]  three-images-cp2-reference-count  pass  0.41 s  gloo/cpu
    [  4/104]  empty-cp2-mcore-count  xfail  0.31 s  gloo  mcore-empty-microbatch: MCore 0.19.2 pads an empty ...
    [  5/104]  three-images-cp2-qwen2_5_vl-count  error  9.02 s  gloo  rank 0 raised ImportError: cannot import ...

that is: position, case id, verdict, seconds, where it ran (backend/device) and, for any verdict but pass, the
first reason the judge or the report gave. The verdicts are whatever vdpcp.matrix.expectations.judge says; nothing
here lists them.

The JSON and JUnit reports are rewritten after every finished case, each atomically (a temporary file in the
same folder, then a rename), so a job killed at any point, even by SIGKILL, leaves both parseable, holding
every case it finished. A JSON report says how far it got: ``selected``, ``finished``, ``complete`` and, when
the run stopped early, ``stopped`` (``--maxfail``, SIGTERM or SIGINT). SIGTERM, as `timeout` and CI runners
send it, is turned into an orderly stop while cases run (ranks torn down, a last line saying so, exit 143).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from vdpcp.usage import number

REASON_WIDTH = 300  # a traceback's first line, an xfail's reason: enough to act on, one log line


@dataclass(frozen=True)
class Finished:
    """One case as it ended: what its line says."""

    id: str
    verdict: str
    seconds: float
    where: str  # "backend/device", as the ranks reported them
    why: str = ""  # the first reason for a verdict that is not "pass"; empty for a pass

    @classmethod
    def of(cls, case_id: str, judged, seconds: float) -> Finished:
        """From a vdpcp.matrix.runner.Judged: its verdict, and its why or else the result's first failure."""
        return cls(case_id, judged.verdict, seconds, where(judged.result),
                   "" if judged.verdict == "pass" else (judged.why or first_failure(judged.result)))


def where(result) -> str:
    """The backend and device(s) a vdpcp.matrix.runner.CaseResult ran on, e.g. "gloo/cpu" or "nccl/cuda:0,cuda:1"; the
    backend alone where no rank reported (the case raised)."""
    backend = result.backend or "?"
    return backend if result.device == "-" else f"{backend}/{result.device}"


def first_failure(result) -> str:
    return next((line for text in result.failures for line in text.splitlines() if line.strip()), "")


def line(done: Finished, position: str = "") -> str:
    """``[  4/104]  id  verdict  0.81 s  backend/device  why``: one case, one log line."""
    parts = [position] if position else []
    parts += [done.id, done.verdict, f"{done.seconds:.2f} s", done.where]
    if done.why:
        parts.append(_one_line(done.why))
    return "  ".join(parts)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= REASON_WIDTH else text[: REASON_WIDTH - 1] + "…"


class CaseProgress:
    """Shows a run of ``total`` cases: the bar while stderr is a terminal, a line per case while stdout is not
    (or when there is no bar). Use as a context manager; ``start`` a case, ``finish`` it, ``say`` a note."""

    def __init__(self, title: str, total: int, out=None, err=None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.out = out or sys.stdout  # taken now: the ranks' output is redirected while a case runs
        self.total, self.done = total, 0
        console = Console(file=err or sys.stderr)
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             console=console, redirect_stdout=False, redirect_stderr=False, transient=True,
                             disable=not console.is_terminal)
        self.lines = not _isatty(self.out) or self._bar.disable
        self._task = self._bar.add_task(title, total=total)

    def __enter__(self) -> CaseProgress:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc)

    def start(self, description: str) -> None:
        self._bar.update(self._task, description=description)

    def update(self, **fields) -> None:
        """The bar's own fields (description, completed, total), for a run that is not one case after another."""
        self._bar.update(self._task, **fields)

    def position(self, index: int | None = None) -> str:
        """"[  4/104]": the index-th of the run (default: the one running now)."""
        index = self.done + 1 if index is None else index
        return f"[{index:>{len(str(self.total))}}/{self.total}]"

    def finish(self, done: Finished | None = None, text: str = "") -> None:
        """One more of ``total`` ended: its line (``done``'s, or ``text``), and the bar one step on."""
        position = self.position()
        self.done += 1  # counted before it is printed: a stop right after the line must not count one too few
        self.say(line(done, position) if done is not None else f"{position}  {text}")
        self._bar.advance(self._task)

    def say(self, text: str) -> None:
        """A line for the log, now (not on a terminal, where the table and summary follow)."""
        if self.lines:
            print(text, file=self.out, flush=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class MaxFail:
    """pytest's -x / --maxfail N: stop once N cases did not pass; 0 (the default) never stops."""

    def __init__(self, limit: int):
        self.limit, self.failed = limit, 0

    def count(self, passing: bool) -> bool:
        """Count one finished case; True when the run must stop here."""
        self.failed += not passing
        return bool(self.limit) and self.failed >= self.limit

    def reason(self, what: str = "case(s) that did not pass") -> str:
        return f"--maxfail {self.limit}: stopped after {self.failed} {what}"


def add_maxfail_options(parser, what: str = "cases that do not pass") -> None:
    parser.add_argument("--maxfail", type=number(int, 0, note="0: no limit"), default=0, metavar="N",
                        help=f"stop after N {what} (default 0: never)")
    parser.add_argument("-x", "--exitfirst", dest="maxfail", action="store_const", const=1,
                        help="stop at the first of them (--maxfail 1)")


class Run:
    """One run of a subcommand as a CI log reads it: CaseProgress, --maxfail, the reports rewritten after every
    finished case (``write(state)``: the caller writes every record it has, with run_state's fields), and
    SIGTERM or Ctrl-C turned into a stop that says where it was. The caller's loop breaks when ``finish`` says
    so; afterwards ``stopped`` says why it ended early (None: it ran everything), ``exit_code`` what to return.

        with progress.Run("check", len(cases), args.maxfail, write_reports) as run:
            for case in cases:
                ...
                if run.finish(progress.Finished.of(case.id, judged, seconds), judged.passing):
                    break
    """

    def __init__(self, title: str, total: int, maxfail: int, write=None, noun: str = "cases",
                 failing: str = "case(s) that did not pass", out=None, err=None):
        self.maxfail = MaxFail(maxfail)
        self.total, self.noun, self.failing, self.write = total, noun, failing, write
        self.shown = CaseProgress(title, total, out=out, err=err)
        self.stopped: str | None = None
        self.signal_code: int | None = None
        self._sigterm = stop_on_sigterm()

    def __enter__(self) -> Run:
        self.save(final=False)  # an unwritable path fails now, before any case ran
        self.shown.__enter__()
        self._sigterm.__enter__()
        return self

    def __exit__(self, kind, err, tb):
        self._sigterm.__exit__(None, None, None)
        self.shown.__exit__(None, None, None)
        stopping = kind is not None and issubclass(kind, KeyboardInterrupt)
        if stopping:  # the harness has torn the ranks down on its way out
            self.stopped, self.signal_code = stop_reason(err)
        if self.stopped:
            self.shown.say(f"{self.stopped}; {self.shown.done} of {self.total} {self.noun} ran")
        if kind is None or stopping:
            self.save(final=True)
        return stopping

    def start(self, description: str) -> None:
        self.shown.start(description)

    def say(self, text: str) -> None:
        self.shown.say(text)

    def position(self) -> str:
        return self.shown.position()

    def finish(self, done: Finished | None, passing: bool, text: str = "") -> bool:
        """One more ended (its record already where ``write`` finds it): written, its line printed, counted;
        True when --maxfail says the run stops here."""
        self.save(final=False)
        self.shown.finish(done, text)
        if self.maxfail.count(passing) and self.shown.done < self.total:
            self.stopped = self.maxfail.reason(self.failing)
        return self.stopped is not None

    def save(self, final: bool) -> None:
        if self.write is not None:
            self.write(run_state(self.total, self.stopped, final))

    def summary(self) -> str:
        """What to add to the closing summary line: nothing, or why the run ended early."""
        return f" ({self.stopped}: {self.total - self.shown.done} of {self.total} {self.noun} not run)" if self.stopped else ""

    def exit_code(self, all_passed: bool) -> int:
        """128 + the signal that stopped the run; else 0 only when everything ran and passed."""
        if self.signal_code is not None:
            return self.signal_code
        return 0 if all_passed and not self.stopped else 1


# --- reports that survive the job ---------------------------------------------------------------------


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a reader (or a job killed meanwhile) sees the old file or
    the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same folder: the rename stays on one file system
    try:
        with open(tmp, "w") as f:  # the usual permissions (umask), as a plain write would give
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def run_state(selected: int, stopped: str | None, final: bool) -> dict:
    """What a report says about the run that wrote it, so a partial one is never taken for a whole one (the
    caller adds ``finished``: how many records it holds)."""
    state = {"selected": selected, "complete": final and not stopped}
    return {**state, "stopped": stopped} if stopped else state


class Stopped(KeyboardInterrupt):
    """The run was asked to stop by a signal; a KeyboardInterrupt, so every Ctrl-C path (the harness tears
    down its ranks) handles it the same."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's code for a death by this signal


@contextlib.contextmanager
def stop_on_sigterm():
    """While the block runs, SIGTERM raises Stopped, as Ctrl-C raises KeyboardInterrupt; the handler is put
    back after it. A SIGTERM the caller ignores stays ignored; off the main thread (no handlers there) nothing
    changes."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_reason(err: KeyboardInterrupt) -> tuple[str, int]:
    """(what stopped the run, the exit code) for a Stopped or a plain Ctrl-C."""
    signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
    return f"stopped by {signal.Signals(signum).name}", 128 + signum
