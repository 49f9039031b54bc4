"""`vdpcp mutants`: run the matrix against each named mutant of the sharded path and report what killed it.

A mutant is a plausible bug applied by monkeypatching vdpcp's own modules inside the ranks (vdpcp.mutants).
Each is first run against its own kill set (a few named matrix cases, stopping at the first kill); one that
survives it is run against the whole matrix before it is called a survivor. Exit 0 when every mutant is
killed, 1 when any survives, 2 on bad input.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

from vdpcp.cli import UsageError, add_run_options


def register(subparsers) -> None:
    parser = subparsers.add_parser("mutants", help=__doc__.splitlines()[0].split(": ", 1)[1], description=__doc__)
    parser.add_argument("names", nargs="*", metavar="MUTANT", help="mutants to run (default: all)")
    parser.add_argument("--full", action="store_true",
                        help="search the whole matrix for every mutant, not its kill set first")
    add_run_options(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every mutant's result as JSON")
    parser.add_argument("--junit-xml", type=Path, metavar="PATH", help="write JUnit XML (one testcase per mutant)")
    parser.add_argument("--list", action="store_true", help="list the mutants with their bugs and kill sets, and exit")
    parser.set_defaults(func=main)


def main(args) -> int:
    from rich.console import Console
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from vdpcp import report, scenarios
    from vdpcp.harness.config import configure
    from vdpcp.mutants import MUTANTS, hunt
    from vdpcp.runner import preload_case_modules

    unknown = [n for n in args.names if n not in MUTANTS]
    if unknown:
        raise UsageError(f"unknown mutant(s) {unknown}; expected some of {sorted(MUTANTS)}")
    names = args.names or list(MUTANTS)
    if args.list:
        for name in names:
            print(f"{name}: {MUTANTS[name].bug}\n  kill set: {', '.join(MUTANTS[name].kills) or '(none)'}")
        return 0
    matrix = scenarios.matrix()
    by_id = {case.id: case for case in matrix}
    missing = {n: [k for k in MUTANTS[n].kills if k not in by_id] for n in names}
    missing = {n: ks for n, ks in missing.items() if ks}
    if missing:
        raise UsageError(f"kill sets name cases that are not in the matrix: {missing}")
    if args.backend is not None:
        configure(backend=args.backend)
    preload_case_modules()

    rows = []
    progress = Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True),
                        redirect_stdout=False, redirect_stderr=False, transient=True)
    with progress:
        task = progress.add_task("mutants", total=len(names))
        for name in names:
            started = time.monotonic()

            def show(case, verdict, name=name):
                progress.update(task, description=f"{name}: {case.id} {verdict}")

            with contextlib.redirect_stdout(io.StringIO()):  # the ranks' own output
                kill_set = [] if args.full else [by_id[k] for k in MUTANTS[name].kills]
                found = hunt(name, kill_set, timeout=args.timeout, on_case=show)
                if not found.killed:  # survived its kill set: the whole matrix decides
                    rest = [c for c in matrix if c.id not in found.tried]
                    more = hunt(name, rest, timeout=args.timeout, on_case=show)
                    more.tried = found.tried + more.tried
                    found = more
            rows.append(report.MutantRow(found, MUTANTS[name].bug, time.monotonic() - started))
            progress.advance(task)

    backend = args.backend or "auto"
    out = report.console()
    out.print(report.mutants_table(rows, backend))
    survived = [r.hunt.mutant for r in rows if not r.hunt.killed]
    out.print(f"{len(rows) - len(survived)} of {len(rows)} mutants killed" + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))
    if args.json:
        report.write_json(args.json, "mutants", [report.mutant_record(r) for r in rows], backend=backend)
    if args.junit_xml:
        report.write_junit(args.junit_xml, "vdpcp mutants", [report.mutant_junit(r) for r in rows])
    return 1 if survived else 0
