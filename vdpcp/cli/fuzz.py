"""`vdpcp fuzz --cp N`: search random microbatches for a sharding failure, shrink it, save it, print its replay.

Draws --budget microbatches (seeded: the same --seed runs the same search) and runs each sharded against
unsharded on warm workers. The first failure is shrunk to the smallest spec that fails the same way,
written to --out as <configuration>-cp<N>.json (a saved case: it carries its CP size, flags and failure
signature), and its `vdpcp replay` command printed. Failures an earlier search of the same
configuration saved in --out are replayed first. Nothing found: the count of microbatches run.
--no-even-pad and --mutant expose known failure modes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from vdpcp.cli import POSITIVE, RANKS, SEED, checked_impls, checked_splits
from vdpcp.cli.exit_codes import Exit, epilog
from vdpcp.cli.replay import add_case_arguments, check_mutant

DEFAULT_OUT = Path("fuzz-out")


def register(subparsers) -> None:
    parser = subparsers.add_parser("fuzz", help="search random microbatches for a sharding failure and shrink it",
                                   description=__doc__, epilog=epilog("fuzz"))
    parser.add_argument("--cp", type=RANKS, required=True, help="CP ranks")
    parser.add_argument("--budget", type=POSITIVE, default=None,
                        help="microbatches to draw before giving up; shrinking runs come on top (default: 100)")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the search (default 0)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for the shrunk spec (default {DEFAULT_OUT})")
    add_case_arguments(parser)
    parser.set_defaults(func=main)


def main(args) -> int:
    from vdpcp.tools.fuzz import DEFAULT_BUDGET, Search, fuzz

    budget = DEFAULT_BUDGET if args.budget is None else args.budget
    from vdpcp.impls import resolve
    from vdpcp.matrix.runner import preload_case_modules

    check_mutant(args.mutant)
    impl = checked_impls([args.impl or "reference"])[0]
    split = (checked_splits([args.split] if args.split else None, [impl]) or resolve(impl).splits)[0]
    preload_case_modules([impl])
    search = Search(args.cp, budget, args.seed, impl=impl, split=split, dtype=args.dtype or "float64",
                    even_pad=args.even_pad is not False, mutant=args.mutant, backend=args.backend, timeout=args.timeout)
    start = time.monotonic()
    with _Progress(search) as progress:
        report = fuzz(search, args.out, on_run=progress.update)
    print(_summary(report, time.monotonic() - start))
    return Exit.FAILED if report.finding else Exit.PASSED


def _summary(report, seconds: float) -> str:
    search = report.search
    head = f"fuzz cp={search.cp} {search.tag} seed={search.seed}"
    counts = f"{report.passed} passed, {report.unsharded_errors} rejected by the unsharded encoder too"
    if report.resource_failures:
        counts += f", {report.resource_failures} out of memory on some rank"
    finding = report.finding
    if finding is None:
        return f"{head}: no failure in {report.drawn} microbatches ({counts}) in {seconds:.1f} s"
    if finding.from_saved:
        return "\n".join([f"{head}: the failure saved in {finding.path} still fails: {finding.signature}",
                          f"({report.replayed} saved failure(s) replayed first, no search run; {seconds:.1f} s)",
                          f"replay: vdpcp replay {finding.path}"])
    spec = finding.spec
    lines = [
        f"{head}: failure after {report.drawn} microbatches: {finding.signature}",
        f"shrunk in {report.shrink_runs} runs to {len(spec.media_frames)} media item(s), {len(spec.images)} row(s): "
        + _spec_text(spec, name=False),
        f"{report.runs} runs ({counts}) in {seconds:.1f} s",
    ]
    if not finding.reproduced:
        lines.append("warning: this spec did not fail the same way when run again (flaky)")
    lines += [f"also failed while shrinking, differently: {sig} on {_spec_text(s)}"
              for sig, s in report.other_failures.items()]
    lines += [f"wrote {finding.path}", f"replay: vdpcp replay {finding.path}"]
    return "\n".join(lines)


def _spec_text(spec, name: bool = True) -> str:
    """A spec as JSON when short; a long one by its counts and size ranges (vdpcp.feature.spec.summary)."""
    from vdpcp.feature.spec import SHORT_ROWS, summary

    if len(spec.images) > SHORT_ROWS:
        return summary(spec)
    return json.dumps({k: v for k, v in spec.to_dict().items() if name or k != "name"})


class _Progress:
    """Every microbatch run, as it ends: a rich progress line on stderr while it is a terminal (drawn, then
    shrinking runs), a log line on stdout while that is not (vdpcp.matrix.progress)."""

    def __init__(self, search):
        from vdpcp.matrix.progress import CaseProgress

        self._budget = search.budget
        self._shown = CaseProgress(f"fuzz cp={search.cp} {search.tag}: drawing", search.budget)
        self._last = time.monotonic()

    def __enter__(self):
        self._shown.__enter__()
        self._last = time.monotonic()
        return self

    def __exit__(self, *exc):
        return self._shown.__exit__(*exc)

    def update(self, report, spec, result) -> None:
        from vdpcp.matrix.progress import Finished, first_failure, line, where

        now, seconds = time.monotonic(), time.monotonic() - self._last
        self._last = now
        if report.shrink_runs:
            position = f"[shrink {report.shrink_runs}]"
            self._shown.update(description=f"shrinking ({report.shrink_runs} runs)", completed=report.drawn)
        else:
            position = f"[replay {report.replayed}]" if report.replayed == report.drawn else f"[{report.drawn}/{self._budget}]"
            self._shown.update(completed=report.drawn)
        why = "" if result.verdict == "pass" else first_failure(result)
        self._shown.say(line(Finished(_drawn_text(spec), result.verdict, seconds, where(result), why), position))


def _drawn_text(spec) -> str:
    """A drawn microbatch in one short line: its shapes and seed (every drawn case has the same id); a long one
    by its counts and size ranges."""
    from vdpcp.feature.spec import SHORT_ROWS, summary

    if len(spec.images) > SHORT_ROWS:
        return summary(spec)
    fields = {k: v for k, v in spec.to_dict().items() if k != "name" and v is not None}
    return " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in fields.items())
