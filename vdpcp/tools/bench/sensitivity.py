"""How small a bug each check catches: planted perturbations of a chosen size, bisected per subject and dtype.

For each implementation and dtype (at ``--tower``), one sharded case of the matrix (the first whose id contains
``-k``; plain: no DP, TP, zigzag or known limit) runs with each sized mutant (vdpcp.tools.mutants.sized: the last CP
rank's features x (1 + eps), the gradient it hands back x (1 + eps), one token + eps x its norm, one image's tokens
x (1 + eps)) over a grid of sizes, and prints, per check, the smallest size on the grid that check caught:
``exact`` (the regrouped reference, vdpcp.oracle.compare.regrouped), ``outputs``, ``input grads`` and ``param grads`` (the
whole-microbatch checks, within the dtype's tolerance). Each check's threshold is bisected on the grid, assuming a
check that catches a size catches every larger one; "-" is a check that caught none of the grid. The issue's
target (at the real size, bf16 and float32): every subject's case fails at 1e-3 for a rank's features and its
gradient. Exit 1 if a correct run (no mutant) of a chosen case did not pass.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from vdpcp.cli import DTYPES, IMPL_HELP, RANKS, TOWER_HELP, add_run_options, checked_impls, checked_tower, number
from vdpcp.cli.exit_codes import Exit
from vdpcp.impls import CURRENT

GRID = tuple(10.0**-k for k in range(12, 0, -1))  # 1e-12 .. 1e-1, ascending
CHECKS = ("exact", "outputs", "input grads", "param grads")


def add_arguments(parser) -> None:
    from vdpcp.tools.mutants import SIZED

    parser.add_argument("--impl", nargs="+", default=list(CURRENT), metavar="IMPL",
                        help=f"implementations (default: every shipped subject): {IMPL_HELP}")
    parser.add_argument("--cp", type=RANKS, default=2, metavar="N", help="CP size (default 2)")
    parser.add_argument("--dtype", choices=DTYPES, nargs="+", default=["float64"], help="dtypes (default float64)")
    parser.add_argument("--tower", default="toy", metavar="SIZE", help=TOWER_HELP)
    parser.add_argument("-k", "--match", default="", metavar="TEXT",
                        help="the case: the first sharded one (more images than ranks) whose id contains TEXT")
    parser.add_argument("--mutant", nargs="+", default=list(SIZED), choices=list(SIZED), metavar="NAME",
                        help=f"sized mutants (default all): {', '.join(SIZED)}")
    parser.add_argument("--grid", nargs="+", type=number(float, 0, 1, above=True), metavar="EPS",
                        help="the sizes to bisect over (default 1e-12 .. 1e-1, each power of ten); fewer sizes, fewer "
                             "runs: on a GPU at the real size, '--grid 1e-9 1e-3' asks only whether each check "
                             "catches the issue's target (1e-3) and the exact check's bitwise floor")
    add_run_options(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every threshold and run as JSON")


def run(args) -> int:
    from vdpcp.cli import UsageError
    from vdpcp.harness.config import configure
    from vdpcp.matrix.runner import preload_case_modules

    impls = checked_impls(args.impl)
    tower = checked_tower(args.tower, impls)
    if args.backend is not None:
        configure(backend=args.backend)  # for this call only: vdpcp.cli.main scopes it
    preload_case_modules(impls)
    grid = tuple(sorted(set(args.grid))) if args.grid else GRID
    cases = {(impl, dtype): chosen(impl, args.cp, tower, args.match, dtype, args.backend)
             for impl in impls for dtype in args.dtype}
    if not any(cases.values()):  # a -k that matches nothing is a typo, not a subject without a case
        raise UsageError(f"-k {args.match}: no plain sharded case of {', '.join(impls)} at CP {args.cp} ({tower} "
                         f"tower) that the implementation shards has it in its id")
    rows, ok, started = [], True, time.monotonic()
    for impl in impls:
        for dtype in args.dtype:
            case = cases[impl, dtype]
            if case is None:  # e.g. automodel-shipped on a case its released thresholds replicate: nothing sharded
                print(f"{impl} {dtype} {tower} CP {args.cp}: no plain case it shards has {args.match!r} in its id: "
                      f"no threshold measured", flush=True)
                continue
            clean = case_verdict(case, args.timeout)
            ok &= clean[0] == "pass"
            # What the exact check could hold on the rank the mutants perturb: its gradients only where the backward
            # repeats itself bit for bit (vdpcp.oracle.compare.regrouped), so an "exact -" for a gradient bug reads with it.
            print(f"{impl} {dtype} {tower} CP {args.cp}: unperturbed {clean[0]}; the last rank's exact check held "
                  f"{clean[2]}", flush=True)
            if clean[0] != "pass":  # a check that fails unperturbed would "catch" every size: no threshold to state
                print(f"{impl} {dtype} {tower} CP {args.cp}: the unperturbed case {case.id} is {clean[0]} "
                      f"({', '.join(sorted(clean[1])) or 'no check named'}): no threshold measured", flush=True)
                continue
            for name in args.mutant:
                row = bisect(case, name, args.timeout, grid)
                row.update(clean=clean[0], held=clean[2])
                rows.append(row)
                print(line(row), flush=True)
                if args.json:
                    write(args.json, rows, time.monotonic() - started, grid)
    print(f"{len(rows)} thresholds in {time.monotonic() - started:.1f} s; the grid {_grid(grid)}")
    if args.json:
        write(args.json, rows, time.monotonic() - started, grid)
    return Exit.PASSED if ok else Exit.FAILED


def chosen(impl: str, cp: int, tower: str, match: str, dtype: str, backend):
    """The first plain sharded case of ``impl`` at CP ``cp`` with more images than ranks whose id contains
    ``match``, in ``dtype``, that its own policy does not replicate (there no rank holds sharded features to
    perturb): one with gradients, else (where a known limit stops the backward, MCore's gather on gloo with unequal
    token counts) its outputs-only case."""
    from vdpcp.harness.config import planned_backend
    from vdpcp.impls import resolve
    from vdpcp.matrix import scenarios
    from vdpcp.matrix.expectations import known_limit

    policy = resolve(impl)
    plain = [c.with_(dtype=dtype) for c in scenarios.matrix((cp,), impls=(impl,), tower=tower)
             if c.dp == c.tp == 1 and c.loss == "rank" and c.vision_dp_over_cp and c.config_cp is None
             and len(c.spec.images) > cp and match in c.id and policy.replicated(c.spec, c.config) is None]
    runnable = [c for c in plain if known_limit(c, planned_backend(backend, c.world_size)) is None]
    return next((c for c in runnable if c.grads), next(iter(runnable), None))


def bisect(case, name: str, timeout, grid: tuple[float, ...] = GRID) -> dict:
    """Per check, the smallest size on ``grid`` (ascending) it caught (a check that catches a size catches every
    larger one)."""
    runs: dict[int, tuple[str, set[str], str, int | None]] = {}

    def caught(i: int) -> tuple[str, set[str], str, int | None]:
        if i not in runs:
            runs[i] = case_verdict(case.with_(mutant=f"{name}@{grid[i]:g}"), timeout)
        return runs[i]

    top = caught(len(grid) - 1)
    smallest: dict[str, float | None] = {}
    for check in CHECKS:
        if check not in top[1]:
            smallest[check] = None
            continue
        lo, hi = -1, len(grid) - 1  # grid[hi] caught; grid[lo] not (or below the grid)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if check in caught(mid)[1] else (mid, hi)
        smallest[check] = grid[hi]
    return {"impl": case.impl, "dtype": case.dtype, "tower": case.tower, "cp": case.cp, "case": case.id,
            "mutant": name, "top": top[0], "largest": grid[-1], "smallest": smallest,
            "runs": {f"{grid[i]:g}": sorted(run[1]) for i, run in sorted(runs.items())},
            "planted": {f"{grid[i]:g}": run[3] for i, run in sorted(runs.items())}}


def case_verdict(case, timeout) -> tuple[str, set[str], str, int | None]:
    """The case's verdict, the checks that failed in it, what the exact check held on its last rank (and whether
    that rank's backward was deterministic), and how many elements the mutant moved (None: no rank said)."""
    import contextlib
    import io

    from vdpcp.matrix.runner import run_case

    with contextlib.redirect_stdout(io.StringIO()):
        result = run_case(case, timeout=timeout)
    last = max(result.ranks, key=lambda r: r.cp_rank, default=None)
    held = f"{last.exact or 'nothing'} (deterministic: {last.deterministic or '-'})" if last else "nothing (no rank ran)"
    counts = [r.planted for r in result.ranks if r.planted is not None]
    return result.verdict, {check_of(f) for f in result.failures} & set(CHECKS), held, sum(counts) if counts else None


