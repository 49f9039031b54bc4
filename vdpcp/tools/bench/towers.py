"""What a real-size case costs: per case, each rank's time, what it holds and its peak against vdpcp.matrix.budget's estimate.

Runs a selection of the matrix (default: every shipped subject at ``--tower real``, CP 2 and 4, bf16) as `vdpcp
check` does (vdpcp.matrix.runner.run_judged) and prints one line per case: its verdict and seconds, whether each rank's
model was built or reused (vdpcp.oracle.model_cache), and per rank what it held (the model, the unsharded arm's gradients
set aside, the rank-alone ones), its CUDA peak, and the peak vdpcp.matrix.budget estimated for it (ratio measured /
estimated). A case over this machine's memory (vdpcp.matrix.budget.check) is a "refused" line, and the
selection goes on. Then, per implementation and CP size, the median case's seconds and each phase's median seconds,
and the selection's wall time, against the targets a GPU runner's job is sized by (TARGETS). Exit 1 if any case did
not pass.
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import time
from pathlib import Path

from vdpcp.cli import (
    DTYPES,
    IMPL_HELP,
    RANKS,
    TOWER_HELP,
    add_budget_option,
    add_run_options,
    checked_impls,
    checked_tower,
)
from vdpcp.cli.exit_codes import Exit
from vdpcp.impls import CURRENT

GiB = 2**30


def add_arguments(parser) -> None:
    parser.add_argument("--impl", nargs="+", default=list(CURRENT), metavar="IMPL",
                        help=f"implementations (default: every shipped subject): {IMPL_HELP}")
    parser.add_argument("--cp", type=RANKS, nargs="+", default=[2, 4], metavar="N", help="CP sizes (default 2 4)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of every case (default bfloat16)")
    parser.add_argument("--tower", default="real", metavar="SIZE", help=TOWER_HELP + " (default here: real)")
    parser.add_argument("-k", "--match", metavar="TEXT", help="only cases whose id contains TEXT")
    add_run_options(parser)
    add_budget_option(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every case's figures as JSON")


def run(args) -> int:
    from vdpcp.feature.spec import SpecTooLarge
    from vdpcp.harness.config import configure, planned_backend
    from vdpcp.matrix import budget, scenarios
    from vdpcp.matrix.runner import preload_case_modules, run_judged

    impls = checked_impls(args.impl)
    tower = checked_tower(args.tower, impls)
    cases = scenarios.matrix(tuple(args.cp), impls=impls, tower=tower)
    cases = [c.with_(dtype=args.dtype) for c in cases if not args.match or args.match in c.id]
    cases, _ = scenarios.confirm_once(cases, lambda case: planned_backend(args.backend, case.world_size))
    if args.backend is not None:
        configure(backend=args.backend)  # for this call only: vdpcp.cli.main scopes it
    preload_case_modules(impls)
    rows, started = [], time.monotonic()
    for case in cases:
        begun = time.monotonic()
        try:  # run_judged sizes the case before any rank starts: one too large is a line, not the end
            with contextlib.redirect_stdout(io.StringIO()):
                judged = run_judged(case, timeout=args.timeout)
        except SpecTooLarge as err:
            row = refused(case, str(err))
        else:
            need = budget.need(case, device=budget.device_for(args.backend, case.world_size))
            row = record(case, judged, time.monotonic() - begun, need)
        rows.append(row)
        print(line(row), flush=True)
        if args.json:  # after every case: a job killed at its time limit leaves what it finished
            write(args.json, rows, time.monotonic() - started)
    wall = time.monotonic() - started
    for text in summary(rows, wall, args.dtype):
        print(text)
    if args.json:
        write(args.json, rows, wall)
    return Exit.PASSED if all(r["passing"] for r in rows) else Exit.FAILED


def write(path: Path, rows: list[dict], wall: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cases": rows, "wall_s": round(wall, 1)}, indent=1) + "\n")


def record(case, judged, seconds: float, need) -> dict:
    """One case's figures: verdict, time, and per rank what it held, its peak and the budget's estimate."""
    ranks = []
    for r in judged.result.ranks:
        estimate = need.ranks[r.cp_rank] if r.cp_rank < len(need.ranks) else 0
        peak = r.memory.get("peak")
        ranks.append({"rank": r.rank, "model": r.model, "turns": r.turns, "seconds": r.seconds, "held": r.memory,
                      "estimate": estimate, "ratio": round(peak / estimate, 3) if peak and estimate else None})
    failures = [f.splitlines()[0][:300] for f in judged.result.failures[:2]]
    return {"id": case.id, "impl": case.impl, "cp": case.cp, "world": case.world_size, "verdict": judged.verdict,
            "why": judged.why or (failures[0] if failures else ""), "failures": failures, "passing": judged.passing,
            "seconds": round(seconds, 2), "ranks": ranks}


def refused(case, why: str) -> dict:
    """A case the budget refuses on this machine (vdpcp.matrix.budget.check): not run, so no time and no ranks."""
    return {"id": case.id, "impl": case.impl, "cp": case.cp, "world": case.world_size, "verdict": "refused",
            "why": why, "failures": [], "passing": False, "seconds": 0.0, "ranks": []}


def line(row: dict) -> str:
    """The case, its verdict and time, and each rank's model, peak / estimate."""
    ranks = " ".join(f"r{r['rank']}:{r['model'][:1] or '-'}{'t' if r['turns'] else ''} "
                     f"{_gib(r['held'].get('peak'))}/{_gib(r['estimate'])}" for r in row["ranks"])
    shown = row["why"] if row["verdict"] == "refused" else row["why"][:200]  # a refusal ends with its override
    why = f"  {shown}" if row["why"] and not row["passing"] else ""
    spent = " ".join(f"{name} {s:.2f}" for name, s in _phases(row).items())
    return f"{row['id']}  {row['verdict']}  {row['seconds']:.2f} s  [{spent}]  {ranks}{why}"


