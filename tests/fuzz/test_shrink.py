"""Shrinking keeps the first failure's signature: a smaller spec that fails another way is not kept, saved or
reported as the finding. A fake runner stands in for the ranks, so the whole search takes milliseconds."""

import json

from vdpcp.matrix.case import RankResult
from vdpcp.matrix.runner import CaseResult
from vdpcp.tools import fuzz
from vdpcp.tools.fuzz import Search, signature

WRONG_SHAPE = "outputs: shape (2, 48), expected (1, 48)"  # the first failure: specs of two media items or more
WRONG_PLAN = "row 0 encoded on rank 0, the plan says rank 1"  # one media item, once anything failed


class Runner:
    """Fails a spec of two or more media items with a wrong output; before that first failure a single item
    passes, after it a single item fails another way (a plan mismatch): a shrinker that keeps any failure
    ends on one item."""

    def __init__(self):
        self.failed = False

    def __call__(self, case, backend=None, timeout=None, fault_grace=None) -> CaseResult:
        rank = RankResult(0, 0, len(case.spec.images), 0, 4, backend="gloo")
        if len(case.spec.media_frames) >= 2:
            self.failed = True
            rank.failures.append(WRONG_SHAPE)
        elif self.failed:
            rank.plan_mismatch.append(WRONG_PLAN)
        return CaseResult(case, ranks=[rank], backend="gloo")


def test_the_shrunk_and_saved_spec_fails_the_way_the_first_failure_did(tmp_path, monkeypatch):
    runner = Runner()
    monkeypatch.setattr(fuzz, "run_case", runner)
    seen = []
    report = fuzz.fuzz(Search(cp=2, budget=50), tmp_path, on_run=lambda report, spec, result: seen.append(result))
    first = next(signature(result) for result in seen if signature(result) is not None)
    assert report.finding is not None, "the fake fails every spec of two media items; the search found none"
    saved = json.loads(report.finding.path.read_text())
    said = (report.finding.signature, signature(report.finding.result), saved["expect"]["signature"])
    assert said == (first,) * 3, f"the finding's, its result's and the saved signature are {said}, expected {first!r}"
    assert signature(runner(Search(cp=2).case(report.finding.spec))) == first  # it still fails that way when rerun
    assert signature(CaseResult(None, ranks=[RankResult(0, plan_mismatch=[WRONG_PLAN])])) in report.other_failures
    # the smallest spec that fails the same way: draws shrink towards still 2x2-patch images, T=1, seed 0
    spec = report.finding.spec
    smallest = ((2 * spec.patch_dim, 2 * spec.patch_dim),) * 2
    assert (spec.images, spec.temporal_patch_size, spec.seed) == (smallest, 1, 0), spec
