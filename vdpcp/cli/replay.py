"""`vdpcp replay SPEC.json`: run one saved microbatch sharded against unsharded, exactly, on any backend.

Prints the plan (which rank encodes which images and placeholders), the verdict with its failure
signature, and for an errored case the failing rank's traceback. The CP size comes from ``--cp`` or the
spec name's ``-cp<N>`` tag (as ``vdpcp.capture`` and ``vdpcp fuzz`` write it). Exit 0 pass, 1 failure,
2 bad spec or options, including a spec the unsharded encoder rejects too (then sharding is not to blame).
"""

from __future__ import annotations

from pathlib import Path

from vdpcp.cli import DTYPES, IMPLS, SPLITS, UsageError, add_run_options


def register(subparsers) -> None:
    parser = subparsers.add_parser("replay", help=__doc__.splitlines()[0].split(": ", 1)[1], description=__doc__)
    parser.add_argument("spec", metavar="SPEC.json", type=Path, help="a microbatch spec file")
    parser.add_argument("--cp", type=int, default=None, help="CP ranks (default: the spec name's -cp<N> tag)")
    add_case_arguments(parser)
    parser.set_defaults(func=main)


def add_case_arguments(parser) -> None:
    """Options shared with `vdpcp fuzz`: how a case departs from the feature as specified, and where it runs."""
    parser.add_argument("--impl", choices=IMPLS, default="reference", help="sharded implementation (default: reference)")
    parser.add_argument("--split", choices=SPLITS, default="count", help="split strategy of the reference (default: count)")
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of the case (default: float64)")
    parser.add_argument("--no-even-pad", dest="even_pad", action="store_false",
                        help="switch off even-grid padding: the pixel shuffle then rejects odd (placeholder) grids")
    parser.add_argument("--mutant", default=None, metavar="NAME", help="apply a named mutant of the sharded path (see vdpcp.mutants)")
    add_run_options(parser)


def check_mutant(name: str | None) -> None:
    from vdpcp.mutants import MUTANTS

    if name is not None and name not in MUTANTS:
        raise UsageError(f"--mutant {name}: unknown mutant; expected one of {sorted(MUTANTS)}")


def preload_for(impl: str) -> None:
    """MCore cases: rank workers start with megatron.core imported (a faulted case respawns them)."""
    if impl == "mcore":
        from vdpcp.runner import preload_case_modules

        preload_case_modules()


def load_case(path: Path, cp: int | None = None, **options):
    """The Case a spec file describes; UsageError (naming the file and field) on a bad file or CP size."""
    from vdpcp.capture import cp_from_name
    from vdpcp.case import Case
    from vdpcp.spec import MicrobatchSpec, SpecError

    try:
        spec = MicrobatchSpec.load(path)
    except SpecError as err:
        raise UsageError(str(err)) from None
    if cp is None:
        cp = cp_from_name(spec.name)
        if cp is None:
            raise UsageError(f"{path}: field 'name' = {spec.name!r} has no -cp<N> tag; pass --cp N")
    if cp < 1:
        raise UsageError(f"--cp {cp}: expected a positive number of ranks")
    check_mutant(options.get("mutant"))
    return Case(spec, cp, **options)


def plan_lines(case) -> list[str]:
    """Which rank encodes which media, frames and placeholders; what the gather drops."""
    from dataclasses import replace

    from vdpcp.sharded import plan_for, row_runs

    spec = case.spec
    if not case.config.shard_vision:
        return [f"not sharded: every rank encodes all {len(spec.images)} rows"]
    config = case.config if case.impl == "reference" else replace(case.config, strategy="count")
    plan = plan_for(spec, config)
    owner = _row_owners(spec.media_frames)
    lines = [
        f"plan ({plan.strategy}, cp={plan.cp_size}, T={plan.temporal_patch_size}): {plan.num_real_rows} rows, "
        f"{plan.num_placeholders} placeholders; the gather drops the last {plan.num_padded_ranks} rank(s)"
    ]
    for shard in plan.shards:
        real = plan.order[shard.start : min(shard.stop, plan.num_real_rows)]  # out of image order when packed
        parts = [_rows_text(spec, owner, range(first, last + 1)) for first, last in row_runs(real)]
        if shard.num_placeholders:
            parts.append(f"{shard.num_placeholders} placeholder(s) {spec.patch_dim}x{spec.patch_dim}")
        lines.append(f"  rank {shard.rank}: {', '.join(parts) or 'nothing'} ({shard.num_patches} patches)")
    return lines


def report(result, path: Path | None = None) -> str:
    """The whole replay: case, plan, verdict and signature, failures, and the failing rank's traceback."""
    from vdpcp.fuzz import failing_rank, signature

    case = result.case
    spec = case.spec
    lines = [f"replay {path or spec.name}: {case.id}", f"spec: {spec.to_dict()}"]
    lines += plan_lines(case)
    sig = signature(result)
    lines.append(f"verdict: {result.verdict}" + (f" ({sig})" if sig else ""))
    if result.verdict == "error":
        rank, what, traceback = failing_rank(result)
        lines.append(f"failing rank {rank}: {what}")
        lines.append(traceback)
    else:
        lines += [f"  {msg}" for msg in result.failures]
    return "\n".join(lines)


def main(args) -> int:
    from vdpcp.runner import run_case

    case = load_case(args.spec, args.cp, impl=args.impl, split=args.split, dtype=args.dtype,
                     even_pad=args.even_pad, mutant=args.mutant)
    preload_for(case.impl)
    result = run_case(case, backend=args.backend, timeout=args.timeout)
    print(report(result, args.spec))
    if result.verdict == "unsharded-error":
        raise UsageError(f"{args.spec}: the unsharded encoder rejects this spec too "
                         f"({result.ranks[0].unsharded_error}), so it says nothing about sharding")
    return 0 if result.passed else 1


def _row_owners(media_frames) -> list[tuple[int, int]]:
    """(media item, frame within it) of every real row."""
    return [(m, f) for m, n in enumerate(media_frames) for f in range(n)]


def _rows_text(spec, owner, rows: range) -> str:
    """Rows as media items: "image 0 (8x8)", "video 2 frames 0-3 (16x16)"."""
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
    return ", ".join(parts)
