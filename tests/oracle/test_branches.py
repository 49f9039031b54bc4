"""The execution check is fair to a tower with a branch only some rows take (RADIO's separate video embedder, here
tests.oracle.subjects:branching): a layer is required on a rank where every rank holding real rows ran it, and a
rank of placeholders alone may take its own branch instead. It still fails a rank that skips its tower, or its
trunk, outputs-only cases included."""

import pytest

from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged
from vdpcp.matrix.scenarios import SCENARIOS

SPECS = {s.spec.name: s.spec for s in SCENARIOS}


def _judged(impl: str, spec: str, cp: int, grads: bool = True):
    return run_judged(Case(SPECS[spec], cp, impl, grads=grads), backend="gloo")


@pytest.mark.distributed
@pytest.mark.parametrize("spec, cp", [
    ("three-images", 2),  # rank 0's one image is small, rank 1's two are large: neither runs the other's embedding
    ("three-images", 4),  # the same, and a rank of one placeholder (small)
    ("one-image", 2),  # the one real share is large; the placeholder rank swaps it for small
])
def test_a_tower_whose_rows_take_different_branches_passes_with_gradients(spec, cp):
    judged = _judged("tests.oracle.subjects:branching", spec, cp)
    assert judged.verdict == "pass", judged.result.summary()
    assert judged.result.unchecked_grads is None  # gradients ran, so the parameter check ran too


@pytest.mark.distributed
@pytest.mark.parametrize("grads", [False, True])
def test_a_placeholder_rank_that_takes_its_branch_but_skips_the_trunk_fails(grads):
    judged = _judged("tests.oracle.subjects:branching_trunk_skipped", "one-image", 2, grads=grads)
    said = " | ".join(judged.result.failures)
    assert judged.verdict == "fail", judged.result.summary()
    assert "rank 1: execution: rank 1 (CP rank 1) skipped " in said and "layer(s) that every rank holding real " \
           "rows ran (blocks.0.mlp.0, blocks.0.mlp.2, blocks.0.norm1)" in said, said


@pytest.mark.distributed
@pytest.mark.parametrize("spec, cp, grads", [("one-image", 2, True), ("three-images", 4, True),
                                             ("three-images", 4, False)])
def test_the_placeholder_skip_mutant_still_dies(spec, cp, grads):
    judged = run_judged(Case(SPECS[spec], cp, "reference", grads=grads, mutant="placeholder-rank-skips-tower"),
                        backend="gloo")
    said = " | ".join(judged.result.failures)
    assert judged.verdict == "fail" and f"rank {cp - 1}: execution: rank {cp - 1} (CP rank {cp - 1}) read no row and " \
           "ran no layer of its tower (its plan gives it no row and 1 placeholder" in said, said
