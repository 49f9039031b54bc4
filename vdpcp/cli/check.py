"""`vdpcp check`: run the correctness matrix (or part of it) and report every case.

Each case runs the sharded encoder on CP ranks and compares it with the unsharded one: outputs on every
rank, each rank's input grads for its own images, and parameter grads (summed over ranks, and each rank's
own), and what each rank's tower really read (did it shard, as its plan says?). Known upstream limits are strict
xfails (see vdpcp.matrix.scenarios). Its exit code tells a wrong result from work that was right but not
distributed, unevenly distributed, or written into the gradient it was handed: CI stops on each, and a script can
tell them apart.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from vdpcp.cli import (
    DTYPES,
    IMPL_HELP,
    LOSSES,
    RANKS,
    SPLITS,
    TOWER_HELP,
    UsageError,
    add_budget_option,
    add_run_options,
    checked_impls,
    checked_splits,
    checked_tower,
)
from vdpcp.cli.exit_codes import Exit, epilog
from vdpcp.matrix.progress import add_maxfail_options


def register(subparsers) -> None:
    parser = subparsers.add_parser("check", help=__doc__.splitlines()[0].split(": ", 1)[1], description=__doc__,
                                   epilog=epilog("check"))
    parser.add_argument("--cp", type=RANKS, nargs="+", metavar="N", help="CP sizes to run (default: 1 2 4 8)")
    parser.add_argument("--impl", nargs="+", metavar="IMPL",
                        help=f"implementations under test (default: reference and mcore, each where it can run here): {IMPL_HELP}")
    parser.add_argument("--split", nargs="+", metavar="SPLIT",
                        help="partitions to run, as the implementations name them (default: every one each has; the "
                             f"reference's: {', '.join(SPLITS)})")
    parser.add_argument("--loss", nargs="+", choices=LOSSES, help="loss modes (default: both; zigzag on its subset)")
    parser.add_argument("--spec", type=Path, action="append", metavar="FILE|DIR",
                        help="run these spec files (or every *.json under a folder) instead of the matrix's scenarios")
    parser.add_argument("-k", "--match", metavar="TEXT", help="only cases whose id contains TEXT")
    parser.add_argument("--dtype", choices=DTYPES, default="float64",
                        help="dtype of every case (default float64; bf16 gradients compare as vectors, see vdpcp.matrix.case)")
    parser.add_argument("--tower", default="toy", metavar="SIZE", help=TOWER_HELP)
    parser.add_argument("--mutant", metavar="NAME", help="apply a named mutant (vdpcp.tools.mutants) to every case: see what kills it")
    add_run_options(parser)
    add_budget_option(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every case's result as JSON")
    parser.add_argument("--junit-xml", type=Path, metavar="PATH", help="write JUnit XML (one testcase per case)")
    parser.add_argument("--list", action="store_true", help="list the selected case ids and exit")
    add_maxfail_options(parser)
    parser.set_defaults(func=main)


def select(args) -> tuple[list, list]:
    """The cases the options ask for, in the matrix's order, and the scenario table they come from;
    UsageError on bad input, an empty selection or a case over the spec limit (sized before any runs)."""
    from vdpcp.feature.spec import SpecError
    from vdpcp.matrix import budget, scenarios
    from vdpcp.matrix.case import Case

    cps = tuple(args.cp or scenarios.CP_SIZES)
    from vdpcp.impls import defaults

    if args.impl:
        impls = checked_impls(args.impl)
    else:
        impls, left_out = defaults()
        for line in left_out:
            print(f"left out: {line}", file=sys.stderr)
    filters = {"impls": impls, "splits": checked_splits(args.split, impls), "losses": tuple(args.loss or LOSSES),
               "tower": checked_tower(args.tower, impls)}
    try:
        if args.spec:
            table = []
            for path in args.spec:
                rows = scenarios.spec_scenarios(path, cps)
                for row, cp, impl in ((r, cp, i) for r in rows for cp in r.cps for i in filters["impls"]):
                    # before the matrix plans every split, which for a huge spec is slow in itself
                    budget.check(Case(row.spec, cp, impl, dtype=args.dtype, tower=args.tower),
                                 path if path.is_file() else f"{path} ({row.spec.name})",
                                 budget.device_for(args.backend, cp))
                table += rows
        else:
            table = scenarios.scenarios(tower=args.tower)
        cases = scenarios.matrix(cps, table=table, special=not args.spec, **filters)
    except SpecError as err:
        raise UsageError(str(err)) from None
    if args.match:
        cases = [c for c in cases if args.match in c.id]
    if args.dtype != "float64":
        cases = [c.with_(dtype=args.dtype) for c in cases]
    if args.mutant:
        from vdpcp.tools.mutants import MUTANTS, known

        try:
            if not known(args.mutant):
                raise UsageError(f"--mutant {args.mutant}: unknown mutant; expected one of {sorted(MUTANTS)} or "
                                 f"a sized one, NAME@SIZE")
        except ValueError as err:
            raise UsageError(f"--mutant {err}") from None
        cases = [c.with_(mutant=args.mutant) for c in cases]
    if not cases:
        raise UsageError("no case matches the options (--cp, --impl, --split, --loss, --match)")
    try:
        for case in cases if not args.list else ():  # a list runs nothing, so sizes nothing
            budget.check(case, case.id, budget.device_for(args.backend, case.world_size))
    except SpecError as err:
        raise UsageError(str(err)) from None
    return cases, table


def main(args) -> int:
    from vdpcp.harness import BackendUnavailable, deferred_imports
    from vdpcp.harness.config import configure, planned_backend, resolve_backend
    from vdpcp.matrix import progress, report, scenarios
    from vdpcp.matrix.expectations import PASSING
    from vdpcp.matrix.runner import preload_case_modules, run_judged

    cases, table = select(args)
    cases, left_out = scenarios.confirm_once(cases, lambda case: planned_backend(args.backend, case.world_size))
    if args.list:
        print("\n".join(case.id for case in cases))
        return Exit.PASSED
    if args.backend is not None:
        configure(backend=args.backend)  # for this call only: vdpcp.cli.main scopes it
    preload_case_modules({case.impl for case in cases})
    try:
        for size in {c.world_size for c in cases}:
            resolve_backend(None, size)
    except BackendUnavailable as err:
        raise UsageError(f"--backend {args.backend}: {err}") from None
    rows = []

    def write_reports(state: dict) -> None:  # after every case: a killed job leaves what it finished
        if args.json:
            report.write_json(args.json, "check", [report.check_record(r) for r in rows], backend=_label(rows),
                              finished=len(rows), left_out=[asdict(group) for group in left_out],
                              harness=deferred_imports(), **state)
        if args.junit_xml:
            report.write_junit(args.junit_xml, "vdpcp check", [report.check_junit(r) for r in rows])

    with progress.Run("check", len(cases), args.maxfail, write_reports) as run:
        for case in cases:
            run.start(case.id)
            printed = io.StringIO()
            started = time.monotonic()
            with contextlib.redirect_stdout(printed):  # the ranks' own output: kept for cases that do not pass
                judged = run_judged(case, timeout=args.timeout)
            rows.append(report.CheckRow(scenarios.family_of(case, table), judged.verdict, judged.why, judged.result,
                                        time.monotonic() - started, "" if judged.passing else printed.getvalue()))
            if run.finish(progress.Finished.of(case.id, judged, rows[-1].seconds), judged.passing):
                break

    out = report.console()
    out.print(report.check_table(rows, _label(rows)))
    out.print(report.check_summary(rows) + run.summary())
    for group in left_out:
        out.print(group.line())
    for note, n in Counter(row.result.collectives for row in rows if row.result.collectives).items():
        out.print(f"{n} case(s) ran with {note}")
    for line in deferred_imports():
        out.print(line, markup=False, highlight=False)
    if run.stopped or run.signal_code is not None:
        return run.exit_code(all(r.verdict in PASSING for r in rows))
    return exit_code([r.verdict for r in rows])


def _label(rows) -> str:
    return "/".join(sorted({row.result.backend for row in rows}))


# The verdicts that exit with a code of their own, the most telling first; every other one that does not pass exits 1.
OWN_EXIT = {"grad-written": Exit.GRAD_WRITTEN, "not-sharded": Exit.NOT_SHARDED, "unbalanced": Exit.UNBALANCED}


def exit_code(verdicts) -> Exit:
    """PASSED when every verdict passes; FAILED when any other exits so; else the code of the first of OWN_EXIT
    among them (vdpcp.cli.exit_codes says what each means)."""
    from vdpcp.matrix.expectations import PASSING

    rest = {v for v in verdicts if v not in PASSING}
    if not rest:
        return Exit.PASSED
    if rest <= set(OWN_EXIT):
        return next(code for verdict, code in OWN_EXIT.items() if verdict in rest)
    return Exit.FAILED
