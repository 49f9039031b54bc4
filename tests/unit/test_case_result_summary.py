"""A case's summary paragraph, as the JUnit report and every failing assertion print it, pinned line by line: the
first line names the case, its verdict, the backend it ran on and its ranks' devices ("?" and "-" where none is
known, as for a case that errored before any rank reported); a replication line only where a rank's policy
replicated the microbatch; one line per rank, with the rows its tower saw where that was measured (0 rows
included; -1, not measured, shows none); then the failures.

Pure: results are built by hand, no rank runs.
"""

from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.runner import CaseResult

SPEC = MicrobatchSpec(images=((16, 16),) * 3, name="three")
CASE = Case(SPEC, 2, "reference")
RANK_FAILURE = ("vdpcp.matrix.runner.rank_body (gloo, world size 2) failed on 1 of 2 ranks: rank 1 raised ValueError: "
                "bad grid 1x1")


def test_each_rank_has_its_line_with_the_rows_its_tower_saw_zero_included():
    ranks = [RankResult(0, 0, 3, 0, 48, encoded=3, backend="nccl", device="cuda:0"),
             RankResult(1, 1, 0, 1, 0, encoded=0, backend="nccl", device="cuda:1")]  # owns no image: saw 0 rows
    assert CaseResult(CASE, ranks, backend="nccl").summary() == "\n".join([
        "three-cp2-reference-count: pass (on nccl, cuda:0,cuda:1)",
        "  rank 0: 3 images, 0 placeholders, 48 patches, its tower saw 3 rows",
        "  rank 1: 0 images, 1 placeholders, 0 patches, its tower saw 0 rows",
    ])


def test_a_rank_whose_tower_was_not_measured_shows_no_row_count():
    ranks = [RankResult(0, 0, 2, 0, 32, backend="gloo", device="cpu"),  # encoded = -1: not measured
             RankResult(1, 1, 1, 0, 16, encoded=1, backend="gloo", device="cpu")]
    assert CaseResult(CASE, ranks, backend="gloo").summary() == "\n".join([
        "three-cp2-reference-count: pass (on gloo, cpu)",
        "  rank 0: 2 images, 0 placeholders, 32 patches",
        "  rank 1: 1 images, 0 placeholders, 16 patches, its tower saw 1 rows",
    ])


def test_a_replicating_policy_is_named_once_above_the_rank_lines():
    why = "below min_tokens: 3 images of 16 merged tokens"
    ranks = [RankResult(r, r, 3, 0, 48, encoded=3, replicated=why, backend="gloo", device="cpu") for r in range(2)]
    assert CaseResult(CASE, ranks, backend="gloo").summary() == "\n".join([
        "three-cp2-reference-count: replicated (on gloo, cpu)",
        f"  replicated by the implementation's policy: {why}",
        "  rank 0: 3 images, 0 placeholders, 48 patches, its tower saw 3 rows",
        "  rank 1: 3 images, 0 placeholders, 48 patches, its tower saw 3 rows",
    ])


def test_a_case_that_errored_before_any_rank_reported_shows_unknown_backend_and_devices():
    result = CaseResult(CASE, error=RANK_FAILURE)
    assert result.device == "-"
    assert result.summary() == f"three-cp2-reference-count: error (on ?, -)\n  {RANK_FAILURE}"


def test_failures_follow_the_rank_lines():
    ranks = [RankResult(0, 0, 2, 0, 32, encoded=2, backend="gloo", device="cpu"),
             RankResult(1, 1, 1, 0, 16, encoded=1, failures=["outputs 'features' differ"],
                        backend="gloo", device="cpu")]
    assert CaseResult(CASE, ranks, backend="gloo").summary().splitlines()[1:] == [
        "  rank 0: 2 images, 0 placeholders, 32 patches, its tower saw 2 rows",
        "  rank 1: 1 images, 0 placeholders, 16 patches, its tower saw 1 rows",
        "  rank 1: outputs 'features' differ",
    ]
