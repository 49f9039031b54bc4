"""The judge of known limits: only a failure that carries the declared signature is an xfail. Any other failure
on a known-limit case (a check failure of another kind, another rank's other failure, an error of another
kind) keeps its own verdict, and the signature counts only in what failed, never in the case's name.

Pure: results are built by hand, no rank runs.
"""

import pytest

from vdpcp.contract.protocol import GROUP_MISMATCH_TEXT, KnownLimit
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix import expectations
from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.runner import CaseResult

SIGNATURE = "param grads (summed over ranks)"
LIMIT = KnownLimit("rounds-inside", "the tower rounds to float32 inside", SIGNATURE)


class Limited:
    """A duck-typed implementation that declares LIMIT on every case: its gradient check is known to fail."""

    name = "limited"

    def encode(self, model, inputs):
        raise AssertionError("not run here")

    encode_sharded = encode

    def known_limit(self, case, backend):
        return LIMIT


class Empty(Limited):
    """Declares that its tower cannot encode an empty microbatch, even unsharded."""

    def known_limit(self, case, backend):
        return KnownLimit("empty", "cannot encode nothing", "expected a non-empty list of Tensors")


LIMITED, EMPTY = Limited(), Empty()
SPEC = MicrobatchSpec(images=((16, 16),) * 3, name="three")
CASE = Case(SPEC, 2, "tests.unit.test_judge:LIMITED")
OUTPUTS = "outputs: Tensor-likes are not close! (max abs error 0.52)"
PARAMS = f"{SIGNATURE}: Tensor-likes are not close! (max abs error 3e-07)"


def _result(case, *per_rank, error=None, unsharded=None, backend="gloo"):
    ranks = [] if error else [RankResult(r, r, 1, 0, 4, failures=list(f), backend=backend, unsharded_error=unsharded)
                              for r, f in enumerate(per_rank)]
    return CaseResult(case, ranks=ranks, error=error, backend=backend)


def test_the_declared_check_failure_on_every_rank_is_an_xfail():
    assert expectations.judge(_result(CASE, [PARAMS], [PARAMS]))[0] == "xfail"


def test_a_check_failure_of_another_kind_on_a_known_limit_case_fails():
    verdict, why = expectations.judge(_result(CASE, [OUTPUTS], [OUTPUTS]))
    assert verdict == "fail" and verdict not in expectations.PASSING
    assert "expected rounds-inside" in why and "outputs" in why


def test_the_declared_failure_does_not_cover_another_kind_beside_it():
    assert expectations.judge(_result(CASE, [PARAMS, OUTPUTS], [PARAMS]))[0] == "fail"  # same rank
    verdict, why = expectations.judge(_result(CASE, [PARAMS], [OUTPUTS]))  # another rank
    assert verdict == "fail" and "rank 1: outputs" in why


def test_the_signature_in_the_case_name_is_not_the_failure():
    named = Case(MicrobatchSpec(images=((16, 16),) * 3, name=f"where {SIGNATURE} once failed"), 2, CASE.impl)
    result = _result(named, [OUTPUTS], [])
    assert SIGNATURE in result.summary()
    assert expectations.judge(result)[0] == "fail", result.summary()


def test_a_passing_known_limit_case_is_an_xpass_and_fails():
    verdict, _ = expectations.judge(_result(CASE, [], []))
    assert verdict == "xpass" and verdict not in expectations.PASSING


SCATTER, SUBGROUP = "ProcessGroupGloo::scatter: invalid tensor size", "is not part of group"
# A collective limit ranks meet two ways (a shape error on the first group's ranks, a group error on the others):
# which rank raises first decides the case's text.
TWO_WAYS = KnownLimit("two-ways", "a gloo collective that fails two ways", SUBGROUP, alternatives=(SCATTER,))


class Raising(Limited):
    """Declares a limit whose failure is an error a rank raises; TWO_WAYS in a CP x DP layout."""

    def known_limit(self, case, backend):
        if backend != "gloo":
            return None
        return TWO_WAYS if case.dp > 1 else KnownLimit("scatter", "a gloo scatter of uneven sizes", SCATTER)


RAISING = Raising()


