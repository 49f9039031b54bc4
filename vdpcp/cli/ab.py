"""`vdpcp ab`: train a tiny VLM with vision_dp_over_cp on and off and hold the two runs to each other.

The skill's A/B in small: the same seed, weights and microbatches, CP ranks whose language model takes its
loss on its zigzag shard, gradients summed over CP, AdamW; only the flag differs (on: the implementation's
sharded encode; off: every rank encodes every image). The arms are mathematically equal, so their losses and
grad norms must agree per step, and their final parameters, within the dtype's rounding (vdpcp.tools.ab.judge says
how far). On a GPU it also reports the busiest rank's peak memory and the step time of each arm. --mutant
applies a named mutant to the sharded arm only.
"""

from __future__ import annotations

from pathlib import Path

from vdpcp.cli import DTYPES, IMPL_HELP, POSITIVE, SEED, UsageError, add_run_options, checked_impls, number
from vdpcp.cli.exit_codes import Exit, epilog

AB_RANKS = number(int, 2, note="vision_dp_over_cp is a no-op at CP=1, so both arms would be one run")
TOWERS = ("toy", "real")  # vdpcp.feature.model.TOWERS, literal so that `vdpcp --help` imports no torch


def register(subparsers) -> None:
    parser = subparsers.add_parser("ab", help=__doc__.splitlines()[0].split(": ", 1)[1], description=__doc__,
                                   epilog=epilog("ab"))
    parser.add_argument("--cp", type=AB_RANKS, default=2, metavar="N", help="CP ranks (default 2; the flag is a no-op at 1)")
    parser.add_argument("--steps", type=POSITIVE, default=5, metavar="K", help="optimizer steps per arm (default 5)")
    parser.add_argument("--accumulate", type=POSITIVE, default=2, metavar="M", help="microbatches per step (default 2)")
    parser.add_argument("--impl", default="reference", metavar="IMPL", help=f"implementation under test (default reference): {IMPL_HELP}")
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="model dtype (default float64; bf16 keeps float32 main weights)")
    parser.add_argument("--dataset", default="doc-qa", help="doc-qa, multi-image or video (default doc-qa)")
    parser.add_argument("--tower", choices=TOWERS, default="toy",
                        help="toy: the toy tower on downscaled microbatches (CPU); real: the reference's published size "
                             "(ViT-L/16: hidden 1024, 24 layers) on the dataset's real sizes (GPU memory)")
    parser.add_argument("--mutant", metavar="NAME", help="a named mutant (vdpcp.tools.mutants), in the sharded arm only")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the weights and the microbatches (default 0)")
    add_run_options(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the per-step record and the verdict as JSON")
    parser.add_argument("--png", type=Path, metavar="PATH", help="plot both loss curves and their difference")
    parser.set_defaults(func=main)


def checked_run(args):
    """The Run the options describe; UsageError naming the first bad one."""
    from vdpcp.feature.datasets import DATASETS
    from vdpcp.tools.ab.train import Run
    from vdpcp.tools.mutants import MUTANTS

    if args.dataset not in DATASETS:
        raise UsageError(f"--dataset {args.dataset}: unknown dataset; expected one of {', '.join(sorted(DATASETS))}")
    if args.mutant is not None and args.mutant not in MUTANTS:
        raise UsageError(f"--mutant {args.mutant}: unknown mutant; expected one of {', '.join(sorted(MUTANTS))}")
    (impl,) = checked_impls([args.impl])
    return Run(impl=impl, cp=args.cp, steps=args.steps, accumulate=args.accumulate, dtype=args.dtype,
               dataset=args.dataset, tower=args.tower, seed=args.seed, mutant=args.mutant)


def main(args) -> int:
    import time

    from vdpcp.harness import BackendUnavailable, RankFailure, run_ranks
    from vdpcp.harness.config import resolve_backend
    from vdpcp.matrix import report
    from vdpcp.tools.ab import report as ab_report
    from vdpcp.tools.ab.judge import judge
    from vdpcp.tools.ab.train import ab_ranks

    run = checked_run(args)
    try:
        backend = resolve_backend(args.backend, run.cp)
    except BackendUnavailable as err:
        raise UsageError(f"--backend {args.backend}: {err}") from None
    out = report.console()
    started = time.perf_counter()
    try:
        ranks = run_ranks(ab_ranks, run.cp, run, backend=backend, timeout=args.timeout)
    except RankFailure as failure:
        out.print(f"vdpcp ab: a rank failed, so the arms cannot be compared (verdict: [bold red]fail[/])\n{failure}")
        for limit in known_limits(run, backend, str(failure)):
            out.print(f"vdpcp ab: {run.impl} declares this a known limit on {backend}: {limit.name}: {limit.reason}")
        return Exit.FAILED
    judged = judge(run, run.schedule(), ranks, time.perf_counter() - started)
    out.print(ab_report.table(judged))
    for line in ab_report.summary(judged):
        out.print(line)
    if args.json:
        ab_report.write_json(args.json, judged)
    if args.png:
        out.print(f"wrote {ab_report.plot(args.png, judged)}")
    return Exit.PASSED if judged.passed else Exit.FAILED


def known_limits(run, backend: str, failure: str) -> list:
    """The known limits (KnownLimit) the implementation declares for the run's microbatches that the failure shows."""
    from vdpcp.impls import resolve
    from vdpcp.matrix.case import Case

    impl = resolve(run.impl)
    limits = {impl.known_limit(Case(draw.spec, run.cp, impl=run.impl), backend) for step in run.schedule() for draw in step}
    return sorted((limit for limit in limits if limit is not None and limit.shows(failure)), key=lambda limit: limit.name)