# The real-size targets on one GPU: the median bf16 CP 2 case, the median float32 one, the whole bf16 selection.
TARGETS = {"bfloat16": " (target 1.5 s)", "float32": " (target 4 s)"}
SELECTION_TARGET = {"bfloat16": " (target for the bf16 selection, CP 2 and 4, on one GPU: 300 s)"}


def _phases(row: dict) -> dict[str, float]:
    """Rank 0's seconds per phase, and "outside": the case's wall time less them (starting the ranks' work, their
    results coming back, the verdict)."""
    phases = dict(row["ranks"][0]["seconds"]) if row["ranks"] else {}
    if phases:
        phases["outside"] = max(row["seconds"] - sum(phases.values()), 0.0)
    return phases


def summary(rows: list[dict], wall: float, dtype: str = "bfloat16") -> list[str]:
    """Per implementation and CP size the median case's seconds; the measured peaks against the estimates; the wall."""
    out, ran = [], [r for r in rows if r["verdict"] != "refused"]
    for impl in dict.fromkeys(r["impl"] for r in rows):
        for cp in sorted({r["cp"] for r in rows if r["impl"] == impl}):
            times = [r["seconds"] for r in ran if r["impl"] == impl and r["cp"] == cp and r["world"] == cp]
            if times:
                out.append(f"{impl} CP {cp}: median case {statistics.median(times):.2f} s over {len(times)} cases")
                out.append(f"{impl} CP {cp}: median seconds per phase, {_median_phases(ran, impl, cp)}")
        ratios = [rk["ratio"] for r in rows if r["impl"] == impl for rk in r["ranks"] if rk["ratio"]]
        if ratios:
            out.append(f"{impl}: each rank's CUDA peak / the budget's estimate {min(ratios):.2f} to {max(ratios):.2f}")
    for cp in sorted({r["cp"] for r in rows}):  # the figures: the median CP 2 case, the selection's wall
        times = [r["seconds"] for r in ran if r["cp"] == cp and r["world"] == cp]
        if times:
            out.append(f"every subject CP {cp}: median case {statistics.median(times):.2f} s over {len(times)} cases"
                       f"{TARGETS.get(dtype, '') if cp == 2 else ''}")
    passing, refusals = sum(r["passing"] for r in rows), len(rows) - len(ran)
    if refusals:
        out.append(f"{refusals} refused before they ran: over this machine's memory or compute limit (their lines "
                   f"say which, and the option that raises it)")
    out.append(f"{len(rows)} cases, {passing} passing, in {wall:.1f} s wall{SELECTION_TARGET.get(dtype, '')}")
    return out


def _median_phases(rows: list[dict], impl: str, cp: int) -> str:
    """Each phase's median seconds over that implementation's cases at that CP size (rank 0's clock)."""
    spent: dict[str, list[float]] = {}
    for r in rows:
        if r["impl"] == impl and r["cp"] == cp and r["world"] == cp:
            for name, s in _phases(r).items():
                spent.setdefault(name, []).append(s)
    return " ".join(f"{name} {statistics.median(s):.2f}" for name, s in spent.items())


def _gib(n) -> str:
    return "-" if not n else f"{n / GiB:.1f}G"
