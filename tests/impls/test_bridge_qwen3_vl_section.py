"""The released Megatron-Bridge Qwen3-VL vision section, plugged in as a Bridge engineer would
(tests/impls/bridge_qwen3_vl_section.py), a regression fixture: it is the release's own section, call for call; every
case of its matrix that runs a sharded backward gets the one finding its gather's backward earns (it all-reduces the
gradient it is handed in place) and nothing else; declared to sit in a model whose merges copy, every case passes;
and Bridge's whole forward, whose merge copies, stays green beside it (tests/impls/test_bridge_qwen3_vl.py)."""

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from tests.impls import bridge_qwen3_vl_section
from vdpcp.impls import bridge_release
from vdpcp.impls.bridge_qwen3_vl import MODEL
from vdpcp.matrix import saved, scenarios
from vdpcp.matrix.runner import run_judged
from vdpcp.testing import assert_case, params

SECTION = "tests.impls.bridge_qwen3_vl_section:section"
MERGES_COPY = "tests.impls.bridge_qwen3_vl_section:section_merges_copy"
TABLE = [s for s in scenarios.scenarios(fixtures=None)
         if s.spec.name in ("one-image", "three-images", "video-and-images")]
CPS = (2, 4)
WROTE = ("the gather's backward wrote into the gradient it was handed: a consumer that reads it after, such as an "
         "additive merge, sees the sum")


def _calls(function, first: str, last: str, skip: str | None = None) -> list[str]:
    """The names ``function`` calls, in source order, from the line holding ``first`` to the one before ``last``,
    leaving out the body of the ``if`` whose test reads ``skip``; a method by its name alone (``utils.f`` is ``f``)."""
    source = textwrap.dedent(inspect.getsource(function))
    lines = source.splitlines()
    start = next(n for n, line in enumerate(lines, 1) if first in line)
    end = next(n for n, line in enumerate(lines, 1) if n > start and last in line)
    tree = ast.parse(source)
    skipped = set()
    for node in ast.walk(tree):
        if skip and isinstance(node, ast.If) and skip in ast.unparse(node.test):
            skipped |= {id(n) for statement in node.body for n in ast.walk(statement)}
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and id(node) not in skipped
             and start <= node.lineno < end]
    names = [(n.lineno, n.col_offset, n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) for n in calls]
    return [name for *_, name in sorted(names) if name not in ("rank", "size")]  # the CP group's, asked of it


def test_the_plug_in_runs_the_releases_vision_section_call_for_call_with_the_releases_own_functions():
    release = bridge_release.load()
    forward = release[MODEL].Qwen3VLModel.forward
    theirs = _calls(forward, "reorganize_inputs(", "combined_embeddings = self.language_model.embedding",
                    skip="self.use_dist_train")
    ours = _calls(bridge_qwen3_vl_section.vision_section, "reorganize_inputs(", "return vision_embeds")
    assert ours == theirs and "AllGatherVisionEmbeddings" not in ours  # apply is called on it: the name is "apply"
    assert theirs.count("apply") == 2 and "qwen3vl_cp_split" in theirs and "collapse_thw" in theirs, theirs
    for name in ("reorganize_inputs", "qwen3vl_cp_split", "get_vision_cp_data", "collapse_thw",
                 "ensure_requires_grad_for_cp_collective", "AllGatherVisionEmbeddings"):
        assert forward.__globals__[name] is getattr(release[bridge_release.QWEN3_VL_MODULES[1]], name)


@pytest.mark.distributed
@pytest.mark.parametrize("case", params(SECTION, cps=CPS, table=TABLE))
def test_every_sharded_backward_gets_the_write_alone_and_every_other_case_passes(case):
    judged = run_judged(case)
    sharded_backward = case.grads and case.config.shard_vision and case.config_cp is None and bool(case.spec.images)
    if not sharded_backward:
        assert judged.verdict == "pass", judged.result.summary()
        return
    assert judged.verdict == "grad-written", judged.result.summary()
    lines = judged.result.failures
    assert lines and all("gradient written" in line and WROTE in line for line in lines), lines
    ranks = {line.split(":")[0] for line in lines}
    assert len(ranks) == case.world_size and all("output 'features'" in line for line in lines), lines


@pytest.mark.distributed
@pytest.mark.parametrize("case", params(MERGES_COPY, cps=CPS, table=TABLE))
def test_declared_to_sit_in_a_model_whose_merges_copy_every_case_passes(case):
    assert_case(case)


@pytest.mark.distributed
def test_the_saved_case_docs_found_names_replays_the_write_and_nothing_else():
    path = Path(__file__).resolve().parents[2] / "docs" / "found" / "bridge-0.6.2-gather-writes-its-gradient-cp2.json"
    judged = run_judged(saved.load(path).to_case())
    assert judged.verdict == "grad-written", judged.result.summary()
    assert all("output 'features'" in line and "output 'deepstack1'" in line for line in judged.result.failures)
