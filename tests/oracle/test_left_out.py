"""A known limit that stops only the backward on a backend is confirmed once there, not once per microbatch: its
first gradient case of each implementation, CP size, layout and dtype runs (a strict xfail that must still fail
the known way); the others are left out only where their outputs-only case runs, and say so. No shipped subject
has such a limit on gloo now (MCore's gather backward runs there: vdpcp.oracle.observe.gloo_collectives), so a test subject
declares one (tests.oracle.subjects.BackwardRefused)."""

import json
import unittest

from vdpcp import testing
from vdpcp.cli import main
from vdpcp.matrix import scenarios
from vdpcp.matrix.expectations import known_limit
from vdpcp.testing import assert_case, expand

SUBJECT = "tests.oracle.subjects:backward_refused"


def _limited(case, backend):
    limit = known_limit(case, backend) if case.grads else None
    return limit is not None and limit.grads_only


def test_on_gloo_each_limit_runs_once_per_cp_size_and_every_case_left_out_keeps_its_outputs():
    matrix = scenarios.matrix(impls=(SUBJECT,))
    kept, left_out = scenarios.confirm_once(matrix, lambda case: "gloo")
    limited = [case for case in matrix if _limited(case, "gloo")]
    confirming = [case for case in kept if _limited(case, "gloo")]
    # one per CP size, for pixels in the tower's dtype and for a loader's
    assert len(limited) > 40 and sorted((case.cp, case.pixels) for case in confirming) == [
        (cp, pixels) for cp in (2, 4, 8) for pixels in ("loader", "tower")]
    assert {group.confirmed_by for group in left_out} == {case.id for case in confirming}
    gone = {case_id for group in left_out for case_id in group.cases}
    assert gone == {case.id for case in limited} - {case.id for case in confirming}
    ids = {case.id for case in kept}
    assert all(case.with_(loss="rank", grads=False, pixels="tower").id in ids for case in limited)  # outputs still run
    assert [case for case in matrix if case.id not in gone] == kept  # nothing else moves


def test_where_the_limit_does_not_apply_nothing_is_left_out():
    matrix = scenarios.matrix(cps=(2,), impls=(SUBJECT,))
    assert scenarios.confirm_once(matrix, lambda case: "nccl") == (matrix, [])


def test_a_case_whose_outputs_would_not_run_is_not_left_out():
    zigzag_only = scenarios.matrix(cps=(2,), impls=(SUBJECT,), losses=("zigzag",))
    assert any(_limited(case, "gloo") for case in zigzag_only)
    assert scenarios.confirm_once(zigzag_only, lambda case: "gloo") == (zigzag_only, [])


def test_pytest_names_what_the_confirming_case_stands_for():
    params = testing.params(SUBJECT, cps=(4,))
    ids = [p.id for p in params]
    kept, left_out = testing.matrix(SUBJECT, cps=(4,))
    assert len(left_out) == 2  # the tower's pixels and a loader's, each confirmed once
    for group in left_out:
        assert group.confirmed_by in ids and not set(group.cases) & set(ids)
        (confirming,) = [p for p in params if p.id == group.confirmed_by]
        assert confirming.marks[0].kwargs["reason"].endswith(f"({group.line()})")


def test_check_lists_without_them_and_says_what_it_left_out(tmp_path, capsys):
    argv = ["check", "--cp", "2", "--impl", SUBJECT, "-k", "eleven-images-cp2-backward", "--backend", "gloo"]
    assert main([*argv, "--list"]) == 0
    assert capsys.readouterr().out.split() == ["eleven-images-cp2-backward-refused-count",
                                               "eleven-images-cp2-backward-refused-count-outputs"]
    assert main([*argv, "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    (group,) = json.loads((tmp_path / "r.json").read_text())["left_out"]
    assert group == {"limit": "backward-refused", "backend": "gloo",
                     "confirmed_by": "eleven-images-cp2-backward-refused-count",
                     "cases": ["eleven-images-cp2-backward-refused-count-zigzag"]}
    assert ("1 more gradient case(s) that backward-refused stops on gloo are left out, confirmed by "
            "eleven-images-cp2-backward-refused-count; their outputs run in their -outputs cases") in out


def test_unittest_runs_the_confirming_case_as_a_strict_xfail_and_leaves_the_others_out():
    three = [s for s in scenarios.scenarios() if s.spec.name == "three-images"]

    class TestRefused(unittest.TestCase):
        @expand(SUBJECT, cps=(2,), table=three, special=False)
        def test(self, _, case):
            assert_case(case)

    names = unittest.TestLoader().getTestCaseNames(TestRefused)
    assert "test_three_images_cp2_backward_refused_count" in names and not any("zigzag" in n for n in names)
    with open("/dev/null", "w") as quiet:
        outcome = unittest.TextTestRunner(stream=quiet).run(unittest.TestLoader().loadTestsFromTestCase(TestRefused))
    assert outcome.wasSuccessful(), outcome.failures + outcome.errors
    assert [(test.id().rsplit(".", 1)[1], str(reason).startswith("xfail (strict)")) for test, reason in outcome.skipped] \
        == [("test_three_images_cp2_backward_refused_count", True)]
