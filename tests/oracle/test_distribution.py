"""Did it shard? The oracle's own verdicts on implementations that are right in their results but not in how
they distribute the work, and on several outputs per encode (tests/oracle/subjects.py)."""

import pytest
import torch

from vdpcp.contract.protocol import Ownership
from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.runner import run_judged
from vdpcp.matrix.scenarios import SCENARIOS
from vdpcp.oracle.observe import split

SPECS = {s.spec.name: s.spec for s in SCENARIOS}
SUBJECTS = "tests.oracle.subjects"


def _judge(name: str, spec: str, cp: int, **case):
    return run_judged(Case(SPECS[spec], cp, f"{SUBJECTS}:{name}", **case))


@pytest.mark.distributed
@pytest.mark.parametrize("loss", ["rank", "zigzag"])
@pytest.mark.parametrize("spec, cp", [("three-images", 2), ("eleven-images", 4), ("video-and-images", 2)])
def test_a_run_that_did_not_shard_never_passes_under_any_loss(spec, cp, loss):
    judged = _judge("replicating", spec, cp, loss=loss)
    assert judged.verdict == "not-sharded", judged.result.summary()
    assert not judged.passing
    headline = judged.result.failures[0]
    assert headline.startswith("rank 0: not sharded: every CP rank's tower read all"), headline
    # what really ran is what the report shows: every rank, every row
    rows = len(SPECS[spec].images)
    assert [r.images for r in judged.result.ranks] == [rows] * cp


@pytest.mark.distributed
def test_the_same_replication_is_correct_where_sharding_is_off():
    judged = _judge("replicating", "three-images", 2, vision_dp_over_cp=False)
    assert judged.verdict == "pass", judged.result.summary()


@pytest.mark.distributed
def test_a_stated_plan_that_execution_contradicts_is_a_plan_mismatch_not_a_gradient_error():
    judged = _judge("stale_plan", "eleven-images", 2)
    assert judged.verdict == "plan-mismatch", judged.result.summary()
    messages = judged.result.failures
    assert all("plan mismatch" in m for m in messages), messages
    assert "encoded on rank" in messages[0] and "the plan says rank" in messages[0], messages[0]
    assert not any("grads" in m for m in messages), messages


@pytest.mark.distributed
@pytest.mark.parametrize("spec, verdict", [("three-images", "replicated"), ("eleven-images", "pass")])
def test_a_fallback_policy_is_expected_on_its_side_of_the_threshold(spec, verdict):
    judged = _judge("thresholded", spec, 2)
    assert judged.verdict == verdict, judged.result.summary()
    if verdict == "replicated":
        assert judged.passing and "fewer than 4 images" in judged.why


@pytest.mark.distributed
def test_sharding_where_the_policy_says_replicate_is_a_mismatch():
    judged = _judge("ignores_its_policy", "three-images", 2)
    assert judged.verdict == "plan-mismatch", judged.result.summary()
    assert "fewer than 4 images" in judged.result.failures[0]


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_output_is_checked_and_a_right_pair_passes(cp):
    judged = _judge("two_outputs", "eleven-images", cp)
    assert judged.verdict == "pass", judged.result.summary()


@pytest.mark.distributed
def test_a_secondary_output_left_ungathered_fails_and_the_report_names_it():
    judged = _judge("second_output_ungathered", "eleven-images", 2)
    assert judged.verdict == "fail", judged.result.summary()
    assert any("outputs 'deepstack0'" in m for m in judged.result.failures), judged.result.failures
    assert not any("outputs 'features'" in m for m in judged.result.failures), judged.result.failures


def test_a_plan_for_fewer_rows_than_ran_is_held_to_the_rows_it_covers():
    read = torch.tensor([[True, False, False], [False, True, True]])  # rows 0, 1, 2 on ranks 0, 1, 1
    result = RankResult(0)
    result.add(split.judge_distribution(result.rank, read, Ownership(owner=(1, 1), tokens=(4, 4), placeholders=(0, 0)),
                                        True, False))
    assert result.plan_mismatch == ["plan mismatch: row 0 encoded on rank 0, the plan says rank 1"], result.plan_mismatch


@pytest.mark.distributed
def test_one_image_encoded_on_every_rank_is_not_sharded():
    judged = _judge("replicating", "one-image", 2)
    assert judged.verdict == "not-sharded", judged.result.summary()
