"""vdpcp.matrix.budget, in one process: what a case needs from its shapes, the limit and its scope, the one-line refusal
just over it, out-of-memory texts told from verdicts, and long specs summarized."""

import json

import pytest
import torch

from vdpcp.contract.protocol import Implementation
from vdpcp.contract.sizing import Sizing
from vdpcp.feature import spec as specs
from vdpcp.feature.spec import MicrobatchSpec, SpecError, SpecTooLarge
from vdpcp.impls import resolve
from vdpcp.impls.reference import Reference
from vdpcp.matrix import budget, expectations
from vdpcp.matrix.case import Case, RankResult
from vdpcp.matrix.expectations import judge, known_limit
from vdpcp.matrix.runner import CaseResult
from vdpcp.tools.fuzz import MAX_GRID, TUBELET_SIZES

from .out_of_memory import CPU_ALLOCATOR

# Sized for this machine's CPU (its memory limit, its compute limit, its messages), whatever VDPCP_DEVICE a job
# exports; the GPU's figures are asked for by name (device="cuda").
pytestmark = pytest.mark.usefixtures("on_the_cpu")


def spec(images, **fields) -> MicrobatchSpec:
    return MicrobatchSpec(images=tuple(tuple(s) for s in images), **fields)


# --- what a case needs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, tower", [({}, "toy"), (dict(patch_dim=16), "toy"),
                                           (dict(temporal_patch_size=2, num_frames=(2,)), "toy"), ({}, "real")])
def test_the_toy_towers_parameters_are_counted_as_the_model_has_them(fields, tower):
    images = [[32, 32]] * (2 if "num_frames" in fields else 1)
    case = Case(spec(images, **fields), 1, tower=tower)
    with torch.device("meta"):
        model = resolve("reference").build_model(case, torch.float64, torch.device("meta"))
    assert budget.toy_params(case) == sum(p.numel() for p in model.parameters())


def test_every_rank_holds_the_unsharded_arm_in_its_turn_and_its_own_shard_through_the_case():
    # 5 equal images at CP 2: rank 0 encodes 2, rank 1 the remainder, 3, so its sharded arm holds the most; each
    # rank's peak is its turn (the whole unsharded arm) on top of what it holds throughout.
    case = Case(spec([[16, 16]] * 5), 2)
    need = budget.need(case)
    assert need.patches == 80 and need.world == 2 and need.replicas == 1
    assert need.resident[1] > need.resident[0] and min(need.ranks) > need.unsharded
    assert need.per_rank == max(need.ranks) and need.total == sum(need.ranks)
    # ranks that take turns on one device hold one turn at a time, not every one at once
    assert need.colocated(turns=True) < need.colocated(turns=False) == need.total
    # k at a time: every rank resident, and the k largest turns on top (one: True; all of them: all at once)
    four = budget.need(case.with_(cp=4))
    held = [four.colocated(turns=k) for k in (1, 2, 3, 4)]
    assert held[0] == four.colocated(turns=True) and held[3] == four.colocated(turns=False) == four.total
    assert held == sorted(held) and len(set(held)) == 4, held
    assert held[1] - held[0] == sorted(four.turn, reverse=True)[1]
    # unsharded (CP=1 or the opt-out): the sharded arm is the whole microbatch too
    alone = budget.need(case.with_(cp=1))
    assert alone.world == 1 and alone.resident[0] >= alone.unsharded and alone.ranks[0] >= alone.unsharded
    opt_out = budget.need(case.with_(vision_dp_over_cp=False))
    assert opt_out.resident[0] == opt_out.resident[1] > need.resident[1]


class _Replicating(Reference):
    """The reference with a fallback policy that encodes every microbatch whole, and no stated plan."""

    def plan(self, spec, config):
        return None

    def replicated(self, spec, config):
        return "below the policy's threshold"


REPLICATING = _Replicating()


def test_a_microbatch_the_implementations_fallback_replicates_is_held_as_the_opt_out_holds_it():
    # Encoded whole on every rank, each rank also holds its own loss's share of the gradients (the oracle checks
    # them rank-alone), as under the opt-out; an estimate without it lets ranks that should take turns run out of
    # memory side by side.
    case = Case(spec([[16, 16]] * 5), 2, impl=f"{__name__}:REPLICATING", dtype="bfloat16")
    held = budget.need(case, device="cuda")
    opt_out = budget.need(case.with_(vision_dp_over_cp=False), device="cuda")
    assert (held.ranks, held.resident, held.turn) == (opt_out.ranks, opt_out.resident, opt_out.turn)
    assert min(held.resident) > max(budget.need(case.with_(impl="reference"), device="cuda").resident)  # sharded


