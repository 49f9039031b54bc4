"""`vdpcp balance`: per-rank load of the count, balanced and packed splits, against the ideal and the lower bound.

Input is one spec file, a folder of spec files (*.json), or a built-in generator (--dataset; --seeds N
sweeps N microbatches). One microbatch prints every rank's load; several print the busiest rank's ratios
over all of them. --png saves a bar chart of the same.
"""

from __future__ import annotations

from pathlib import Path

from vdpcp.cli import POSITIVE, RANKS, SEED, UsageError, number
from vdpcp.cli.exit_codes import Exit, epilog


def register(subparsers) -> None:
    parser = subparsers.add_parser("balance", help="per-rank load of the count, balanced and packed splits", description=__doc__,
                                   epilog=epilog("balance"))
    parser.add_argument("source", nargs="?", help="a spec file or a folder of spec files")
    parser.add_argument("--dataset", help="a built-in generator instead: doc-qa, multi-image or video")
    parser.add_argument("--seed", type=SEED, default=0, help="first seed of --dataset (default 0)")
    parser.add_argument("--seeds", type=POSITIVE, default=1, help="microbatches of --dataset, seeds from --seed (default 1)")
    parser.add_argument("--samples", type=POSITIVE, default=None, help="samples per --dataset microbatch (default: its own)")
    parser.add_argument("--patch-dim", type=POSITIVE, default=16, help="patch size of --dataset microbatches (default 16)")
    parser.add_argument("--cp", type=RANKS, action="append", help="CP size (repeatable; default 2 4 8)")
    parser.add_argument("--alpha", type=number(int, 0), default=None, help="alpha of the p*(p+alpha) cost (default 3072 = 3 x 1024)")
    parser.add_argument("--png", help="save a bar chart here")
    parser.set_defaults(func=run)


def run(args) -> int:
    from vdpcp.feature import balance

    specs = _specs(args)
    cps = args.cp or [2, 4, 8]
    alpha = balance.REAL_TOWER_ALPHA if args.alpha is None else args.alpha
    print(f"{len(specs)} microbatch(es): {_describe(specs)}; alpha = {alpha}\n")
    if len(specs) == 1:
        balances = [b for cp in cps for b in balance.compare(specs[0], cp, alpha)]
        print(balance.summary_table(balances) + "\n")
        print(balance.rank_table(balances))
        if args.png:
            print(f"\nwrote {balance.plot_ranks(balances, args.png, f'{specs[0].name}: per-rank load')}")
    else:
        rows = balance.sweep(specs, cps, alpha)
        print(balance.sweep_table(rows))
        if args.png:
            print(f"\nwrote {balance.plot_sweep(rows, args.png, f'{_describe(specs)}: busiest rank / lower bound')}")
    return Exit.PASSED


def _specs(args):
    from vdpcp.feature.datasets import DatasetError, generate
    from vdpcp.feature.spec import MicrobatchSpec, SpecError

    if (args.source is None) == (args.dataset is None):
        raise UsageError("give either a spec file or folder, or --dataset NAME (not both)")
    if args.dataset is not None:
        try:
            seeds = range(args.seed, args.seed + args.seeds)
            return [generate(args.dataset, s, samples=args.samples, patch_dim=args.patch_dim) for s in seeds]
        except DatasetError as err:
            raise UsageError(f"--dataset: {err}") from None
    source = Path(args.source)
    paths = sorted(source.glob("*.json")) if source.is_dir() else [source]
    if not paths:
        raise UsageError(f"{source}: folder holds no spec files (*.json)")
    try:
        return [MicrobatchSpec.load(p) for p in paths]
    except SpecError as err:
        raise UsageError(str(err)) from None


def _describe(specs) -> str:
    if len(specs) == 1:
        s = specs[0]
        return f"{s.name} ({len(s.images)} images, {sum(s.row_patches)} patches)"
    images = sum(len(s.images) for s in specs) / len(specs)
    return f"{specs[0].name} .. {specs[-1].name} (mean {images:.1f} images)"
