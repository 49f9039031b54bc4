"""Verdict precedence and exit codes, pinned for every mix: of what one case's ranks report (wrong results, plan
mismatches, work not distributed, an unencodable spec, a replicating policy, a case error, a rank out of memory,
and a declared known limit met or not), and of verdicts across the cases of a run. The expectations are written
here, as tables, not taken from the code under test; docs/verdicts.md's table is held to the code too.

Pure: results are built by hand, no rank runs.
"""

import itertools
import re
from pathlib import Path

import pytest

from vdpcp.cli import main
from vdpcp.cli.check import exit_code
from vdpcp.contract.protocol import KnownLimit
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix import expectations
from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.runner import CaseResult, Judged
from vdpcp.tools import fuzz
from vdpcp.tools.mutants import hunt

DOC = Path(__file__).resolve().parents[2] / "docs" / "verdicts.md"

# The most telling first; a case's verdict is the first whose condition holds (conditions: `_expected`).
RUN_ORDER = ["resource", "error", "unsharded-error", "fail", "plan-mismatch", "grad-written", "not-sharded", "unbalanced",
             "replicated", "pass"]
JUDGED_ORDER = ["resource", "xfail", "error", "unsharded-error", "fail", "plan-mismatch", "grad-written", "not-sharded",
                "unbalanced", "xpass", "replicated", "pass"]
# A verdict's exit code as the only one besides passes, for `vdpcp check`; a run exits 1 if any of its verdicts
# does (wrong results always win), else 5 if any does, else 3, else 4, else 0.
CHECK_EXIT = {"pass": 0, "replicated": 0, "xfail": 0, "grad-written": 5, "not-sharded": 3, "unbalanced": 4, "resource": 1,
              "error": 1, "unsharded-error": 1, "fail": 1, "plan-mismatch": 1, "xpass": 1}
# `vdpcp replay`: as check, but a rank out of memory and a spec the unsharded encoder rejects are bad input.
REPLAY_EXIT = {**CHECK_EXIT, "resource": 2, "unsharded-error": 2}
# `vdpcp mutants`: a case kills a mutant when its verdict is not passing, but a rank out of memory is no evidence.
KILLS = {verdict: code != 0 for verdict, code in CHECK_EXIT.items()} | {"resource": False}
# `vdpcp fuzz` runs cases unjudged: a finding (exit 1) is a run that failed, not one that could not say.
FINDING = {"error": True, "fail": True, "plan-mismatch": True, "grad-written": True, "not-sharded": True,
           "unbalanced": True, "pass": False, "replicated": False, "unsharded-error": False, "resource": False}

SIGNATURE = "known-limit-signature"
# RankResult fields, each set on its own rank
FLAGS = ("failures", "plan_mismatch", "grad_written", "not_sharded", "unbalanced", "replicated")
FLAG_VERDICT = {"failures": "fail", "plan_mismatch": "plan-mismatch", "grad_written": "grad-written",
                "not_sharded": "not-sharded", "unbalanced": "unbalanced", "replicated": "replicated"}
