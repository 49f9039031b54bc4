"""What an implementation declares about itself (vdpcp.contract.protocol: mismatch_error, checks_cp1, forward_only,
empty_rank_may_skip, merges_copy, has_opt_out,
MediaAxes.even_grids) makes the judge fair to it, and never hides a real bug: each declaring
subject passes, and its twin with the bug the declaration could hide still fails, with its one line.

Also the execution check from the forward alone: a rank that skips its tower fails outputs-only cases too."""

import pytest

from vdpcp.contract.protocol import KnownLimit
from vdpcp.feature.model import output_tokens
from vdpcp.impls.reference import Reference
from vdpcp.matrix import expectations
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged
from vdpcp.matrix.scenarios import EMPTY, SCENARIOS, Scenario, cases_of

SPECS = {s.spec.name: s.spec for s in SCENARIOS}
SUBJECTS = "tests.oracle.subjects"


def _run(impl: str, spec: str = "three-images", cp: int = 2, **changes):
    judged = run_judged(Case(SPECS[spec] if spec in SPECS else EMPTY, cp, f"{SUBJECTS}:{impl}", **changes),
                        backend="gloo")
    return judged.verdict, judged.why, judged.result


def _planned(case) -> list[list[int]]:
    """The rows each CP rank encodes by the reference's plan (the subjects split as it does)."""
    plan = Reference().plan(case.spec, case.config)
    return [plan.rows_of(rank) for rank in range(case.cp)]


def _said(result) -> str:
    return " | ".join(result.failures)


# --- (a) an empty microbatch's bare result -----------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [1, 2])
def test_an_empty_result_with_no_graph_is_judged_on_that_result_not_on_vdpcps_own_backward(cp):
    verdict, why, result = _run("empty_bare", "empty", cp)
    assert verdict == "pass", result.summary()
    assert result.unchecked_grads is None  # no rows: no gradient exists to leave unchecked


# --- (b) its own mismatch error ----------------------------------------------------------------------------


@pytest.mark.distributed
def test_an_implementations_own_documented_mismatch_error_in_its_own_words_passes():
    verdict, why, result = _run("own_mismatch_error", config_cp=4)
    assert (verdict, why) == ("pass", "the documented error on every rank"), result.summary()


@pytest.mark.distributed
def test_raising_another_error_than_the_declared_one_fails_naming_the_declared_class():
    verdict, why, result = _run("declares_another_error", config_cp=4)
    assert verdict == "fail" and why.startswith(f"no rank reported {expectations.resolve(result.case.impl).mismatch_error.text!r}"), why
    assert "rank 0 did not raise the documented OmniGroupError" in why and "context_parallel_size" not in why, why


# --- (c) a configured CP of 1 ------------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_configured_cp_of_1_is_the_designs_silent_no_op_every_rank_encoding_everything():
    verdict, why, result = _run("empty_rank_skips", config_cp=1)  # any subject that self-disables
    assert verdict == "pass", result.summary()
    assert all(r.read == [0, 1, 2] for r in result.ranks), result.summary()


@pytest.mark.distributed
def test_an_implementation_that_validates_cp_1_and_says_so_must_raise_there():
    assert _run("checks_cp1", config_cp=1)[:2] == ("pass", "the documented error on every rank")
    verdict, why, result = _run("claims_to_check_cp1", config_cp=1)  # says so, but self-disables
    assert verdict == "fail" and why.startswith("no rank reported"), why


@pytest.mark.distributed
@pytest.mark.parametrize("changes, off", [({"config_cp": 1}, "context_parallel_size=1"),
                                          ({"vision_dp_over_cp": False}, "the opt-out")])
def test_a_collective_where_the_feature_is_off_fails_though_every_result_is_right(changes, off):
    verdict, why, result = _run("collects_when_off", **changes)
    assert verdict == "fail", result.summary()
    line = f"issued 1 collective(s) on its CP group where vision_dp_over_cp is off ({off}): it must be a no-op"
    assert [f for f in result.failures if "execution" in f] == [f"rank {r}: execution: rank {r} {line}" for r in (0, 1)], \
        _said(result)
    assert result.max_err("out_err") == 0.0


# --- (d) even grids ----------------------------------------------------------------------------------------


