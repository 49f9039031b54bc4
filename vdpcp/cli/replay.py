"""`vdpcp replay SPEC.json`: run one saved case sharded against unsharded, exactly, on any backend.

A saved case (vdpcp.matrix.saved: what `vdpcp fuzz` writes) carries its CP size, implementation, split, dtype and
flags, so it fails again with no flag retyped; a flag typed here overrides the file. A plain microbatch spec
takes its CP size from --cp or the name's -cp<N> tag. Prints the plan (which rank encodes which images and
placeholders), the verdict judged as `vdpcp check` judges it (a known upstream limit that fails the known way
is an xfail with its reason; --no-known-limits sets the limit aside, so an upstream bug's reproduction fails
until it is fixed), the failure signature against the saved one, and for an errored case the failing rank's
traceback. The case is sized before anything is built (vdpcp.matrix.budget): one over --max-spec-bytes
is refused. It exits as `vdpcp check` does, except that a case that says nothing about sharding is bad input.
"""

from __future__ import annotations

from pathlib import Path

from vdpcp.cli import DTYPES, IMPL_HELP, RANKS, SPLITS, UsageError, add_budget_option, add_run_options, checked_impls
from vdpcp.cli.exit_codes import epilog


def register(subparsers) -> None:
    parser = subparsers.add_parser("replay", help=__doc__.splitlines()[0].split(": ", 1)[1], description=__doc__,
                                   epilog=epilog("replay"))
    parser.add_argument("spec", metavar="SPEC.json", type=Path, help="a microbatch spec file")
    parser.add_argument("--cp", type=RANKS, default=None, help="CP ranks (default: the file's case.cp, else the name's -cp<N> tag)")
    parser.add_argument("--outputs-only", action="store_true", help="check the outputs alone (no backward)")
    parser.add_argument("--no-known-limits", dest="known_limits", action="store_false",
                        help="judge as if the implementation declared no known limit, so an upstream bug's "
                             "reproduction fails (exit 1) until it is fixed")
    add_case_arguments(parser)
    parser.set_defaults(func=main)


def add_case_arguments(parser) -> None:
    """Options shared with `vdpcp fuzz`: how a case departs from the feature as specified, and where it runs.
    Each defaults to None, so a saved case's own setting holds unless the flag is typed."""
    parser.add_argument("--impl", default=None, metavar="IMPL", help=f"implementation under test (default: reference): {IMPL_HELP}")
    parser.add_argument("--split", default=None, metavar="SPLIT",
                        help=f"the implementation's partition (default: the file's, else its first; the reference's: {', '.join(SPLITS)})")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="dtype of the case (default: float64)")
    parser.add_argument("--no-even-pad", dest="even_pad", action="store_const", const=False, default=None,
                        help="switch off even-grid padding: the pixel shuffle then rejects odd (placeholder) grids")
    parser.add_argument("--mutant", default=None, metavar="NAME", help="apply a named mutant of the sharded path (see vdpcp.tools.mutants)")
    add_run_options(parser)
    add_budget_option(parser)


def check_mutant(name: str | None) -> None:
    from vdpcp.tools.mutants import MUTANTS

    if name is not None and name not in MUTANTS:
        raise UsageError(f"--mutant {name}: unknown mutant; expected one of {sorted(MUTANTS)}")


def load_saved(path: Path, cp: int | None = None, **options):
    """(the Case a saved file describes, with typed options winning; the signature it was saved with).
    UsageError naming the file and field on a bad file, option or CP size, or a case over the spec limit."""
    from vdpcp.feature.spec import SpecError
    from vdpcp.matrix import budget, saved

    try:
        found = saved.load(path)
        case = found.to_case(cp=cp, **options)
    except SpecError as err:
        raise UsageError(str(err)) from None
    if case.cp < 1:  # --cp is refused out of range as it is parsed: this is the file's own
        raise UsageError(f"{path}: CP size {case.cp}: expected a positive number of ranks")
    checked_impls([case.impl])
    case = _own_split(case, options.get("split"), path)
    check_mutant(case.mutant)
    try:
        budget.check(case, str(path))
    except (SpecError, budget.BudgetError) as err:
        raise UsageError(str(err)) from None
    return case, found.signature