@pytest.mark.parametrize("text, verdict", [
    (f"failed on 2 of 2 ranks: rank 0 raised RuntimeError: {SCATTER}; rank 1 hung", "xfail"),
    ("failed on 2 of 2 ranks: rank 0 raised RuntimeError: Connection closed by peer; rank 1 hung", "error"),
])
def test_an_error_is_an_xfail_only_with_the_signature(text, verdict):
    case = Case(SPEC, 2, "tests.unit.test_judge:RAISING")
    assert expectations.known_limit(case, "gloo").signature == SCATTER
    assert expectations.known_limit(case, "nccl") is None
    assert expectations.judge(_result(case, error=text))[0] == verdict


@pytest.mark.parametrize("text, verdict", [
    (f"failed on 4 of 4 ranks: rank 0 raised RuntimeError: {SCATTER} at index 1; rank 1 hung; rank 2 hung", "xfail"),
    (f"failed on 4 of 4 ranks: rank 2 raised ValueError: Global rank 0 {SUBGROUP} 1; rank 0 hung", "xfail"),
    ("failed on 4 of 4 ranks: rank 0 raised RuntimeError: Connection closed by peer; rank 1 hung", "error"),
], ids=["first-group-scatter", "other-group-subgroup", "neither"])
def test_a_limit_met_two_ways_is_an_xfail_with_either_signature_and_only_then(text, verdict):
    layered = Case(SPEC, 2, "tests.unit.test_judge:RAISING", dp=2)
    assert expectations.known_limit(layered, "gloo") is TWO_WAYS
    verdict_seen, why = expectations.judge(_result(layered, error=text))
    assert verdict_seen == verdict, why
    if verdict == "error":
        assert repr(SUBGROUP) in why and repr(SCATTER) in why  # the why names every text it would have taken


def test_a_check_failure_on_a_case_whose_limit_is_an_error_fails():
    uneven = Case(SPEC, 2, "tests.unit.test_judge:RAISING")
    assert expectations.judge(_result(uneven, [OUTPUTS], []))[0] == "fail"


def test_an_unsharded_error_is_an_xfail_only_with_the_signature():
    raised = "RuntimeError: torch.cat(): expected a non-empty list of Tensors"
    case = Case(SPEC, 2, "tests.unit.test_judge:EMPTY")
    assert expectations.judge(_result(case, [], [], unsharded=raised))[0] == "xfail"
    assert expectations.judge(_result(case, [], [], unsharded="ValueError: odd grid"))[0] == "unsharded-error"


MISMATCH = Case(MicrobatchSpec(images=((16, 16),), name="m"), 2, config_cp=4)
DOCUMENTED = (f"reference: {GROUP_MISMATCH_TEXT}: context_parallel_size=4 but the CP group has 2 ranks")


def _raised(message, *ranks):
    return "failed on 2 of 2 ranks: " + "; ".join(f"rank {r} raised GroupMismatchError: {message}" for r in ranks)


def test_a_group_mismatch_is_judged_on_the_headline_whatever_the_tracebacks_below_say():
    tracebacks = "\n----- rank 0: raised GroupMismatchError -----\nTraceback (most recent call last):\n  File ..."
    assert expectations.judge(_result(MISMATCH, error=_raised(DOCUMENTED, 0, 1) + tracebacks))[0] == "pass"
    below_only = _raised(DOCUMENTED, 0) + "; rank 1 exited with code 1\n" + _raised(DOCUMENTED, 1)
    verdict, why = expectations.judge(_result(MISMATCH, error=below_only))
    assert verdict == "fail" and why == "rank 1 did not raise the documented GroupMismatchError"


@pytest.mark.parametrize("missing", ["context_parallel_size=4", "2 ranks"])
def test_a_group_mismatch_error_must_name_both_sizes_itself(missing):  # "of 2 ranks" in the harness's words is not it
    message = DOCUMENTED.replace(missing, "?")
    verdict, why = expectations.judge(_result(MISMATCH, error=_raised(message, 0, 1)))
    assert verdict == "fail" and why == f"the error does not name {missing!r}"


def test_the_why_of_a_known_limit_that_failed_otherwise_names_the_first_other_failure():
    verdict, why = expectations.judge(_result(CASE, [OUTPUTS, PARAMS, "input grads: wrong"], []))
    assert verdict == "fail" and why.endswith(f": rank 0: {OUTPUTS}")
