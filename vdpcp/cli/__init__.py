"""`vdpcp` command line: one module per subcommand in this package, found at start-up.

Each subcommand module defines ``register(subparsers)``, which adds its parser and sets ``func``
(a callable taking the parsed args and returning the exit code). The exit codes, and what each means to each
subcommand, are one table: vdpcp.cli.exit_codes (docs/cli.md).
"""

import argparse
import contextlib
import importlib
import os
import pkgutil
import re
import sys
import textwrap

from vdpcp.cli.exit_codes import Exit, epilog
from vdpcp.matrix.choices import DTYPES, LOSSES  # noqa: F401  (the subcommands take a case's choices from here)
from vdpcp.usage import UsageError, number  # a leaf the reports import too; the subcommands import them from here

# Choices the subcommands share, literal so that `vdpcp --help` imports no torch (tests/unit/test_cli.py holds them
# to the code's). Implementations and their partitions are no fixed choice: checked_impls and checked_splits check them.
SPLITS = ("count", "balanced", "packed")  # the reference's
BACKENDS = ("auto", "nccl", "gloo")


class Formatter(argparse.HelpFormatter):
    """argparse's help, a paragraph at a time: a table (a heading, then indented entries, as the exit codes are) keeps
    its entries, each wrapped under its own text; any other paragraph is wrapped to the terminal, as argparse does."""

    def _fill_text(self, text, width, indent):
        fill = super()._fill_text
        return "\n\n".join(self._table(paragraph, width) if self._is_table(paragraph) else fill(paragraph, width, indent)
                             for paragraph in text.strip("\n").split("\n\n"))

    @staticmethod
    def _is_table(paragraph: str) -> bool:
        heading, *entries = paragraph.splitlines()
        return heading.endswith(":") and bool(entries) and all(line.startswith("  ") for line in entries)

    @staticmethod
    def _table(paragraph: str, width: int) -> str:
        heading, *entries = paragraph.splitlines()
        lines = [heading]
        for entry in entries:
            hang = " " * len(re.match(r"\s*\S+\s*", entry).group())
            lines += textwrap.wrap(entry, max(width, len(hang) + 20), subsequent_indent=hang)
        return "\n".join(lines)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose every complaint (an option out of its range, an unknown choice, a missing
    argument) is one UsageError line naming the option: exit 2, as any other bad input."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


RANKS = number(int, 1)  # a CP size, a world size
POSITIVE = number(int, 1)  # a count of things to run: cases, steps, microbatches, repetitions
SEED = number(int, 0, 2**32 - 1)
SECONDS = number(float, 0, above=True)


def add_run_options(parser) -> None:
    """Where the ranks run: --backend and --timeout, as every case-running subcommand takes them."""
    parser.add_argument("--backend", choices=BACKENDS, default=None, help="process-group backend (default: $VDPCP_BACKEND or auto)")
    parser.add_argument("--timeout", type=SECONDS, default=None, metavar="SECONDS", help="seconds before a case counts as hung")


def add_budget_option(parser) -> None:
    """--max-spec-bytes and --max-case-tflop, for every subcommand that runs cases: each is sized first (vdpcp.matrix.budget)."""
    parser.add_argument("--max-spec-bytes", default=None, metavar="BYTES",
                        help="refuse a case whose estimated memory (on the CPU: every rank on this machine; on GPUs: the "
                             "busiest GPU) is over BYTES, e.g. 16G (default: $VDPCP_MAX_SPEC_BYTES, else 8G on the CPU and "
                             "nine tenths of the GPU)")
    parser.add_argument("--max-case-tflop", type=number(float, 0, above=True), default=None, metavar="TFLOP",
                        help="on the CPU, refuse a case of more work than this (default: $VDPCP_MAX_CASE_TFLOP, else 2: "
                             "a real-size tower's cases are for GPUs)")