def test_a_tower_that_takes_even_grids_gets_even_grids_from_the_matrix():
    odd = Scenario("multi-image", SPECS["mixed-sizes"])
    assert any(h % 2 or w % 2 for h, w in odd.spec.grids)
    for case in cases_of(odd, cps=(2,), impls=(f"{SUBJECTS}:even_grids_only",)):
        assert all(h % 2 == w % 2 == 0 for h, w in case.spec.grids), case.spec.grids
        assert [h // 2 for h, _ in case.spec.grids] == [-(-h // 2) for h, _ in odd.spec.grids]  # rounded up
    assert cases_of(odd, cps=(2,), impls=("reference",))[0].spec == odd.spec  # the default keeps odd grids


@pytest.mark.distributed
def test_an_even_grid_tower_passes_its_matrix_case_that_held_odd_grids():
    case = cases_of(Scenario("multi-image", SPECS["mixed-sizes"]), cps=(2,), impls=(f"{SUBJECTS}:even_grids_only",))[0]
    judged = run_judged(case, backend="gloo")
    assert judged.verdict == "pass", judged.result.summary()


@pytest.mark.distributed
def test_an_even_grid_tower_still_meets_the_splits_odd_placeholders():
    verdict, why, result = _run("even_grids_everywhere", "one-image")  # rank 1 holds a 1x1 placeholder
    assert verdict == "error" and "got a 1x1 placeholder" in result.error, result.summary()


# --- (e) forward-only, and a gather with no graph ----------------------------------------------------------


@pytest.mark.distributed
def test_a_forward_only_tower_checks_outputs_reads_and_plan_and_says_gradients_are_not_checked():
    verdict, why, result = _run("forward_only")
    assert verdict == "pass", result.summary()
    assert why == "gradients not checked: forward-only implementation (an inference tower: no backward)"
    assert [r.read for r in result.ranks] == _planned(result.case)  # who read what, judged without a backward
    assert "gradients not checked" in result.summary()


@pytest.mark.distributed
def test_a_forward_only_tower_with_wrong_outputs_still_fails():
    verdict, why, result = _run("forward_only_wrong")
    said = [f.split(": ", 1)[1].removeprefix("exact (regrouped): ") for f in result.failures]
    assert verdict == "fail" and all(f.startswith("outputs") for f in said), _said(result)  # never gradients


@pytest.mark.distributed
def test_a_gather_with_no_graph_is_one_line_per_rank_after_outputs_and_reads_were_judged(on_the_cpu):
    # The CPU, chosen: that the outputs were judged reads as their error being exactly 0, a fact of float64 on the
    # CPU's kernels, not of every device's (with VDPCP_DEVICE=cuda on the H200 this test failed; its traceback was cut
    # off with the run, and a GPU's GEMMs of a sub-batch may round apart from the whole microbatch's).
    verdict, why, result = _run("undeclared_graphless_gather")
    assert verdict == "fail", result.summary()
    rows = sum(output_tokens(grid) for grid in result.case.spec.grids)  # still images: one grid each
    assert result.failures == [f"rank {r}: outputs 'features' on rank {r} (CP rank {r}) hold {rows} rows and require no "
                               f"grad, where the unsharded ones carry an autograd graph (its tower read rows "
                               f"{result.ranks[r].read}): no gradient flows back through them" for r in (0, 1)]
    assert result.max_err("out_err") == 0.0 and [r.read for r in result.ranks] == _planned(result.case)


# --- (f) and item 4: a rank that skips its tower -----------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("impl, grads", [("empty_rank_skips", False), ("empty_rank_skips", True),
                                         ("forward_only_skips", True)])
def test_an_empty_rank_that_skips_its_tower_fails_outputs_only_and_forward_only_cases_too(impl, grads):
    verdict, why, result = _run(impl, "one-image", grads=grads)
    assert verdict == "fail", result.summary()
    assert ("rank 1: execution: rank 1 (CP rank 1) read no row and ran no layer of its tower (its plan gives it no row "
            "and 1 placeholder; layers never run: " in _said(result)), _said(result)


@pytest.mark.distributed
@pytest.mark.parametrize("impl, grads", [("empty_rank_may_skip", False), ("empty_rank_may_skip", True),
                                         ("forward_only_may_skip", True)])
def test_an_empty_rank_may_skip_a_tower_that_says_it_holds_no_collective(impl, grads):
    verdict, why, result = _run(impl, "one-image", grads=grads)
    assert verdict == "pass", result.summary()


@pytest.mark.distributed
def test_the_placeholder_skip_mutant_dies_in_an_outputs_only_case():
    judged = run_judged(Case(SPECS["one-image"], 2, "reference", grads=False, mutant="placeholder-rank-skips-tower"),
                        backend="gloo")
    assert judged.verdict == "fail" and "read no row and ran no layer of its tower" in _said(judged.result), \
        judged.result.summary()


# --- known limits of the backward alone --------------------------------------------------------------------


