"""Bad input, as every front end reports it: UsageError (exit code 2, one clear message) and ``number``, the
argparse type that refuses a number out of its range. A leaf, so that the modules the command line uses (the
reports, --maxfail) need not import the command line back."""

import argparse
import math


class UsageError(Exception):
    """Bad input on the command line or in a spec file: exit code 2, one clear message."""


def number(kind=int, low=None, high=None, *, above: bool = False, note: str = ""):
    """An argparse ``type=`` for a finite ``kind`` (int or float) from ``low`` to ``high``, both included (either
    may be None: no bound; ``above``: ``low`` itself is out). Whatever is out of range, or not such a number, is
    refused as the command line is parsed, before anything runs, naming the range (and ``note``: why that range)."""
    shown = str if kind is int else "{:g}".format
    bounds = [f"{'>' if above else '>='} {shown(low)}"] if low is not None else []
    bounds += [f"<= {shown(high)}"] if high is not None else []
    expected = " ".join(["an integer" if kind is int else "a number", " and ".join(bounds)]).strip()

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        inside = (low is None or (value > low if above else value >= low)) and (high is None or value <= high)
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}" + (f" ({note})" if note else ""))
        return value

    convert.expected = expected  # tests/unit/test_options.py finds every numeric option by it
    return convert