def test_an_outputs_only_cases_exact_run_holds_its_model_copy_and_no_activations():
    # Its exact run is a forward under no_grad (vdpcp.oracle.compare.rounding.measure): an estimate that held its
    # activations would overstate the case's peak several times over.
    case = Case(spec([[64, 64]] * 8), 2, dtype="bfloat16", grads=False)
    need = budget.need(case, device="cuda")
    exact_model = budget._params(case) * budget.DTYPE_BYTES["float32"]
    assert need.turn[0] + need.resident[0] == need.ranks[0]
    assert max(need.ranks) <= need.resident[0] + max(need.unsharded, exact_model)
    float32_forward = budget.need(case.with_(dtype="float32"), device="cuda").unsharded  # what it would keep
    assert max(need.ranks) < need.resident[0] + float32_forward


def test_dp_replicas_and_tp_ranks_each_hold_as_much():
    case = Case(spec([[16, 16]] * 4), 2)
    assert budget.need(case.with_(dp=2)).total == 2 * budget.need(case).total
    assert budget.need(case.with_(dp=2, tp=2)).total == 4 * budget.need(case).total


def test_the_estimate_shrinks_with_the_dtype_but_not_in_proportion():
    case = Case(spec([[64, 64]] * 8), 2)
    f64, f32, bf16 = (budget.need(case.with_(dtype=d)).unsharded for d in ("float64", "float32", "bfloat16"))
    assert f64 / 2 < f32 < f64 and f32 / 2 < bf16 < f32


def test_a_tubelet_is_one_unit_of_the_encoder():
    stills = budget.need(Case(spec([[16, 16]] * 4), 1))
    video = budget.need(Case(spec([[16, 16]] * 4, num_frames=(4,), temporal_patch_size=4), 1))
    assert video.patches == stills.patches and video.unsharded < stills.unsharded


class PerPatch(Sizing):
    def __init__(self, value):
        self.value = value

    def patch_bytes(self, case):
        return self.value


class DeclaresItsCost:
    name = "declares"

    def __init__(self, value):
        self.sizing = PerPatch(value)

    def encode(self, model, batch): ...

    def encode_sharded(self, model, batch, config, group): ...


declares_1k = DeclaresItsCost(1024)
declares_nonsense = DeclaresItsCost(-3)


def test_an_implementations_declared_cost_per_patch_replaces_the_toy_estimate():
    case = Case(spec([[16, 16]] * 4), 1, impl="tests.bounds.test_budget:declares_1k")
    assert budget.need(case).unsharded == 64 * 1024
    with pytest.raises(budget.BudgetError, match=r"declares_nonsense: patch_bytes\(case\) is -3; expected a positive int"):
        budget.need(case.with_(impl="tests.bounds.test_budget:declares_nonsense"))


class OwnTowerSizing(Sizing):
    def patch_bytes(self, case):
        return 2048

    def param_count(self, case):
        return 10**6

    def full_attention(self, case):
        return 3, 5


class OwnTower(Implementation):
    """A subclass with a tower of its own (so no toy figure applies), sized through its declared Sizing."""

    name = "own-tower"
    sizing = OwnTowerSizing()

    def build_model(self, case, dtype, device): ...


class _OldHookMethods:
    """The spelling before ``sizing``: the hooks on the implementation itself."""

    def build_model(self, case, dtype, device): ...

    def patch_bytes(self, case):
        return 2048

    def param_count(self, case):
        return 10**6

    def full_attention(self, case):
        return 3, 5


class OldHooks(_OldHookMethods, Implementation):
    name = "old-hooks"


class OldHooksDuck(_OldHookMethods):
    """A duck-typed implementation with the old hooks, wrapped by resolve()."""

    name = "old-hooks-duck"

    def encode(self, model, batch): ...

    def encode_sharded(self, model, batch, config, group): ...


own_tower, old_hooks, old_hooks_duck = OwnTower(), OldHooks(), OldHooksDuck()


def _figures(target: str) -> tuple:
    case = Case(spec([[16, 16]] * 4), 2, impl=f"tests.bounds.test_budget:{target}", dtype="float64")
    return budget.need(case), budget.need(case, device="cuda"), budget.declared_patch_bytes(case)


def test_a_declared_sizing_gives_every_figure_and_the_toy_tower_none():
    need, on_gpu, per_patch = _figures("own_tower")
    assert per_patch == 2048 and need.unsharded == 64 * 2048
    assert need.flops == 6.0 * 10**6 * 64 * 2 * 2  # both arms (float64 has no exact run) on each of 2 ranks
    assert on_gpu.unsharded == 64 * 2048 + 3 * 5 * 4 * 16**2 * 8  # the n x n scores of its 3 x 5 full-attention heads


