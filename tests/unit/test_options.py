"""Every numeric option of every command refuses a value outside its range up front: one line naming the option
and the accepted range, exit 2 (pytest: a usage error), and no rank started. The table below is the range each
option is held to; a numeric option missing from it fails too."""

import argparse
import itertools

import pytest

from vdpcp import pytest_plugin
from vdpcp.cli import build_parser, main
from vdpcp.harness.pool import WorkerPool

pytest_plugins = ["pytester"]

# (command line before the option, option, a value out of its range, the range the message must state)
REFUSED = [
    (["check"], "--cp", "0", ">= 1"),
    (["check"], "--timeout", "0", "> 0"),
    (["check"], "--timeout", "-1", "> 0"),
    (["check"], "--timeout", "nan", "> 0"),
    (["check"], "--maxfail", "-1", ">= 0"),
    (["check"], "--maxfail", "1.5", ">= 0"),
    (["check"], "--max-spec-bytes", "0", "positive number of bytes"),
    (["check"], "--max-case-tflop", "0", "> 0"),
    (["replay", "x-cp2.json"], "--cp", "0", ">= 1"),
    (["replay", "x-cp2.json"], "--timeout", "-1", "> 0"),
    (["replay", "x-cp2.json"], "--max-spec-bytes", "-1", "a number of bytes"),
    (["fuzz"], "--cp", "0", ">= 1"),
    (["fuzz", "--cp", "2"], "--budget", "0", ">= 1"),
    (["fuzz", "--cp", "2"], "--seed", "-1", ">= 0 and <= 4294967295"),
    (["fuzz", "--cp", "2"], "--seed", str(2**32), ">= 0 and <= 4294967295"),
    (["fuzz", "--cp", "2"], "--timeout", "0", "> 0"),
    (["fuzz", "--cp", "2"], "--max-spec-bytes", "0", "positive number of bytes"),
    (["mutants"], "--timeout", "0", "> 0"),
    (["mutants"], "--maxfail", "-1", ">= 0"),
    (["mutants"], "--max-case-tflop", "-1", "> 0"),
    (["replay", "x-cp2.json"], "--max-case-tflop", "0", "> 0"),
    (["fuzz", "--cp", "2"], "--max-case-tflop", "0", "> 0"),
    (["ab"], "--cp", "1", ">= 2"),
    (["ab"], "--steps", "0", ">= 1"),
    (["ab"], "--accumulate", "0", ">= 1"),
    (["ab"], "--seed", "-1", ">= 0 and <= 4294967295"),
    (["ab"], "--timeout", "-1", "> 0"),
    (["balance"], "--seed", "-1", ">= 0 and <= 4294967295"),
    (["balance"], "--seeds", "0", ">= 1"),
    (["balance"], "--samples", "0", ">= 1"),
    (["balance"], "--patch-dim", "0", ">= 1"),
    (["balance"], "--cp", "0", ">= 1"),
    (["balance"], "--alpha", "-1", ">= 0"),
    (["bench", "faults"], "--world-size", "1", ">= 2"),
    (["bench", "faults"], "--passes", "0", ">= 1"),
    (["bench", "faults"], "--repeats", "0", ">= 1"),
    (["bench", "faults"], "--grace", "-1", ">= 0"),
    (["bench", "harness"], "--cases", "0", ">= 1"),
    (["bench", "harness"], "--spawn-tests", "0", ">= 1"),
    (["bench", "harness"], "--world-size", "0", ">= 1"),
    (["bench", "memory"], "--seeds", "0", ">= 1"),
    (["bench", "memory"], "--samples", "0", ">= 1"),
    (["bench", "memory"], "--cp", "0", ">= 1"),
    (["bench", "memory"], "--layers", "0", ">= 1"),
    (["bench", "memory"], "--reps", "0", ">= 1"),
    (["bench", "wire"], "--seed", "-1", ">= 0 and <= 4294967295"),
    (["bench", "wire"], "--cp", "0", ">= 1"),
    (["bench", "towers"], "--cp", "0", ">= 1"),
    (["bench", "towers"], "--timeout", "0", "> 0"),
    (["bench", "towers"], "--max-case-tflop", "-1", "> 0"),
    (["bench", "sensitivity"], "--cp", "0", ">= 1"),
    (["bench", "sensitivity"], "--timeout", "0", "> 0"),
    (["bench", "sensitivity"], "--grid", "2", "> 0 and <= 1"),
]
PYTEST_REFUSED = [("--vdpcp-timeout", "0", "> 0"), ("--vdpcp-cp", "0", ">= 1"), ("--replay-cp", "0", ">= 1"),
                  ("--vdpcp-max-case-tflop", "0", "> 0")]