def check_of(failure: str) -> str:
    """Which check a failure line is from: "rank N: <check>: ..." (the oracle's wording)."""
    text = failure.split(": ", 1)[1] if failure.startswith("rank ") else failure
    if text.startswith("exact (regrouped)"):
        return "exact"
    return next((c for c in CHECKS[1:] if text.startswith(c)), "other")


def line(row: dict) -> str:
    found = "  ".join(f"{check} {_size(row['smallest'][check])}" for check in CHECKS)
    note = "" if row["top"] in ("fail", "pass") else f"  ({row['top']} at {row['largest']:g}: does not apply?)"
    return f"{row['impl']} {row['dtype']} {row['tower']} CP {row['cp']}  {row['mutant']}:  {found}{note}{_moved(row)}"


def _moved(row: dict) -> str:
    """How many elements the instrument moved at each size run: where none moved, nothing was planted and nothing
    could be caught; where a few did, a threshold just above says how many moved (and whether a later rounding kept
    them), not how small a bug a check catches."""
    counts = [f"{size} {moved:,}" for size, moved in row.get("planted", {}).items() if moved is not None]
    return f"  (elements moved: {', '.join(counts)})" if counts else ""


def _size(size) -> str:
    return "-" if size is None else f"{size:g}"


def _grid(grid) -> str:
    return " ".join(f"{size:g}" for size in grid) if len(grid) < 5 else f"{grid[0]:g} .. {grid[-1]:g}"


def write(path: Path, rows: list[dict], wall: float, grid: tuple[float, ...]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"grid": list(grid), "rows": rows, "wall_s": round(wall, 1)}, indent=1) + "\n")