@pytest.mark.parametrize("target", ["old_hooks", "old_hooks_duck"])
def test_hooks_on_the_implementation_itself_still_size_it_with_one_deprecation_warning(target, recwarn):
    want = _figures("own_tower")
    assert _figures(target) == want
    assert _figures(target) == want  # sized again: no second warning
    said = [str(w.message) for w in recwarn if issubclass(w.category, DeprecationWarning) and "Sizing" in str(w.message)]
    name = resolve(f"tests.bounds.test_budget:{target}").name
    assert said == [f"implementation {name!r} defines patch_bytes(case), param_count(case), full_attention(case) on "
                    f"itself; declare them on a vdpcp.Sizing subclass instead (sizing = MySizing()): the hooks on the "
                    f"implementation go in the next release"]


def test_the_default_sizing_is_vdpcps_own_figures():
    case = Case(spec([[16, 16]] * 4), 2)
    assert type(resolve("reference").sizing) is Sizing
    assert (resolve("reference").sizing.patch_bytes(case), resolve("reference").sizing.param_count(case)) == (None, None)
    assert budget.need(case).flops == 6.0 * budget.toy_params(case) * 64 * 2 * 2


def test_the_qwen_adapter_declares_its_own_cost():
    case = Case(spec([[16, 16]] * 4, patch_dim=4), 1, impl="qwen2_5_vl")
    assert budget.declared_patch_bytes(case) is not None
    assert budget.need(case).unsharded > budget.need(case.with_(impl="reference")).unsharded


def test_the_largest_fuzz_draw_fits_the_default_limit_many_times_over():
    # 2 * CP media items, each a video of 2T+1 frames of the largest grid, in tubelets of the largest T.
    cp, T = 8, max(TUBELET_SIZES)
    side = MAX_GRID * 4
    worst = spec([[side, side]] * (2 * cp * (2 * T + 1)), num_frames=(2 * T + 1,) * (2 * cp), temporal_patch_size=T)
    assert budget.need(Case(worst, cp)).total * 10 < budget.DEFAULT_LIMIT


# --- the limit and the refusal ---------------------------------------------------------------------------

TWO = Case(spec([[16, 16], [16, 32]], name="two"), 2)


def test_a_case_just_under_the_limit_is_sized_and_one_just_over_is_refused_in_one_line():
    total = budget.need(TWO).total
    with budget.limited(total):
        assert budget.check(TWO, "two.json").total == total
    with budget.limited(total - 1), pytest.raises(SpecTooLarge) as refused:
        budget.check(TWO, "two.json")
    text = str(refused.value)
    assert "\n" not in text and text.startswith("two.json: field 'images'[1] = [16, 32] is 32 patches (patch_dim=4): at CP=2 ")
    assert f"over --max-spec-bytes {total - 1} of " in text and "VDPCP_MAX_SPEC_BYTES" in text
    assert isinstance(refused.value, SpecError)  # every entry point's bad-spec path takes it


def test_the_refusal_names_the_one_image_that_is_too_large():
    case = Case(spec([[8, 8], [65536, 65536], [8, 8]]), 1)
    with pytest.raises(SpecTooLarge, match=r"^x: field 'images'\[1\] = \[65536, 65536\] is 268,435,456 patches "
                                           r"\(patch_dim=4\): at CP=1 the case needs about [\d.]+ TiB on this machine "
                                           r"\(1 rank, float64; the unsharded encoder alone [\d.]+ TiB\), over the "
                                           r"default limit of 8.0 GiB"):
        budget.check(case, "x")


@pytest.mark.parametrize("gpus", [1, 4])
def test_a_gpu_refusal_states_the_figure_it_compared_what_the_busiest_gpu_holds(monkeypatch, gpus):
    monkeypatch.setattr(budget, "gpu_count", lambda: gpus)
    case = Case(spec([[16, 16], [16, 32]] * 4, name="eight"), 4)
    found = budget.need(case, device="cuda")
    held = found.colocated(turns=True) if gpus == 1 else found.per_rank
    with budget.limited(held - 1), pytest.raises(SpecTooLarge) as refused:
        budget.check(case, device="cuda")
    text = str(refused.value)
    assert f"the case needs about {budget.human(held)} on the busiest GPU (" in text, text
    assert ("its 4 ranks taking turns for the unsharded arm" in text) == (gpus == 1), text
    with budget.limited(held):
        budget.check(case, device="cuda")  # what it compared: at that figure it fits