@pytest.fixture
def no_rank_starts(monkeypatch):
    def start(*args, **kwargs):
        raise AssertionError("a rank started for a command line that should have been refused")

    monkeypatch.setattr(WorkerPool, "run", start)


@pytest.mark.parametrize("before, option, value, expected", REFUSED,
                         ids=[f"{' '.join(b)} {o} {v}" for b, o, v, _ in REFUSED])
def test_a_value_out_of_range_is_one_line_exit_2(before, option, value, expected, capsys, no_rank_starts):
    assert main([*before, option, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err and expected in err, \
        f"{' '.join(before)} {option} {value}: said {err!r}, expected one line naming {option} and {expected!r}"


def _options(parser, command=()):
    """(subcommand words, action) of every option of ``parser`` and of its subcommands, theirs too."""
    for action in parser._actions:
        if action.nargs == argparse.PARSER:
            for name, sub in action.choices.items():
                yield from _options(sub, (*command, name))
        else:
            yield command, action


def test_every_numeric_option_parses_through_the_range_helper_and_is_in_the_table():
    options = list(_options(build_parser()))
    raw = [(command, action.option_strings) for command, action in options if action.type in (int, float)]
    assert not raw, f"options parsed as a bare int or float, with no range: {raw}"
    ranged = {(command, option) for command, action in options if hasattr(action.type, "expected")
              for option in action.option_strings if option.startswith("--")}
    tabled = {(tuple(itertools.takewhile(str.isalpha, before)), option) for before, option, _, _ in REFUSED}
    assert not ranged - tabled, f"numeric options with no row in REFUSED: {sorted(ranged - tabled)}"


class _Options:
    """Records the pytest plugin's options as a pytest parser would take them."""

    def __init__(self):
        self.types = {}

    def getgroup(self, *args):
        return self

    def addoption(self, name, **kwargs):
        self.types[name] = kwargs.get("type")

    def addini(self, *args, **kwargs):
        pass


def test_every_numeric_option_of_the_pytest_plugin_has_a_range_and_is_in_the_table():
    options = _Options()
    pytest_plugin.pytest_addoption(options)
    pytest_plugin.pytest_addoption_replay(options)
    assert not [name for name, kind in options.types.items() if kind in (int, float)]
    ranged = {name for name, kind in options.types.items() if hasattr(kind, "expected")}
    assert ranged == {option for option, _, _ in PYTEST_REFUSED}


@pytest.mark.parametrize("option, value, expected", PYTEST_REFUSED, ids=[o for o, _, _ in PYTEST_REFUSED])
def test_the_pytest_plugin_refuses_a_value_out_of_range_as_a_usage_error(option, value, expected, pytester, no_rank_starts):
    result = pytester.runpytest(f"{option}={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert any(option in line and expected in line for line in result.errlines), result.errlines


NON_FINITE = ("inf", "-inf", "nan")
OPTIONS = list(dict.fromkeys((tuple(before), option) for before, option, _, _ in REFUSED))


@pytest.mark.parametrize("before, option", OPTIONS, ids=[f"{' '.join(b)} {o}" for b, o in OPTIONS])
def test_a_non_finite_number_is_refused_by_every_numeric_option(before, option, capsys, no_rank_starts):
    """inf passes any lower bound (--timeout inf would wait for a hung rank forever) and nan fails every comparison
    the wrong way round in code that asks `value > limit`: each is one line naming the option, exit 2. Given as
    --option=value: argparse takes a bare -inf for an option of its own."""
    for value in NON_FINITE:
        assert main([*before, f"{option}={value}"]) == 2, f"{' '.join(before)} {option}={value} was accepted"
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and option in err and repr(value) in err, err


@pytest.mark.parametrize("option", [o for o, _, _ in PYTEST_REFUSED])
def test_the_pytest_plugin_refuses_a_non_finite_number_as_a_usage_error(option, pytester, no_rank_starts):
    for value in NON_FINITE:
        result = pytester.runpytest(f"{option}={value}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, (option, value)
        assert any(option in line and repr(value) in line for line in result.errlines), result.errlines
