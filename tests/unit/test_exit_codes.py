"""The exit codes are one table (vdpcp.cli.exit_codes): docs/cli.md's table says what the code says, every
subcommand's --help lists its own codes from it, and the codes other modules give are the table's."""

import pkgutil
import re
import signal
from pathlib import Path

import pytest

from vdpcp import cli
from vdpcp.cli import build_parser, check
from vdpcp.cli.exit_codes import BY_CODE, COMMANDS, TABLE, Exit, commands_giving, epilog
from vdpcp.matrix import progress

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _doc_rows() -> list[list[str]]:
    """docs/cli.md's exit-code table, a list of cells a row (backticks dropped)."""
    section = DOC.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip().replace("`", "") for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_the_docs_table_is_the_codes_table():
    want = [[str(int(row.code)), row.name, row.meaning, ", ".join(commands_giving(row.code))] for row in TABLE]
    assert _doc_rows() == want


def test_every_code_has_one_row_and_every_command_gives_only_codes_of_the_table():
    assert [row.code for row in TABLE] == list(Exit) and set(BY_CODE) == set(Exit)
    assert len({row.name for row in TABLE}) == len(TABLE)
    assert all(set(codes) <= set(Exit) and Exit.BAD_INPUT in codes for codes in COMMANDS.values())


def test_every_subcommand_states_its_codes():
    modules = {module.name for module in pkgutil.iter_modules(cli.__path__)} - set(cli.HELPERS)
    assert modules == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_subcommands_help_lists_its_own_codes(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    shown = capsys.readouterr().out
    listed = [int(code) for code in re.findall(r"^  (\d+) ", shown.split("exit codes:", 1)[1], re.MULTILINE)]
    assert listed == sorted(int(code) for code in COMMANDS[command])
    assert " ".join(epilog(command).split()) in " ".join(shown.split())


def test_the_top_level_help_lists_the_whole_table():
    shown = build_parser().format_help()
    assert all(f"  {int(row.code):<4} {row.name}:" in shown for row in TABLE)


@pytest.mark.parametrize("verdict, code", [("grad-written", Exit.GRAD_WRITTEN), ("not-sharded", Exit.NOT_SHARDED),
                                           ("unbalanced", Exit.UNBALANCED), ("fail", Exit.FAILED), ("pass", Exit.PASSED)])
def test_checks_verdicts_exit_with_the_tables_codes(verdict, code):
    assert check.exit_code(["pass", verdict]) is code


def test_a_run_stopped_by_a_signal_exits_with_the_tables_code():
    assert progress.Stopped(signal.SIGTERM).exit_code == Exit.TERMINATED
    assert progress.stop_reason(KeyboardInterrupt())[1] == Exit.INTERRUPTED
