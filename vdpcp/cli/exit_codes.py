"""Every exit code of the command line, as one table: what each code means, and what it means to each subcommand.

The subcommands return these instead of literals, each one's --help lists its own codes from here (``epilog``), and
docs/cli.md's table is held to ``TABLE`` by tests/unit/test_exit_codes.py. A leaf, importing nothing of vdpcp's, so
that ``vdpcp --help`` stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Exit(IntEnum):
    PASSED = 0
    FAILED = 1
    BAD_INPUT = 2
    NOT_SHARDED = 3
    UNBALANCED = 4
    GRAD_WRITTEN = 5
    INTERRUPTED = 130  # 128 + the signal, as a shell reports a death by SIGINT
    TERMINATED = 143  # and by SIGTERM


@dataclass(frozen=True)
class Code:
    """One row of the table: the code, its name as the docs and reports say it, and what it means to any command."""

    code: Exit
    name: str
    meaning: str


TABLE = (
    Code(Exit.PASSED, "passed", "what the command holds held: every case passed, every mutant killed, no failure found, "
                                "the arms agreed; or the command only prints"),
    Code(Exit.FAILED, "failed", "a wrong result, an error, a surviving mutant, a finding or arms that disagree; or "
                                "--maxfail stopped the run (the cases it did not run are unknown)"),
    Code(Exit.BAD_INPUT, "bad-input", "an option out of its range, a spec file that does not parse, a case over the spec "
                                      "limit: refused in one line before anything runs"),
    Code(Exit.NOT_SHARDED, "not-sharded", "every result right, but some work was not distributed where vision_dp_over_cp "
                                          "should shard it"),
    Code(Exit.UNBALANCED, "unbalanced", "every result right and distributed, but a rank carries a whole unit more than the "
                                        "best partition under the implementation's declared objective"),
    Code(Exit.GRAD_WRITTEN, "grad-written", "every result right, but a backward wrote into the gradient it was handed"),
    Code(Exit.INTERRUPTED, "interrupted", "stopped by Ctrl-C (SIGINT) after the cases it finished"),
    Code(Exit.TERMINATED, "terminated", "stopped by SIGTERM after the cases it finished"),
)
BY_CODE = {row.code: row for row in TABLE}

_CHECKED = {
    Exit.NOT_SHARDED: "not-sharded: every result right, but some microbatch was not distributed where "
                      "vision_dp_over_cp should have sharded it (the feature a silent no-op there)",
    Exit.UNBALANCED: "unbalanced: every result right and distributed, but a rank carries a whole unit more than the "
                     "best partition under the implementation's own declared objective",
    Exit.GRAD_WRITTEN: "grad-written: every result right, but a backward wrote into the gradient it was handed (a "
                       "consumer that reads it after sees the sum)",
}
_BAD_INPUT = "bad input: an option, a spec file, a case over the spec limit"

# What each code means to each subcommand that gives it; a subcommand gives no other.
COMMANDS: dict[str, dict[Exit, str]] = {
    "check": {
        Exit.PASSED: "every case passed: pass, replicated as the implementation's fallback policy says, or a strict "
                     "xfail failing the known way",
        Exit.FAILED: "any case failed, errored, mismatched its plan or passed a strict xfail; or --maxfail stopped the "
                     "run before its end",
        Exit.BAD_INPUT: _BAD_INPUT,
        Exit.NOT_SHARDED: f"the only others are {_CHECKED[Exit.NOT_SHARDED]}",
        Exit.UNBALANCED: f"the only others are {_CHECKED[Exit.UNBALANCED]}",
        Exit.GRAD_WRITTEN: f"any is {_CHECKED[Exit.GRAD_WRITTEN]}; before 3 and 4",
        Exit.INTERRUPTED: "stopped by Ctrl-C after the cases it finished",
        Exit.TERMINATED: "stopped by SIGTERM after the cases it finished",
    },
    "replay": {
        Exit.PASSED: "pass, replicated or xfail",
        Exit.FAILED: "any other failure",
        Exit.BAD_INPUT: "bad spec or options, including a spec over the limit, one the unsharded encoder rejects too "
                        "(then sharding is not to blame), and a rank out of memory (a resource failure, not a verdict)",
        Exit.NOT_SHARDED: _CHECKED[Exit.NOT_SHARDED],
        Exit.UNBALANCED: _CHECKED[Exit.UNBALANCED],
        Exit.GRAD_WRITTEN: _CHECKED[Exit.GRAD_WRITTEN],
    },
    "fuzz": {
        Exit.PASSED: "no failure in the microbatches drawn (their count printed)",
        Exit.FAILED: "a failure: shrunk, saved and its replay command printed; or a failure saved by an earlier search "
                     "that still fails",
        Exit.BAD_INPUT: _BAD_INPUT,
    },
    "mutants": {
        Exit.PASSED: "every mutant killed (or --list)",
        Exit.FAILED: "any mutant survived; or --maxfail stopped the run before its end",
        Exit.BAD_INPUT: _BAD_INPUT,
        Exit.INTERRUPTED: "stopped by Ctrl-C after the mutants it finished",
        Exit.TERMINATED: "stopped by SIGTERM after the mutants it finished",
    },
    "ab": {
        Exit.PASSED: "the arms agree",
        Exit.FAILED: "they do not, or a rank failed",
        Exit.BAD_INPUT: "bad input: an option, an unknown dataset or mutant",
    },
    "bench": {
        Exit.PASSED: "the figures printed",
        Exit.FAILED: "towers: a case did not pass; sensitivity: a correct run of a chosen case did not pass",
        Exit.BAD_INPUT: "bad input: an option",
    },
    "balance": {
        Exit.PASSED: "the loads printed",
        Exit.BAD_INPUT: "bad input: a spec file or folder, an option",
    },
    "subjects": {
        Exit.PASSED: "whatever it finds: it only tells",
        Exit.BAD_INPUT: "bad input: an option",
    },
}


def commands_giving(code: Exit) -> tuple[str, ...]:
    """The subcommands that exit with ``code``, in name order."""
    return tuple(sorted(command for command, codes in COMMANDS.items() if code in codes))


def epilog(command: str | None = None) -> str:
    """The help's exit-code lines, one a code (the help wraps each under its text): ``command``'s own codes and what
    they mean to it, or (None) the whole table."""
    if command is None:
        rows = [(row.code, f"{row.name}: {row.meaning}") for row in TABLE]
    else:
        rows = sorted(COMMANDS[command].items())
    return "\n".join(["exit codes:", *(f"  {int(code):<4} {text}" for code, text in rows)])