class BackwardLimited:
    """Declares a grads-only known limit on every case, its outputs-only twins included."""

    name = "backward-limited"
    LIMIT = KnownLimit("backward-only", "its gather's backward raises on gloo", "gather backward", grads_only=True)

    def encode(self, model, inputs):
        raise AssertionError("not run here")

    encode_sharded = encode

    def known_limit(self, case, backend):
        return self.LIMIT


backward_limited = BackwardLimited()


def test_a_grads_only_known_limit_is_never_an_outputs_only_cases():
    case = Case(SPECS["three-images"], 2, "tests.oracle.test_declarations:backward_limited")
    assert expectations.known_limit(case, "gloo") is BackwardLimited.LIMIT
    assert expectations.known_limit(case.with_(grads=False), "gloo") is None


# --- a backward that writes into the gradient it is handed, and merges_copy ----------------------------------

WROTE = ("the gather's backward wrote into the gradient it was handed: a consumer that reads it after, such as an "
         "additive merge, sees the sum")


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_a_backward_that_writes_into_its_handed_gradient_is_that_one_finding_per_rank_and_nothing_else(cp):
    verdict, why, result = _run("writes_its_gradient", cp=cp)
    assert verdict == "grad-written", result.summary()
    rows = sum(output_tokens(grid) for grid in SPECS["three-images"].grids)  # every rank loss weighs every row
    lines = [f"rank {r}: gradient written: rank {r} (CP rank {r}), output 'features' ({rows} of {rows} rows changed): "
             f"{WROTE} (a copy, or an out-of-place collective, fixes it: "
             f"docs/verdicts.md#a-backward-that-writes-into-its-incoming-gradient)" for r in range(cp)]
    assert result.failures == lines, _said(result)  # the text stream's difference is the write's: not said again


@pytest.mark.distributed
def test_where_its_model_merges_copy_the_write_is_a_note_and_the_case_passes():
    verdict, why, result = _run("writes_its_gradient_merges_copy")
    assert verdict == "pass", result.summary()
    assert why.startswith("note: rank 0: gradient written: rank 0 (CP rank 0), output 'features'") and WROTE in why, why
    assert len(result.notes) == 2 and result.failures == [], result.summary()


@pytest.mark.distributed
def test_a_text_stream_difference_that_no_write_into_the_handed_gradient_explains_stays_a_failure():
    verdict, why, result = _run("writes_beside_its_rows")
    assert verdict == "fail", result.summary()
    assert not any("gradient written" in f for f in result.failures), _said(result)
    assert any("text grads (this rank alone)" in f and "differs from the unsharded run's in 1 of" in f
               for f in result.failures), _said(result)


@pytest.mark.distributed
def test_declaring_that_merges_copy_hides_no_text_stream_difference_the_write_does_not_explain():
    verdict, why, result = _run("writes_both_merges_copy")
    assert verdict == "fail", result.summary()
    assert len(result.notes) == 2, result.summary()  # the write itself: harmless where merges copy, so a note
    assert any("text grads (this rank alone)" in f for f in result.failures), _said(result)


# --- no opt-out, and the subject's own count of collectives ---------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_an_implementation_with_no_opt_out_is_held_to_sharding_at_its_opt_out_cases(cp):
    verdict, why, result = _run("no_opt_out", cp=cp, vision_dp_over_cp=False)
    assert verdict == "pass", result.summary()
    assert [r.read for r in result.ranks] == _planned(result.case.with_(vision_dp_over_cp=True)), result.summary()


@pytest.mark.distributed
def test_without_the_declaration_sharding_at_the_opt_out_fails_as_the_no_op_it_must_be():
    verdict, why, result = _run("shards_at_the_opt_out", vision_dp_over_cp=False)
    assert verdict == "fail" and any("where vision_dp_over_cp is off (the opt-out)" in f for f in result.failures), \
        _said(result)


@pytest.mark.distributed
def test_declaring_no_opt_out_hides_no_opt_out_that_does_not_shard():
    verdict, why, result = _run("claims_no_opt_out", vision_dp_over_cp=False)
    assert verdict == "not-sharded", result.summary()


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_a_collective_is_counted_once_as_the_subject_issued_it_not_with_vdpcps_gloo_stand_ins_own(cp):
    verdict, why, result = _run("gathers_uneven_when_off", cp=cp, vision_dp_over_cp=False)
    line = "issued 1 collective(s) on its CP group where vision_dp_over_cp is off (the opt-out): it must be a no-op"
    assert [f for f in result.failures if "execution" in f] == [f"rank {r}: execution: rank {r} {line}"
                                                                for r in range(cp)], _said(result)