UNSHARDED = {"none": None, "raised": "ValueError: pixel shuffle needs an even patch grid, got 1x1",
             "oom": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
ERRORS = {"none": None, "raised": "rank 1 raised ValueError: bad grid 1x1",
          "oom": "rank 1 raised torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 GiB"}
CARRY = ("every", "none", "some")  # which failure messages carry the known limit's signature


class NoLimit:
    """A duck-typed implementation that declares no known limit."""

    name = "no-limit"

    def encode(self, model, inputs):
        raise AssertionError("not run here")

    encode_sharded = encode

    def known_limit(self, case, backend):
        return None


class Limited(NoLimit):
    name = "limited"

    def known_limit(self, case, backend):
        return KnownLimit("limited", "a declared upstream limit", SIGNATURE)


NO_LIMIT, LIMITED = NoLimit(), Limited()
SPEC = MicrobatchSpec(images=((16, 16),) * 3, name="three")


def _case(limited: bool) -> Case:
    return Case(SPEC, 3, f"tests.unit.test_verdicts:{'LIMITED' if limited else 'NO_LIMIT'}")


def _built(flags=(), unsharded="none", error="none", limited=False, carry="none"):
    """A CaseResult with each of ``flags`` set on the next rank, the unsharded error and the case error named; and
    whether it reports failure messages, every one carrying the known limit's signature (as ``carry`` says)."""
    carried = []

    def message(text):
        carried.append(carry == "every" or (carry == "some" and len(carried) % 2 == 0))
        return f"{text} ({SIGNATURE})" if carried[-1] else text

    ranks = [RankResult(r, r, 1, 0, 4, backend="gloo") for r in range(3)]
    if UNSHARDED[unsharded] is not None:
        ranks[0].unsharded_error = message(UNSHARDED[unsharded])
    for rank, flag in zip(itertools.cycle(ranks), flags):
        if flag == "replicated":
            rank.replicated = "the policy says so"
        else:
            getattr(rank, flag).append(message(f"{flag}: a message"))
    error_text = None
    if ERRORS[error] is not None:  # an errored case reports its error alone, whatever its ranks said
        carried.clear()
        text = message(ERRORS[error])
        error_text = f"vdpcp.matrix.runner.rank_body (gloo, world size 3) failed on 1 of 3 ranks: {text}\n\n----- {text} -----"
    result = CaseResult(_case(limited), ranks=ranks, error=error_text, backend="gloo")
    return result, bool(carried) and all(carried)


def _expected(order, flags, unsharded, error, limited=False, all_carry=False) -> str:
    ranks_count = error == "none"  # an errored case's ranks' results are not known
    applies = {
        "resource": error == "oom" or (ranks_count and unsharded == "oom"),
        "xfail": limited and all_carry,
        "error": error != "none",
        "unsharded-error": ranks_count and unsharded != "none",
        "xpass": limited,
        "pass": True,
        **{FLAG_VERDICT[f]: ranks_count and f in flags for f in FLAGS},
    }
    return next(verdict for verdict in order if applies[verdict])


def _mixes():
    subsets = [c for n in range(len(FLAGS) + 1) for c in itertools.combinations(FLAGS, n)]
    return list(itertools.product(subsets, UNSHARDED, ERRORS))


def test_a_runs_verdict_is_the_first_that_applies_for_every_mix_of_what_its_ranks_report():
    wrong = []
    for flags, unsharded, error in _mixes():
        got = _built(flags, unsharded, error)[0].verdict
        want = _expected(RUN_ORDER, flags, unsharded, error)
        if got != want:
            wrong.append(f"{flags}, unsharded {unsharded}, error {error}: {got}, expected {want}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("limited, carry", [(False, "none"), *((True, c) for c in CARRY)])
def test_the_judged_verdict_is_the_first_that_applies_with_and_without_a_known_limit(limited, carry):
    wrong = []
    for flags, unsharded, error in _mixes():
        result, all_carry = _built(flags, unsharded, error, limited, carry)
        got = expectations.judge(result)[0]
        want = _expected(JUDGED_ORDER, flags, unsharded, error, limited, all_carry)
        if got != want:
            wrong.append(f"{flags}, unsharded {unsharded}, error {error}: {got}, expected {want}")
    assert not wrong, "\n".join(wrong)


def test_every_set_of_verdicts_across_cases_gives_checks_exit_code_wrong_results_first():
    wrong = []
    for n in range(len(CHECK_EXIT) + 1):
        for verdicts in itertools.combinations(CHECK_EXIT, n):
            codes = {CHECK_EXIT[v] for v in verdicts}
            want = next((code for code in (1, 5, 3, 4) if code in codes), 0)
            for run in (list(verdicts), ["pass", *verdicts, "pass"]):
                if exit_code(run) != want:
                    wrong.append(f"{run}: exit {exit_code(run)}, expected {want}")
    assert not wrong, "\n".join(wrong)


# --- one verdict through each command ---------------------------------------------------------------------


def _showing(verdict: str) -> Judged:
    """A judged result whose verdict is ``verdict``, built as a run that says so would be."""
    built = {"resource": dict(error="oom"), "error": dict(error="raised"), "unsharded-error": dict(unsharded="raised"),
             "xfail": dict(flags=("failures",), limited=True, carry="every"), "xpass": dict(limited=True)}
    built |= {v: dict(flags=(f,)) for f, v in FLAG_VERDICT.items()}
    result = _built(**{"flags": (), **built.get(verdict, {})})[0]
    judged = Judged(result, *expectations.judge(result))
    assert judged.verdict == verdict, f"the result built for {verdict} was judged {judged.verdict}"
    return judged


def _replay_exit(verdict, tmp_path, monkeypatch) -> int:
    import vdpcp.matrix.runner

    spec = tmp_path / "three-cp3.json"
    spec.write_text('{"name": "three-cp3", "images": [[16, 16], [16, 16], [16, 16]]}')
    monkeypatch.setattr(vdpcp.matrix.runner, "preload_case_modules", lambda impls: None)
    monkeypatch.setattr(vdpcp.matrix.runner, "run_judged",
                        lambda case, backend=None, timeout=None, known_limits=True: _showing(verdict))
    return main(["replay", str(spec), "--impl", "tests.unit.test_verdicts:NO_LIMIT"])


@pytest.mark.parametrize("verdict", JUDGED_ORDER)
def test_replay_exits_as_its_table_says(verdict, tmp_path, monkeypatch, capsys):
    assert _replay_exit(verdict, tmp_path, monkeypatch) == REPLAY_EXIT[verdict]


def _kills(verdict, monkeypatch) -> bool:
    monkeypatch.setattr(hunt, "run_judged", lambda case, backend=None, timeout=None: _showing(verdict))
    return hunt.hunt("any-mutant", [_case(False)]).killed


@pytest.mark.parametrize("verdict", JUDGED_ORDER)
def test_a_mutant_is_killed_by_a_verdict_as_the_table_says(verdict, monkeypatch):
    assert _kills(verdict, monkeypatch) is KILLS[verdict]


@pytest.mark.parametrize("verdict", list(FINDING))
def test_fuzz_finds_a_failure_in_a_verdict_as_the_table_says(verdict):
    assert (fuzz.signature(_showing(verdict).result) is not None) is FINDING[verdict]


def test_check_exits_with_the_code_of_its_cases_verdicts(monkeypatch, capsys):
    import vdpcp.matrix.runner

    # (the two cases' verdicts, flags): the exit code; -x stops after the first, so the second is never known
    runs = {(("pass", "not-sharded"), ()): 3, (("not-sharded", "fail"), ()): 1, (("xpass", "not-sharded"), ()): 1,
            (("xfail", "pass"), ()): 0, (("not-sharded", "pass"), ("-x",)): 1}
    monkeypatch.setattr(vdpcp.matrix.runner, "preload_case_modules", lambda impls: None)
    for (verdicts, flags), want in runs.items():
        shown = iter(verdicts)
        monkeypatch.setattr(vdpcp.matrix.runner, "run_judged", lambda case, backend=None, timeout=None, shown=shown: _showing(next(shown)))
        argv = ["check", "--cp", "1", "--impl", "reference", "-k", "three-images-cp1", *flags]
        assert main(argv) == want, f"{' '.join(argv)} with verdicts {verdicts}: expected exit {want}"


# --- docs/verdicts.md ---------------------------------------------------------------------------------------


def _doc_table() -> dict[str, dict[str, str]]:
    """docs/verdicts.md's verdict table: verdict -> {column: cell}."""
    lines = [line for line in DOC.read_text().splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    header, rows = cells[0], cells[2:]  # the second line is the header's rule
    return {row[0].strip("`"): dict(zip(header, row)) for row in rows}


def _number(cell: str) -> int | None:
    found = re.match(r"\d+", cell)
    return int(found.group()) if found else None


def test_the_docs_table_lists_every_verdict_in_the_codes_precedence():
    table = _doc_table()
    assert list(table) == list(expectations.PRECEDENCE), f"{DOC}: verdicts {list(table)}, expected {expectations.PRECEDENCE}"
    ranks = [_number(row["precedence"]) for row in table.values()]
    assert ranks == list(range(1, len(table) + 1)), f"{DOC}: precedence column {ranks}, expected 1..{len(table)}"


def test_the_docs_table_says_each_commands_exit_as_the_code_gives_it(tmp_path, monkeypatch, capsys):
    wrong = []
    for verdict, row in _doc_table().items():
        said = {"check": _number(row["check"]), "replay": _number(row["replay"]),
                "mutants": row["mutants"] == "kills", "fuzz": _number(row["fuzz"])}
        found = {"check": exit_code(["pass", verdict]), "replay": _replay_exit(verdict, tmp_path, monkeypatch),
                 "mutants": _kills(verdict, monkeypatch),
                 "fuzz": None if verdict in expectations.JUDGED else int(fuzz.signature(_showing(verdict).result) is not None)}
        wrong += [f"{verdict} {command}: the doc says {said[command]}, the code gives {found[command]}"
                  for command in said if said[command] != found[command]]
    assert not wrong, "\n".join(wrong)
