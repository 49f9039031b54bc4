"""The figures of scripts/mutation.sh, from cosmic-ray's session files (sqlite; read directly, one query each).

    mutation_score.py pending SESSION              mutants not run yet
    mutation_score.py shard SESSION W WORKERS      leave this session worker W's mutants only (1-based)
    mutation_score.py retry NEW OLD...             NEW: the OLD shards merged, their survivors pending again
    mutation_score.py report [--target 90] [--seconds S] [--equivalent FILE] [--source-root DIR] SESSION...

Sessions of several runs may be reported together (e.g. one module re-run after a fix, the rest from the full
run): each is read against the copy of the checkout beside it.

A killed mutant made the tests fail (a timeout counts, and so does an "incompetent" one, whose tests could
not even run); a survivor did not. A survivor listed in the equivalent
file ("module|operator|mutated line", the line as the mutant writes it, stripped, as docs/mutation.md argues it), or one whose operator
stands in a type annotation under ``from __future__ import annotations`` (never evaluated), is equivalent and
leaves the score; the score is killed / (run - equivalent). Exit 1 below the target, or with mutants left unrun.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

RUN = "select s.module_path, s.operator_name, s.start_pos_row, r.test_outcome, r.diff, s.start_pos_col, s.job_id " \
      "from mutation_specs s " \
      "join work_results r on r.job_id = s.job_id where r.worker_outcome != 'SKIPPED'"
PENDING = "select count(*) from work_items w where not exists (select 1 from work_results r where r.job_id = w.job_id)"


def pending(session: str) -> int:
    return sqlite3.connect(session).execute(PENDING).fetchone()[0]


def shard(session: str, worker: int, workers: int) -> None:
    """Mark every mutant that is not worker ``worker``'s (the i-th pending job goes to worker i mod workers) as
    skipped, as cosmic-ray's own filters do, so that this copy of the session runs that worker's share only."""
    db = sqlite3.connect(session)
    jobs = [job for (job,) in db.execute("select w.job_id from work_items w join mutation_specs s on s.job_id = w.job_id "
                                         "where not exists (select 1 from work_results r where r.job_id = w.job_id) "
                                         "order by s.start_pos_row, s.start_pos_col, s.operator_name, s.occurrence")]
    others = [job for i, job in enumerate(jobs) if i % workers != worker - 1]
    db.executemany("insert into work_results (worker_outcome, output, test_outcome, diff, job_id) "
                   "values ('SKIPPED', 'another worker''s shard', NULL, NULL, ?)", [(job,) for job in others])
    db.commit()


def retry(new: str, old: list[str], survivors_only: bool = False) -> None:
    """One session from a run's shards: every result kept but the survivors', which are run again (and, with
    ``survivors_only``, the mutants that run never reached are left unrun: skipped as 'deferred')."""
    import shutil

    shutil.copy(old[0], new)
    db = sqlite3.connect(new)
    db.execute("delete from work_results")
    for shard_ in old:
        for row in sqlite3.connect(shard_).execute("select worker_outcome, output, test_outcome, diff, job_id "
                                                   "from work_results where worker_outcome != 'SKIPPED' "
                                                   "or output != 'another worker''s shard'"):
            db.execute("insert or replace into work_results values (?, ?, ?, ?, ?)", row)
    db.execute("delete from work_results where lower(test_outcome) = 'survived' or output = 'deferred'")
    if survivors_only:
        ran = {job for (job,) in db.execute("select job_id from work_results")}
        survived = {row[4] for shard_ in old for row in sqlite3.connect(shard_).execute(
            "select * from work_results where lower(test_outcome) = 'survived'")}
        never = [(job,) for (job,) in db.execute("select job_id from work_items") if job not in ran | survived]
        db.executemany("insert into work_results values ('SKIPPED', 'deferred', NULL, NULL, ?)", never)
    db.commit()


def equivalents(path: Path | None) -> set[tuple[str, str, str]]:
    if path is None or not path.exists():
        return set()
    found = set()
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            module, operator, source = line.split("|", 2)
            found.add((module.strip(), operator.strip(), source.strip()))
    return found


def report(sessions: list[str], target: float, seconds: float | None, equivalent: set, root: Path | None) -> int:
    totals = dict(run=0, killed=0, equivalent=0, unexplained=0, pending=0)
    by_module: dict[str, dict] = {}
    unexplained = []
    deferred: set[str] = set()
    seen: set[str] = set()  # a retried session's shards each hold the earlier run's results: count a job once
    for session in sessions:
        tree = root or Path(session).parent / "tree1"  # the copy the session mutated (scripts/mutation.sh)
        rows = [(*row, tree) for row in sqlite3.connect(session).execute(RUN).fetchall()]
        for row in rows:
            if row[6] in seen:
                continue
            seen.add(row[6])
            counts = by_module.setdefault(row[0], dict(run=0, killed=0, equivalent=0, unexplained=0, pending=0))
            counts["run"] += 1
            if row[3].lower() in ("killed", "incompetent"):  # incompetent: the tests could not even run
                counts["killed"] += 1
            elif row[3].lower() == "survived" and (key(row, tree) in equivalent or in_annotation(row, tree)):
                counts["equivalent"] += 1
            elif row[3].lower() == "survived":
                counts["unexplained"] += 1
                unexplained.append(row)
        totals["pending"] += pending(session)
        deferred |= {job for (job,) in sqlite3.connect(session).execute(
            "select job_id from work_results where output = 'deferred'")}
    for module, counts in sorted(by_module.items()):
        score = counts["killed"] / max(counts["run"] - counts["equivalent"], 1)
        print(f"{module}: {counts['run']} mutants run, {counts['killed']} killed, {counts['equivalent']} survivors argued "
              f"equivalent, {counts['unexplained']} unexplained: {score:.1%}")
        for name in ("run", "killed", "equivalent", "unexplained"):
            totals[name] += counts[name]
    totals["pending"] += len(deferred)
    score = totals["killed"] / max(totals["run"] - totals["equivalent"], 1)
    for module, operator, row, _, diff, _, _, tree in unexplained:
        print(f"\nSURVIVED {module}:{row} {operator}\n  equivalent-file key: {'|'.join(key((module, operator, row, None, diff), tree))}"
              f"\n{diff or ''}".rstrip())
    when = f" in {seconds / 60:.1f} min" if seconds is not None else ""
    print(f"\nmutation score: {totals['killed']} killed of {totals['run'] - totals['equivalent']} non-equivalent mutants "
          f"= {score:.1%} (target {target:g}%); {totals['equivalent']} argued equivalent, {totals['unexplained']} "
          f"unexplained survivors, {totals['pending']} not run; {totals['run']} run{when}")
    return 0 if score * 100 >= target and totals["pending"] == 0 else 1


def in_annotation(row, root: Path) -> bool:
    """The mutated operator stands in a type annotation of a module with ``from __future__ import annotations``:
    annotations are then strings nothing evaluates (vdpcp calls no get_type_hints), so the mutant is equivalent."""
    import ast

    module, _, line, _, _, col = row[:6]
    source = (root / module).read_text()
    tree = ast.parse(source)
    if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
               for n in tree.body):
        return False
    annotations = [n.returns for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    annotations += [n.annotation for n in ast.walk(tree) if isinstance(n, ast.arg | ast.AnnAssign)]
    return any(a is not None and (a.lineno, a.col_offset) <= (line, col) <= (a.end_lineno, a.end_col_offset)
               for a in annotations)


def key(row, root: Path) -> tuple[str, str, str]:
    """(module, operator, the mutated line as the mutant writes it, stripped): what the equivalent file lists.
    The mutated line, not the original, tells apart two mutants of one operator on one line (ranks[1], ranks[-1])."""
    module, operator, diff = row[0], row[1], row[4] or ""
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return module, operator, added[0] if added else ""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pending").add_argument("session")
    again = sub.add_parser("retry")
    again.add_argument("new")
    again.add_argument("--survivors-only", action="store_true")
    again.add_argument("old", nargs="+")
    cut = sub.add_parser("shard")
    cut.add_argument("session")
    cut.add_argument("worker", type=int)
    cut.add_argument("workers", type=int)
    rep = sub.add_parser("report")
    rep.add_argument("sessions", nargs="+")
    rep.add_argument("--target", type=float, default=90.0)
    rep.add_argument("--seconds", type=float, default=None)
    rep.add_argument("--equivalent", type=Path, default=None)
    rep.add_argument("--source-root", type=Path, default=None,
                     help="the tree the sessions mutated (default: tree1 beside each session, as mutation.sh lays it)")
    args = parser.parse_args(argv)
    if args.command == "pending":
        print(pending(args.session))
        return 0
    if args.command == "retry":
        retry(args.new, args.old, args.survivors_only)
        return 0
    if args.command == "shard":
        shard(args.session, args.worker, args.workers)
        return 0
    return report(args.sessions, args.target, args.seconds, equivalents(args.equivalent), args.source_root)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
