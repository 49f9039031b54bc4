"""What a case does when a rank faults. Once one rank raised, the others get KNOWN_LIMIT_GRACE_S to finish in a
case expected to fail (a known limit on the backend it runs on, or a mutant applied), so an expected failure
costs a tenth of a second, and the harness's default grace in every other case, so a real failure has its
other ranks' reports. A rank that raised, died or hung (the harness's RankFailure) makes the case an error whose
summary carries the harness's text: run_case and run_judged return it, they do not raise.

No rank runs: the harness's run_ranks is replaced by one that records the grace it was given.
"""

import pytest

from vdpcp.contract.protocol import KnownLimit
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.harness import RankFailure
from vdpcp.impls.reference import Reference
from vdpcp.matrix import runner
from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.expectations import KNOWN_LIMIT_GRACE_S
from vdpcp.tools.mutants import MUTANTS

SPEC = MicrobatchSpec(images=((16, 16),) * 3, name="three")
RANK_FAILURE = ("vdpcp.matrix.runner.rank_body (gloo, world size 2) failed on 1 of 2 ranks: rank 1 raised ValueError: "
                "bad grid 1x1")


class GlooLimited(Reference):
    """The reference, declaring an upstream limit on gloo only."""

    name = "gloo-limited"

    def known_limit(self, case, backend):
        return KnownLimit("gloo-limit", "a declared upstream limit on gloo", "gloo-limit-signature") \
            if backend == "gloo" else None


GLOO_LIMITED = GlooLimited()
REFERENCE = Case(SPEC, 2, "reference")
LIMITED = Case(SPEC, 2, "tests.unit.test_case_faults:GLOO_LIMITED")
MUTATED = REFERENCE.with_(mutant=next(iter(MUTANTS)))


@pytest.fixture
def graces(monkeypatch):
    """The fault grace each launch was given; every rank reports a pass, on the backend asked for."""
    given = []

    def launched(body, world_size, case, backend=None, timeout=None, fault_grace=None):
        given.append(fault_grace)
        return [RankResult(r, r, 1, 0, 16, encoded=1, backend=backend, device="cpu") for r in range(world_size)]

    monkeypatch.setattr(runner, "run_ranks", launched)
    return given


@pytest.mark.parametrize("case, grace",
                         [(REFERENCE, None), (LIMITED, KNOWN_LIMIT_GRACE_S), (MUTATED, KNOWN_LIMIT_GRACE_S)],
                         ids=["no-limit-no-mutant", "known-limit", "mutant"])
def test_only_a_case_expected_to_fail_gives_its_other_ranks_the_short_grace(graces, case, grace):
    judged = runner.run_judged(case, backend="gloo")
    assert graces == [grace], judged.result.summary()


def test_a_rank_failure_makes_the_case_an_error_carrying_the_harness_text(monkeypatch):
    def launched(body, world_size, case, backend=None, timeout=None, fault_grace=None):
        raise RankFailure(RANK_FAILURE, {1: "raised ValueError: bad grid 1x1"})

    monkeypatch.setattr(runner, "run_ranks", launched)
    result = runner.run_case(REFERENCE, backend="gloo")
    assert (result.verdict, result.failures) == ("error", [RANK_FAILURE])
    assert result.summary() == f"three-cp2-reference-count: error (on gloo, -)\n  {RANK_FAILURE}"
    judged = runner.run_judged(REFERENCE, backend="gloo")
    assert (judged.verdict, judged.passing) == ("error", False), judged.result.summary()
