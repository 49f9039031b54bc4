"""`vdpcp` command line: one module per subcommand in this package, found at start-up.

Each subcommand module defines ``register(subparsers)``, which adds its parser and sets ``func``
(a callable taking the parsed args and returning the exit code). Exit codes: 0 every case passed,
1 a case failed (or the fuzzer found a failure, or --maxfail stopped the run), 2 bad input, 143 (130) stopped by
SIGTERM (Ctrl-C) after the cases it finished (vdpcp.progress).
"""

import argparse
import importlib
import os
import pkgutil
import sys

# Choices the subcommands share, kept literal so `vdpcp --help` need not import torch; tests/unit/test_cli.py
# holds them equal to vdpcp.case.DTYPES / LOSSES and vdpcp.plan.STRATEGIES. Implementations are not a fixed
# choice: --impl takes a registered name or module:object (vdpcp.impls.resolve checks it).
SPLITS = ("count", "balanced", "packed")
DTYPES = ("float64", "float32", "bfloat16")
LOSSES = ("rank", "zigzag")
BACKENDS = ("auto", "nccl", "gloo")


class UsageError(Exception):
    """Bad input on the command line or in a spec file: exit code 2, one clear message."""


def add_run_options(parser) -> None:
    """Where the ranks run: --backend and --timeout, as every case-running subcommand takes them."""
    parser.add_argument("--backend", choices=BACKENDS, default=None, help="process-group backend (default: $VDPCP_BACKEND or auto)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="seconds before a case counts as hung")


IMPL_HELP = ("a registered implementation (reference, mcore, qwen2_5_vl, or one an installed package adds to the "
             "vdpcp.implementations entry points) or module:object")


def checked_impls(targets) -> tuple[str, ...]:
    """The --impl targets, each resolved once so a bad one is one usage error naming it."""
    from vdpcp.impls import ImplError, resolve

    for target in targets:
        try:
            resolve(target)
        except ImplError as err:
            raise UsageError(str(err)) from None
    return tuple(targets)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vdpcp", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{module.name}").register(subparsers)
    return parser


def main(argv=None) -> int:
    from vdpcp.harness.config import configured

    args = build_parser().parse_args(argv)
    path = list(sys.path)
    try:
        # --impl module:object names a module of the project it is run from, as `python -m` would find it
        sys.path.insert(0, os.getcwd())
        with configured():  # whatever a subcommand configures (backend, preload) ends with it
            return int(args.func(args) or 0)
    except UsageError as err:
        print(f"vdpcp {args.command}: {err}", file=sys.stderr)
        return 2
    finally:
        sys.path[:] = path


if __name__ == "__main__":
    sys.exit(main())
