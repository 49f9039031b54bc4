"""A check's failure line into its result: a check returns one line or None, and only a line is kept."""

from __future__ import annotations

from vdpcp.matrix.case import RankResult


def fail(result: RankResult, why: str | None) -> None:
    fail_into(result.failures, why)


def fail_into(lines: list[str], why: str | None) -> None:
    if why:
        lines.append(why)


def label(what: str, name: str, outputs: dict) -> str:
    return what if len(outputs) == 1 else f"{what} {name!r}"