def test_the_issues_hundred_thousand_small_images_are_refused_by_their_count():
    case = Case(spec([[16, 16]] * 100_000), 2)
    with pytest.raises(SpecTooLarge, match=r"field 'images' holds 100,000 images, 1,600,000 patches .*\(2 ranks x up to"):
        budget.check(case)


@pytest.mark.parametrize("text, expected", [("8G", 8 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("2tb", 2 << 40),
                                            ("8589934592", 8 << 30), (" 64 K ", 64 << 10), (4096, 4096)])
def test_limits_read_as_binary_units(text, expected):
    assert budget.parse_bytes(text, "x") == expected


@pytest.mark.parametrize("text", ["", "abc", "-1", "0", "8X", "1e9", True])
def test_a_limit_that_is_not_bytes_is_one_error_naming_it(text):
    with pytest.raises(budget.BudgetError, match=r"^VDPCP_MAX_SPEC_BYTES is .*; expected a (positive )?number of bytes"):
        budget.parse_bytes(text, budget.ENV)


def test_the_limit_is_scoped_strongest_first(monkeypatch):
    monkeypatch.delenv(budget.ENV, raising=False)
    assert budget.limit() == (budget.DEFAULT_LIMIT, "the default limit")
    monkeypatch.setenv(budget.ENV, "2G")
    assert budget.limit() == (2 << 30, "VDPCP_MAX_SPEC_BYTES=2G")
    with budget.limited("1G"):
        with budget.limited("3G", "--vdpcp-max-spec-bytes"):
            assert budget.limit() == (3 << 30, "--vdpcp-max-spec-bytes 3G")
        assert budget.limit() == (1 << 30, "--max-spec-bytes 1G")
        with budget.limited(None):
            assert budget.limit()[0] == 1 << 30
    assert budget.limit()[0] == 2 << 30 and budget.override() is None
    with pytest.raises(RuntimeError), budget.limited("5G"):
        raise RuntimeError("a failing block")
    assert budget.override() is None
    monkeypatch.setenv(budget.ENV, "lots")
    with pytest.raises(budget.BudgetError, match="VDPCP_MAX_SPEC_BYTES is 'lots'"):
        budget.limit()


@pytest.mark.parametrize("text", ["inf", "nan", "-1", "0", "lots"])
def test_a_compute_limit_that_is_not_a_finite_positive_number_is_one_error_naming_it(monkeypatch, text):
    monkeypatch.setenv(budget.FLOPS_ENV, text)
    with pytest.raises(budget.BudgetError, match=f"^VDPCP_MAX_CASE_TFLOP is '{text}'; expected a positive number of TFLOP"):
        budget.flops_limit()


# --- out of memory is a resource failure, not a verdict ----------------------------------------------------

# As the harness words it (vdpcp.harness.outcome): rank 0, waiting in the gather, quotes rank 1's error.
RANK_FAILURE = ("vdpcp.matrix.runner.rank_body (gloo, world size 2) failed on 2 of 2 ranks: rank 0 hung: still running 3 s after "
                "rank 1 raised {exc}; rank 1 raised {exc}\n\n"
                "----- rank 0: hung: still running 3 s after rank 1 raised {exc} -----\n  File \"comm.py\", line 34 in forward\n\n"
                "----- rank 1: raised {exc} -----\nTraceback (most recent call last):\n  ...\n{exc}")

# (the exception line a rank raised, what the verdict's text must say)
OUT_OF_MEMORY = [
    (f"RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. {CPU_ALLOCATOR}",  # as torch 2.14 words it
     f"rank 1 ran out of memory: tried to allocate 96.0 GiB (RuntimeError: {CPU_ALLOCATOR})"),
    (f"RuntimeError: {CPU_ALLOCATOR}", "rank 1 ran out of memory: tried to allocate 96.0 GiB (RuntimeError: DefaultCPUAllocator"),
    ("RuntimeError: std::bad_alloc", "rank 1 ran out of memory (RuntimeError: std::bad_alloc)"),
    ("MemoryError", "rank 1 ran out of memory (MemoryError)"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.8 GiB",
     "rank 1 ran out of memory: tried to allocate 2.0 GiB (torch.OutOfMemoryError: CUDA out of memory."),
    ("OSError: [Errno 12] Cannot allocate memory", "rank 1 ran out of memory (OSError: [Errno 12] Cannot allocate memory)"),
]


@pytest.mark.parametrize("exc, expected", OUT_OF_MEMORY, ids=["enforce", "cpu-allocator", "bad-alloc", "MemoryError", "cuda", "errno"])
def test_a_rank_out_of_memory_is_a_resource_failure_naming_the_rank_and_the_size(exc, expected):
    result = CaseResult(TWO, error=RANK_FAILURE.format(exc=exc), backend="gloo")
    assert result.verdict == "resource"
    verdict, why = judge(result)
    assert verdict == "resource" and why.startswith(expected), why


def test_an_unsharded_encoder_out_of_memory_is_a_resource_failure_not_the_encoders_verdict():
    ranks = [RankResult(r, r, unsharded_error="RuntimeError: std::bad_alloc") for r in range(2)]
    result = CaseResult(TWO, ranks=ranks, backend="gloo")
    assert result.verdict == "resource"
    assert judge(result) == ("resource", "rank 0 ran out of memory (RuntimeError: std::bad_alloc) in the unsharded encoder")


def test_a_resource_failure_wins_over_a_known_limits_expectation():
    case = Case(spec([]), 2, impl="mcore")  # MCore's empty-microbatch xfail
    assert known_limit(case, "gloo") is not None
    result = CaseResult(case, error=RANK_FAILURE.format(exc="MemoryError"), backend="gloo")
    assert judge(result)[0] == "resource"


@pytest.mark.parametrize("exc", ["ValueError: pixel shuffle needs an even patch grid, got 1x1", "RuntimeError: std::bad_cast",
                                 "RuntimeError: shape '[1, 16]' is invalid for input of size 12"])
def test_other_errors_stay_errors(exc):
    assert CaseResult(TWO, error=RANK_FAILURE.format(exc=exc), backend="gloo").verdict == "error"
    ranks = [RankResult(0, 0, unsharded_error=exc)]
    assert CaseResult(TWO, ranks=ranks, backend="gloo").verdict == "unsharded-error"


def test_a_rank_text_without_sections_is_read_from_its_headline():
    result = CaseResult(TWO, error="rank_body failed on 2 of 2 ranks: rank 0 hung: still running 3 s after rank 1 raised "
                                   "MemoryError; rank 1 raised MemoryError", backend="gloo")
    assert expectations.resource_failure(result) == "rank 1 ran out of memory (MemoryError)"


# --- long specs --------------------------------------------------------------------------------------------


def test_a_short_spec_is_printed_whole_and_a_long_one_by_counts_ranges_and_file():
    short = spec([[8, 8], [8, 12]], name="short")
    assert specs.summary(short) == str(short.to_dict()) and specs.spec_record(short) == short.to_dict()
    long = spec([[16, 16]] * 99_990 + [[8, 24]] * 5 + [[32, 32]] * 5, name="many")
    text = specs.summary(long, "crash/many.json")
    assert text == ("many: 100,000 images, 8-32 x 16-32 px, 12-64 patches each, 1,600,220 in all (patch_dim=4), seed 0; "
                    "the whole spec: crash/many.json")
    record = specs.spec_record(long)
    assert record["rows"] == 100_000 and record["patches"] == 1_600_220 and len(json.dumps(record)) < 300
    video = spec([[16, 16]] * 13, num_frames=(5, 7, 1), temporal_patch_size=2, name="clips")
    assert specs.summary(video) == ("clips: 13 rows in 3 media items, 2 videos of 5-7 frames (T=2), 16 x 16 px, 16 patches "
                                     "each, 208 in all (patch_dim=4), seed 0")


def test_a_bad_long_spec_names_its_first_bad_entry_and_is_not_printed_whole():
    images = [[16, 16]] * 50_000 + [[16]] + [[16, 16]] * 49_999
    with pytest.raises(SpecError) as bad:
        MicrobatchSpec.from_dict({"images": images}, source="many.json")
    text = str(bad.value)
    assert len(text) < 300 and "(100,000 in all)" in text and "('images'[50000] = [16])" in text, text
    with pytest.raises(SpecError, match=r"sums to 100000, expected len\(images\) = 100001") as bad:
        MicrobatchSpec.from_dict({"images": [[8, 8]] * 100_001, "num_frames": [1] * 100_000})
    assert len(str(bad.value)) < 300


def test_a_gpus_limit_is_told_as_nine_tenths_of_its_memory_not_as_its_memory(monkeypatch):
    """The H200's refusal read "over nine tenths of the GPU's memory of 125.8 GiB", as if the GPU held 125.8 GiB."""
    monkeypatch.delenv(budget.ENV, raising=False)
    monkeypatch.setattr(budget, "gpu_memory", lambda: int(139.8 * 2**30))
    allowed, where = budget.limit("cuda")
    assert allowed == int(0.9 * 139.8 * 2**30) and where == "the GPU's limit (nine tenths of its 139.8 GiB)"
