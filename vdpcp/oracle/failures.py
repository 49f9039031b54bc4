"""A check's lines as findings: a check says one line or None, and only a line is kept."""

from __future__ import annotations

from vdpcp.matrix.case import Finding


def found(kind: str, rank: int, *lines: str | None) -> list[Finding]:
    """The findings of ``lines`` that say something, of ``kind`` on ``rank``."""
    return [Finding(kind, rank, line) for line in lines if line]


def label(what: str, name: str, outputs: dict) -> str:
    return what if len(outputs) == 1 else f"{what} {name!r}"
