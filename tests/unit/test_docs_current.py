"""README.md and docs/ describe the product as it is now: no work-log words (a "session" other than pytest's own,
an issue number), a README short enough to read at once, and no module path that no longer exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_LINES = 150

SESSION = re.compile(r"(?<![\w./-])sessions?\b", re.IGNORECASE)
PYTESTS_OWN = re.compile(r"pytest(?:'s)? $", re.IGNORECASE)  # "a pytest session", "pytest's session"
ISSUE = re.compile(r"\bissues? #?\d+|\(issue", re.IGNORECASE)
MODULE_PATH = re.compile(r"(?<![\w/.-])vdpcp/[\w/.-]*\.py\b")


def ids(pages):
    return [page.relative_to(ROOT).as_posix() for page in pages]


def sessions_not_pytests(text: str) -> list[str]:
    """Each "session" in ``text`` that is not pytest's own term, with a little of its context."""
    return [text[max(0, m.start() - 30) : m.end() + 10].replace("\n", " ") for m in SESSION.finditer(text)
            if not PYTESTS_OWN.search(text[max(0, m.start() - 9) : m.start()])]


def test_the_session_finder_spares_pytests_own_term_and_identifiers():
    text = "a pytest session, pytest's session, test_sessions.py, pytest_sessionstart; the last session ran"
    hits = sessions_not_pytests(text)
    assert len(hits) == 1 and hits[0].endswith("the last session ran"), hits


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_no_page_names_a_session_or_an_issue_number(page):
    text = page.read_text()
    assert not sessions_not_pytests(text), sessions_not_pytests(text)
    assert not ISSUE.findall(text), [text[max(0, m.start() - 30) : m.end() + 10] for m in ISSUE.finditer(text)]


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines, over {README_LINES}"


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_every_module_path_a_page_cites_exists(page):
    cited = set(MODULE_PATH.findall(page.read_text()))
    assert not {path for path in cited if not (ROOT / path).is_file()}
