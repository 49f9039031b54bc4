"""docs/known-limits.md's table of the bugs vdpcp found in released or public code: every row's replay, run as the
row's command runs it, still fails, and the way its file says it failed when it was recorded (vdpcp.tools.fuzz.signature,
the file's ``expect.signature``); every saved case under docs/found is a row's; a row without a replay says why."""

import re
from pathlib import Path

import pytest

from vdpcp.matrix import saved
from vdpcp.matrix.runner import run_judged
from vdpcp.tools.fuzz import signature

ROOT = Path(__file__).resolve().parents[2]
FOUND = ROOT / "docs" / "known-limits.md"
REPLAY = re.compile(r"`\./run vdpcp replay (?P<path>\S+\.json)(?P<flags>[^`]*)`")


def _rows() -> list[list[str]]:
    """The table's body rows, as cells (the header and its rule left out)."""
    lines = [line for line in FOUND.read_text().splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def _replays() -> list[tuple[str, bool]]:
    """(the saved case a row replays, whether its command sets the known limits aside), row by row."""
    found = []
    for row in _rows():
        match = REPLAY.search(row[-1])
        if match:
            found.append((match["path"], "--no-known-limits" in match["flags"]))
    return found


def test_every_row_replays_a_saved_case_or_says_why_there_is_none():
    rows = _rows()
    assert len(rows) >= 6
    for row in rows:
        assert len(row) == 3, row
        assert REPLAY.search(row[2]) or (row[2] == "(none)" and "nothing to replay" in row[1]), row


def test_every_saved_case_under_docs_found_is_a_rows():
    named = {path for path, _ in _replays()}
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "found").glob("*.json")}
    assert on_disk and on_disk <= named
    assert all((ROOT / path).is_file() for path in named), named - on_disk


@pytest.mark.parametrize("path, aside", _replays(), ids=[Path(p).stem for p, _ in _replays()])
def test_the_replay_still_fails_as_recorded(path, aside):
    found = saved.load(ROOT / path)
    assert found.signature, f"{path}: no expect.signature to hold the finding to"
    judged = run_judged(found.to_case(), backend="gloo", known_limits=not aside)
    assert judged.verdict in ("fail", "error", "grad-written"), judged.result.summary()
    assert signature(judged.result) == found.signature, judged.result.summary()