def load_case(path: Path, cp: int | None = None, **options):
    return load_saved(path, cp, **options)[0]


def _own_split(case, typed: str | None, path: Path):
    """The case in one of its implementation's own partitions: a plain spec's default (count) becomes the
    implementation's first; a partition it does not have is a usage error naming where it came from."""
    from vdpcp.impls import resolve

    own = resolve(case.impl).splits
    if case.split in own:
        return case
    if typed is None and case.split == "count":
        return case.with_(split=own[0])
    where = f"--split {typed}" if typed is not None else f"{path}: case.split {case.split!r}"
    raise UsageError(f"{where}: {case.impl} has no such partition; expected one of {', '.join(own)}")


def plan_lines(case) -> list[str]:
    """Which rank encodes which media, frames and placeholders; what the gather drops."""
    from dataclasses import replace

    from vdpcp.feature.plan import STRATEGIES
    from vdpcp.feature.sharded import ownership, plan_for, row_runs
    from vdpcp.impls import resolve

    spec, impl = case.spec, resolve(case.impl)
    if not case.config.shard_vision:
        return [f"not sharded: every rank encodes all {len(spec.images)} rows"]
    if impl.replicated(spec, case.config):
        return [f"replicated by {impl.name}'s policy ({impl.replicated(spec, case.config)}): every rank encodes all "
                f"{len(spec.images)} rows"]
    if case.split not in STRATEGIES:  # the implementation's own partition: its plan, where it states one
        return _ownership_lines(spec, impl.plan(spec, case.config), case.split)
    config = case.config if case.split in impl.splits else replace(case.config, strategy="count")
    plan = plan_for(spec, config)
    stated, ours = impl.plan(spec, case.config), ownership(plan)
    if stated is not None and (stated.owner, stated.placeholders) != (ours.owner, ours.placeholders):
        return _ownership_lines(spec, stated, case.split)  # a rule of its own under a name vdpcp's planner also has
    owner = _row_owners(spec.media_frames)
    lines = [
        f"plan ({plan.strategy}, cp={plan.cp_size}, T={plan.temporal_patch_size}): {plan.num_real_rows} rows, "
        f"{plan.num_placeholders} placeholders; the gather drops the last {plan.num_padded_ranks} rank(s)"
    ]
    for shard in plan.shards:
        real = plan.order[shard.start : min(shard.stop, plan.num_real_rows)]  # out of image order when packed
        parts = [_rows_text(spec, owner, range(first, last + 1)) for first, last in row_runs(real)]
        parts = _clipped(parts)
        if shard.num_placeholders:
            parts.append(f"{shard.num_placeholders} placeholder(s) {spec.patch_dim}x{spec.patch_dim}")
        lines.append(f"  rank {shard.rank}: {', '.join(parts) or 'nothing'} ({shard.num_patches} patches)")
    return lines


def report(judged, path: Path | None = None, saved_signature: str | None = None, known_limits: bool = True) -> str:
    """The whole replay: case, plan, verdict and signature, failures, and the failing rank's traceback; without
    ``known_limits``, the limit set aside, where the implementation declares one for the case."""
    from vdpcp.feature.spec import summary
    from vdpcp.matrix import budget
    from vdpcp.matrix.expectations import known_limit
    from vdpcp.tools.fuzz import failing_rank, signature

    result = judged.result
    case = result.case
    lines = [f"replay {path or case.spec.name}: {case.id} (on {result.backend}, {result.device})",
             f"spec: {summary(case.spec, path)}", f"size: {budget.need(case).text()}"]
    lines += plan_lines(case)
    sig = signature(result)
    lines.append(f"verdict: {judged.verdict}" + (f" ({judged.why})" if judged.why else ""))
    set_aside = None if known_limits else known_limit(case, result.backend)
    if set_aside is not None:
        lines.append(f"judged as if {case.impl} declared no known limit: {set_aside.name} set aside")
    if sig:
        lines.append(f"signature: {sig}")
    if saved_signature is not None:
        same = "the same as" if sig == saved_signature else "NOT the same as"
        lines.append(f"{same} the saved signature: {saved_signature}")
    if judged.verdict == "xfail" and case.grads:
        lines.append(f"the outputs alone can still be checked: vdpcp replay {path or '...'} --outputs-only")
    if result.error is not None:  # a rank raised, died or hung (out of memory, too)
        rank, what, traceback = failing_rank(result)
        lines.append(f"failing rank {rank}: {what}")
        lines.append(traceback)
    else:
        lines += [f"  {msg}" for msg in result.failures]
    return "\n".join(lines)


