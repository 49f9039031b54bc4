"""docs/power.md's table of the field's bug classes, held to the code: it cannot name a mutant or case that
does not exist, call a mutant generic that is not, or claim a generic mutant proven on fewer than two shipped
subjects; and each generic mutant it names is run against one of the subjects it claims besides the reference (the
cheapest: mcore, or qwen2_5_vl for a bug of where host pixels go, which only a subject that moves its own pixels
can carry; the whole proof over the four subjects is the measured run the page records)."""

import re
from pathlib import Path

import pytest

from vdpcp.cli.mutants import kill_set
from vdpcp.matrix import scenarios
from vdpcp.tools.mutants import MUTANTS
from vdpcp.tools.mutants.hunt import hunt

POWER = Path(__file__).resolve().parents[2] / "docs" / "power.md"
SHIPPED = ("reference", "mcore", "qwen2_5_vl", "automodel")
FIELD_BUGS = 18  # the rows of docs/power.md's survey of bugs the field shipped
# The cheapest shipped subjects besides the reference, cheapest first (mcore: the toy tower under MCore's gather).
RUN_ON = ("mcore", "qwen2_5_vl")
# A rank that skips the backward collective hangs MCore's gather on gloo (its peer waits in a scatter): the kill is
# the case's timeout, so the test waits a short one. Any other mutant of the table is killed within seconds.
TIMEOUT_S = {"last-rank-skips-backward-collective": 5.0}  # it hangs its peers: killed at the timeout, idle till then


def _table() -> list[dict[str, str]]:
    """The rows of the first table of the section "The field's bug classes", by column."""
    section = POWER.read_text().split("## The field's bug classes", 1)[1]
    lines = section[section.index("\n|") + 1:].split("\n\n", 1)[0].splitlines()  # the section's first table
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


ROWS = _table()


def _named(cell: str) -> list[str]:
    """The mutants and cases a cell names: its quoted words that look like them (code quoted in prose is not)."""
    return [q for q in re.findall(r"`([^`]+)`", cell) if re.fullmatch(r"[a-z0-9]+(-[a-z0-9_]+)+", q)]


def _generic(row) -> list[str]:
    return _named(row["generic mutant"])


def test_the_table_has_a_row_for_every_field_bug():
    numbers = {int(re.match(r"\d+", row["bug"]).group()) for row in ROWS}
    assert numbers == set(range(1, FIELD_BUGS + 1)), sorted(numbers)


def test_every_mutant_and_case_the_table_names_exists():
    cases = {case.id for case in scenarios.matrix()}
    for row in ROWS:
        for name in _named(row["killed in vdpcp's matrix by"]):
            assert name in MUTANTS or name in cases, f"bug {row['bug']}: {name!r} is neither a mutant nor a matrix case"


def test_a_class_vdpcp_does_not_catch_says_why_and_names_nothing_as_its_killer():
    for row in ROWS:
        killer = row["killed in vdpcp's matrix by"]
        if killer.startswith("not caught"):
            assert len(killer.split(":", 1)[1].split()) >= 10, f"bug {row['bug']} says too little of why: {killer!r}"
            assert not _generic(row) and not row["proven on"], row
        else:
            assert _named(killer), f"bug {row['bug']}: neither a mutant or case that kills it, nor why not"


def test_every_generic_mutant_row_is_generic_and_proven_on_two_shipped_subjects():
    for row in ROWS:
        subjects = [s.strip() for s in row["proven on"].split(",") if s.strip()]
        assert all(s in SHIPPED for s in subjects), f"bug {row['bug']}: {subjects} are not all shipped subjects"
        for name in _generic(row):
            assert name in MUTANTS and MUTANTS[name].generic, f"bug {row['bug']}: {name!r} is not a generic mutant"
            assert len(subjects) >= 2 and set(RUN_ON) & set(subjects), f"bug {row['bug']}: {name} proven on {subjects}"


GENERIC = sorted({name for row in ROWS for name in _generic(row)})


def _run_on(name: str) -> str:
    """The cheapest subject that every row naming ``name`` claims it was proven on."""
    claimed = [{s.strip() for s in row["proven on"].split(",")} for row in ROWS if name in _generic(row)]
    return next(s for s in RUN_ON if all(s in subjects for subjects in claimed))


@pytest.mark.distributed
@pytest.mark.parametrize("name", GENERIC)
def test_a_generic_mutant_of_the_table_fails_another_subject_than_the_reference(name):
    subject = _run_on(name)
    matrix = scenarios.matrix(impls=(subject,))
    first = kill_set(MUTANTS[name].kills, matrix, subject)[:1]
    assert first, f"{name}: its kill set has no case in {subject}'s matrix"
    found = hunt(name, first, timeout=TIMEOUT_S.get(name, 60.0))
    assert found.killed, f"{name} ({MUTANTS[name].bug}) survived {found.tried} of {subject}"
