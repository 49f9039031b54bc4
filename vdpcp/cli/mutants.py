"""`vdpcp mutants`: run the matrix against each named mutant and report which case killed it.

A mutant is a plausible bug (vdpcp.tools.mutants): for the reference, monkeypatches of vdpcp's own sharded path;
for any implementation (--impl), wrappers at the interface (features wrong on one rank, a rank's gradient
dropped, a replicated loss, a rank's tower outside autograd), which show how much the matrix sees of YOUR
code. Each is first run against its kill set (a few named cases, stopping at the first kill); one that
survives it is run against the implementation's whole matrix before it is called a survivor.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

from vdpcp.cli import (
    DTYPES,
    IMPL_HELP,
    TOWER_HELP,
    UsageError,
    add_budget_option,
    add_run_options,
    checked_impls,
    checked_tower,
)
from vdpcp.cli.exit_codes import Exit, epilog
from vdpcp.matrix.progress import add_maxfail_options


def register(subparsers) -> None:
    parser = subparsers.add_parser("mutants", help=__doc__.splitlines()[0].split(": ", 1)[1], description=__doc__,
                                   epilog=epilog("mutants"))
    parser.add_argument("names", nargs="*", metavar="MUTANT", help="mutants to run (default: every one that applies)")
    parser.add_argument("--impl", default="reference", metavar="IMPL",
                        help=f"implementation to mutate (default: reference, which also has vdpcp's own named mutants): {IMPL_HELP}")
    parser.add_argument("--full", action="store_true",
                        help="search the whole matrix for every mutant, not its kill set first")
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of every case (default float64)")
    parser.add_argument("--tower", default="toy", metavar="SIZE", help=TOWER_HELP)
    add_run_options(parser)
    add_budget_option(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every mutant's result as JSON")
    parser.add_argument("--junit-xml", type=Path, metavar="PATH", help="write JUnit XML (one testcase per mutant)")
    parser.add_argument("--list", action="store_true", help="list the mutants with their bugs and kill sets, and exit")
    add_maxfail_options(parser, "mutants that survive")
    parser.set_defaults(func=main)


def main(args) -> int:
    from vdpcp.harness.config import configure
    from vdpcp.impls import BUILT_INS
    from vdpcp.matrix import progress, report, scenarios
    from vdpcp.matrix.runner import preload_case_modules
    from vdpcp.tools.mutants import MUTANTS

    impl = checked_impls([args.impl])[0]
    applicable = [n for n, m in MUTANTS.items() if m.generic or impl == "reference"]
    unknown = [n for n in args.names if n not in applicable]
    if unknown:
        raise UsageError(f"unknown mutant(s) {unknown} for --impl {impl}; expected some of {sorted(applicable)}")
    names = args.names or applicable
    if args.list:
        for name in names:
            print(f"{name}: {MUTANTS[name].bug}\n  kill set: {', '.join(MUTANTS[name].kills) or '(none)'}")
        return Exit.PASSED
    # vdpcp's own named mutants patch its plan, which MCore's cases are checked against too: the reference's
    # hunt runs the built-ins' matrix; another implementation's, its own.
    tower = checked_tower(args.tower, BUILT_INS if impl == "reference" else (impl,))
    matrix = scenarios.matrix(impls=BUILT_INS if impl == "reference" else (impl,), tower=tower)
    kill_sets = {name: [c.with_(dtype=args.dtype) for c in kill_set(MUTANTS[name].kills, matrix, impl, tower)]
                 for name in names}
    matrix = [c.with_(dtype=args.dtype) for c in matrix]
    if args.backend is not None:
        configure(backend=args.backend)  # for this call only: vdpcp.cli.main scopes it
    preload_case_modules([impl])
    backend = args.backend or "auto"
    rows = []

    def write_reports(state: dict) -> None:  # after every mutant: a killed job leaves what it finished
        if args.json:
            report.write_json(args.json, "mutants", [report.mutant_record(r) for r in rows], backend=backend, impl=impl,
                              finished=len(rows), **state)
        if args.junit_xml:
            report.write_junit(args.junit_xml, "vdpcp mutants", [report.mutant_junit(r) for r in rows])

    with progress.Run("mutants", len(names), args.maxfail, write_reports, noun="mutants",
                      failing="mutant(s) that survived") as run:
        for name in names:
            started = time.monotonic()

            def show(case, judged, seconds, name=name):  # every case a mutant meets: a line of its own
                run.start(f"{name}: {case.id} {judged.verdict}")
                run.say(progress.line(progress.Finished.of(case.id, judged, seconds), f"{run.position()}  {name}:"))

            found = _hunt(name, [] if args.full else kill_sets[name], matrix, args.timeout, show)
            rows.append(report.MutantRow(found, MUTANTS[name].bug, time.monotonic() - started))
            outcome = (f"killed by {found.killed_by}" if found.killed
                       else "does not apply" if found.not_applicable else "SURVIVED")
            if run.finish(None, found.killed, f"{name}  {outcome} ({len(found.tried)} case(s), {rows[-1].seconds:.2f} s)"):
                break

    return run.exit_code(_summary(rows, impl, backend, run.summary()))


def _hunt(name: str, kill_set: list, matrix: list, timeout, show):
    """Hunt ``name`` on its kill set; a survivor of it is hunted on the rest of the matrix before it is called one."""
    from vdpcp.tools.mutants.hunt import hunt

    with contextlib.redirect_stdout(io.StringIO()):  # the ranks' own output
        found = hunt(name, kill_set, timeout=timeout, on_case=show)
        if found.survived:
            rest = [c for c in matrix if c.id not in found.tried]
            more = hunt(name, rest, timeout=timeout, on_case=show)
            more.tried = found.tried + more.tried
            found = more
    return found


def _summary(rows: list, impl: str, backend: str, ran: str) -> bool:
    """Print the table and the one-line score; whether every mutant that applies was killed."""
    from vdpcp.matrix import report

    out = report.console()
    out.print(report.mutants_table(rows, backend))
    survived = [r.hunt.mutant for r in rows if r.hunt.survived]
    moot = [r.hunt.mutant for r in rows if r.hunt.not_applicable]
    out.print(f"{len(rows) - len(survived) - len(moot)} of {len(rows) - len(moot)} mutants of {impl} killed"
              + (f" ({len(moot)} do not apply: {', '.join(moot)})" if moot else "")
              + (f"; SURVIVED: {', '.join(survived)}" if survived else "") + ran)
    return not survived


def kill_set(kills, matrix, impl: str, tower: str = "toy") -> list:
    """The mutant's kill set in ``impl``'s matrix: the same rows (scenario, CP, layout, loss), count split; at another
    tower size, the rows that play their parts there (vdpcp.matrix.scenarios.stand_in), those it has."""
    from vdpcp.matrix.scenarios import matrix as full_matrix
    from vdpcp.matrix.scenarios import stand_in

    by_id = {case.id: case for case in matrix}
    kills = list(dict.fromkeys(stand_in(k, tower) for k in kills))
    if impl == "reference":
        missing = [k for k in kills if k not in by_id]
        if missing and tower == "toy":
            raise UsageError(f"kill set names cases that are not in the matrix: {missing}")
        return _with_outputs([by_id[k] for k in kills if k in by_id], by_id)
    from vdpcp.impls import resolve

    reference = {case.id: case for case in full_matrix(impls=("reference",), tower=tower)}
    split = resolve(impl).splits[0]  # the kill set's rows in the implementation's own first partition
    wanted = [reference[k].with_(impl=impl, split=split) for k in kills if k in reference]
    return _with_outputs([by_id[c.id] for c in wanted if c.id in by_id], by_id)


def _with_outputs(cases: list, by_id: dict) -> list:
    """Each case followed by its outputs-only twin where the matrix has one: where a known limit stops the backward
    (a strict xfail whose failure hides what else went wrong), the twin still checks everything before it."""
    out = []
    for case in cases:
        twin = case.with_(grads=False).id
        out += [case] + ([by_id[twin]] if case.grads and twin in by_id and by_id[twin] not in cases else [])
    return out