TOWER_HELP = ("the size of every case's tower: toy (CPU CI, the default) or real (the published size each shipped "
              "subject stands for: ViT-L/16, Qwen2.5-VL-7B's, Qwen3-VL-8B's, Nemotron Omni's RADIO; for GPUs), or any "
              "size an implementation declares")


def checked_tower(tower: str, impls) -> str:
    """--tower, as every implementation asked for declares it (its ``towers``): one usage error naming the rest."""
    from vdpcp.impls import resolve

    missing = {impl: sorted(resolve(impl).towers) for impl in impls if tower not in resolve(impl).towers}
    if missing:
        said = "; ".join(f"{impl} comes in {', '.join(sizes)}" for impl, sizes in missing.items())
        raise UsageError(f"--tower {tower}: {said}")
    return tower


@contextlib.contextmanager
def spec_limit(value, tflop=None):
    """--max-spec-bytes and --max-case-tflop for one subcommand, then the limits as they were; a bad limit, or a spec
    over one, wherever it is met, is one usage error (exit 2)."""
    from vdpcp.matrix import budget

    try:
        with budget.limited(value), budget.limited_flops(tflop):
            budget.limit()  # a bad VDPCP_MAX_SPEC_BYTES or VDPCP_MAX_CASE_TFLOP: one line, before anything runs
            budget.flops_limit()
            yield
    except budget.BudgetError as err:
        raise UsageError(str(err)) from None
    except Exception as err:
        spec = sys.modules.get("vdpcp.feature.spec")
        if spec is not None and isinstance(err, spec.SpecTooLarge):
            raise UsageError(str(err)) from None
        raise


IMPL_HELP = ("a registered implementation (reference, mcore, qwen2_5_vl, automodel, automodel-shipped, nemotron-omni, "
             "or one an installed package adds to the vdpcp.implementations entry points) or module:object")


def checked_impls(targets) -> tuple[str, ...]:
    """The --impl targets, each resolved once so a bad one is one usage error naming it."""
    from vdpcp.impls import ImplError, resolve

    for target in targets:
        try:
            resolve(target)
        except ImplError as err:
            raise UsageError(str(err)) from None
    return tuple(targets)


def checked_splits(splits, impls) -> tuple[str, ...] | None:
    """--split names as the implementations name their partitions: one usage error for a name none of them
    has; a note on stderr for each implementation whose cases a name leaves out. None (every partition) if unset."""
    from vdpcp.impls import resolve

    if not splits:
        return None
    own = {impl: resolve(impl).splits for impl in impls}
    for split in splits:
        if not any(split in names for names in own.values()):
            known = "; ".join(f"{impl}: {', '.join(names)}" for impl, names in own.items())
            raise UsageError(f"--split {split}: no implementation selected has this partition ({known})")
    for impl, names in own.items():
        if not set(splits) & set(names):
            print(f"note: --split {' '.join(splits)} leaves out every case of {impl} (its partitions: "
                  f"{', '.join(names)})", file=sys.stderr)
    return tuple(splits)


HELPERS = ("exit_codes",)  # modules of this package that are no subcommand


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="vdpcp", description=__doc__.splitlines()[0], epilog=epilog())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module.name not in HELPERS:
            importlib.import_module(f"{__name__}.{module.name}").register(subparsers)
    return parser


def main(argv=None) -> int:
    from vdpcp.harness.config import configured

    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:  # the parser's own message names the subcommand
        print(err, file=sys.stderr)
        return Exit.BAD_INPUT
    path = list(sys.path)
    try:
        # --impl module:object names a module of the project it is run from, as `python -m` would find it
        sys.path.insert(0, os.getcwd())
        # whatever a subcommand configures (backend, preload, the spec limit) ends with it
        with configured(), spec_limit(getattr(args, "max_spec_bytes", None), getattr(args, "max_case_tflop", None)):
            return int(args.func(args) or Exit.PASSED)
    except UsageError as err:
        print(f"vdpcp {args.command}: {err}", file=sys.stderr)
        return Exit.BAD_INPUT
    finally:
        sys.path[:] = path


if __name__ == "__main__":
    sys.exit(main())