def main(args) -> int:
    from vdpcp.matrix.runner import preload_case_modules, run_judged

    case, saved_signature = load_saved(args.spec, args.cp, impl=args.impl, split=args.split, dtype=args.dtype,
                                       even_pad=args.even_pad, mutant=args.mutant,
                                       grads=False if args.outputs_only else None)
    preload_case_modules([case.impl])
    judged = run_judged(case, backend=args.backend, timeout=args.timeout, known_limits=args.known_limits)
    print(report(judged, args.spec, saved_signature, known_limits=args.known_limits))
    if judged.verdict == "resource":
        raise UsageError(f"{args.spec}: {judged.why}: a resource failure, not a verdict on the encoder or on sharding; "
                         f"run it where there is the memory, or shrink the spec")
    if judged.verdict == "unsharded-error":
        raise UsageError(f"{args.spec}: the unsharded encoder rejects this spec too "
                         f"({judged.result.ranks[0].unsharded_error}), so it says nothing about sharding")
    from vdpcp.cli.check import exit_code

    return exit_code([judged.verdict])


def _ownership_lines(spec, ownership, split: str) -> list[str]:
    """An implementation's own stated plan (an Ownership), rank by rank."""
    from vdpcp.feature.sharded import row_runs

    if ownership is None:
        return [f"plan ({split}): not stated by the implementation; what each rank really encoded is in the verdict"]
    owner, cp = _row_owners(spec.media_frames), len(ownership.placeholders)
    lines = [f"plan ({split}, cp={cp}): {len(ownership.owner)} rows, {sum(ownership.placeholders)} placeholders"]
    for rank in range(cp):
        parts = [_rows_text(spec, owner, range(a, b + 1)) for a, b in row_runs(ownership.rows_of(rank))]
        if ownership.placeholders[rank]:
            parts.append(f"{ownership.placeholders[rank]} placeholder(s)")
        lines.append(f"  rank {rank}: {', '.join(parts) or 'nothing'}")
    return lines


def _row_owners(media_frames) -> list[tuple[int, int]]:
    """(media item, frame within it) of every real row."""
    return [(m, f) for m, n in enumerate(media_frames) for f in range(n)]


SHOWN_ITEMS = 6  # media items a rank's plan line names; a longer run is clipped to its ends and a count


def _rows_text(spec, owner, rows: range) -> str:
    """Rows as media items: "image 0 (8x8)", "video 2 frames 0-3 (16x16)"; a long run by its ends and a count."""
    parts, r = [], rows.start
    while r < rows.stop:
        m, first = owner[r]
        end = r
        while end + 1 < rows.stop and owner[end + 1][0] == m:
            end += 1
        h, w = spec.images[r]
        frames = spec.media_frames[m]
        if frames == 1:
            parts.append(f"image {m} ({h}x{w})")
        else:
            parts.append(f"video {m} frames {first}-{owner[end][1]} of {frames} ({h}x{w})")
        r = end + 1
    return ", ".join(_clipped(parts))


def _clipped(parts: list[str]) -> list[str]:
    return parts if len(parts) <= SHOWN_ITEMS else parts[:3] + [f"... {len(parts) - 5:,} more ..."] + parts[-2:]
