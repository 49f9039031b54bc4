"""Every entry point sizes a case before building it: the issue's two reproductions (one 65536 x 65536 image;
100,000 images of 16x16) are refused in one line naming the field and the figure, exit 2, with nothing run;
--max-spec-bytes / VDPCP_MAX_SPEC_BYTES raise the limit for that call only; a rank out of memory is a resource
failure naming the rank and the size, never "the unsharded encoder rejects this spec"; long specs are summarized."""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from vdpcp.cli import main
from vdpcp.feature.spec import MicrobatchSpec, SpecTooLarge
from vdpcp.matrix import budget, runner
from vdpcp.matrix.case import Case
from vdpcp.tools.capture import capture, capture_on_failure
from vdpcp.tools.fuzz import Search, fuzz

# Sized for this machine's CPU (its memory limit, its compute limit, its messages), whatever VDPCP_DEVICE a job
# exports; the GPU's figures are asked for by name (device="cuda").
pytestmark = pytest.mark.usefixtures("on_the_cpu")

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
HUGE_IMAGE = {"images": [[65536, 65536]], "patch_dim": 4, "seed": 0}  # the issue's 70-byte spec
MANY_IMAGES = {"name": "many-cp2", "images": [[16, 16]] * 100_000, "patch_dim": 4, "seed": 0}
OOM = "tests.bounds.out_of_memory"


def write(tmp_path, data, name) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def nothing_runs(monkeypatch):
    """A refusal comes before any rank is launched (or any tensor built)."""
    def launched(*args, **kwargs):
        raise AssertionError("a rank was launched for a spec that should have been refused")
    monkeypatch.setattr(runner, "run_ranks", launched)


REFUSED = [
    ("huge-image", HUGE_IMAGE, ["--cp", "1"], "field 'images'[0] = [65536, 65536] is 268,435,456 patches (patch_dim=4): at CP=1 "
                                              "the case needs about "),
    ("many-images", MANY_IMAGES, [], "field 'images' holds 100,000 images, 1,600,000 patches (patch_dim=4): at CP=2 the case "
                                     "needs about "),
]


@pytest.mark.parametrize("data, args, expected", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_replay_refuses_the_issues_reproductions_in_one_line(tmp_path, capsys, nothing_runs, data, args, expected):
    path = write(tmp_path, data, "spec.json")
    assert main(["replay", str(path), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith(f"vdpcp replay: {path}: {expected}"), captured.err
    assert ("over the default limit of 8.0 GiB; raise it with --max-spec-bytes (pytest: --vdpcp-max-spec-bytes) or "
            "VDPCP_MAX_SPEC_BYTES where the machine has the memory\n") in captured.err


@pytest.mark.parametrize("data, args, expected", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_check_refuses_them_before_any_case_runs(tmp_path, capsys, nothing_runs, data, args, expected):
    path = write(tmp_path, data, "spec.json")
    assert main(["check", "--spec", str(path), "--cp", *(args[1:] or ["2"]), "--impl", "reference"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"vdpcp check: {path}: {expected}"), err


@pytest.mark.parametrize("data, args, expected", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_pytest_replay_refuses_them_as_a_usage_error(pytester, tmp_path, data, args, expected):
    path = write(tmp_path, data, "spec.json")
    result = pytester.runpytest("--replay", str(path), *(["--replay-cp", "1"] if args else []))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: --replay: {path}: {expected}" in result.stderr.str()


@pytest.mark.parametrize("data, cp", [(HUGE_IMAGE, 1), (MANY_IMAGES, 2)], ids=["huge-image", "many-images"])
def test_capture_refuses_them_before_the_block_runs_and_writes_nothing(tmp_path, data, cp):
    path = tmp_path / "step.json"
    entered = []
    with pytest.raises(SpecTooLarge, match=r"^capture: field 'images'.*over the default limit of 8.0 GiB"):
        with capture_on_failure(path, data["images"], cp=cp, patch_dim=4):
            entered.append(True)
    assert not entered and not path.exists()


def test_run_case_refuses_too_for_callers_of_the_library(nothing_runs):
    with pytest.raises(SpecTooLarge, match=r"^one-image-cp1-reference-count: field 'images'\[0\]"):
        runner.run_case(Case(MicrobatchSpec(images=((65536, 65536),), name="one-image"), 1))


# --- the limit, just under and just over, for one call only ----------------------------------------------

SMALL = {"name": "small-cp2", "images": [[8, 8], [8, 12]], "seed": 1}


def test_replay_just_under_the_limit_runs_and_just_over_is_refused(tmp_path, capsys):
    path = write(tmp_path, SMALL, "small-cp2.json")
    total = budget.need(Case(MicrobatchSpec.from_dict(SMALL), 2)).total
    assert main(["replay", str(path), "--max-spec-bytes", str(total)]) == 0
    out = capsys.readouterr().out
    assert "verdict: pass" in out.splitlines() and f"size: 10 patches: about {budget.human(total)} on this machine" in out
    assert main(["replay", str(path), "--max-spec-bytes", str(total - 1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"over --max-spec-bytes {total - 1} of" in err, err
    assert budget.override() is None and budget.limit()[0] == budget.DEFAULT_LIMIT  # nothing left behind


def test_the_environment_raises_the_limit_and_a_bad_figure_is_one_usage_error(tmp_path, capsys, monkeypatch, nothing_runs):
    path = write(tmp_path, HUGE_IMAGE, "huge.json")
    monkeypatch.setenv(budget.ENV, "1K")
    assert main(["replay", str(write(tmp_path, SMALL, "small-cp2.json"))]) == 2
    assert "over VDPCP_MAX_SPEC_BYTES=1K of 1.0 KiB" in capsys.readouterr().err
    monkeypatch.setenv(budget.ENV, "plenty")
    assert main(["replay", str(path), "--cp", "1"]) == 2
    assert capsys.readouterr().err == ("vdpcp replay: VDPCP_MAX_SPEC_BYTES is 'plenty'; expected a number of bytes, "
                                       "e.g. 8G, 512M or 8589934592\n")
    monkeypatch.delenv(budget.ENV)
    assert main(["check", "--spec", str(path), "--cp", "1", "--max-spec-bytes", "-4"]) == 2
    assert capsys.readouterr().err == ("vdpcp check: --max-spec-bytes is '-4'; expected a number of bytes, e.g. 8G, "
                                       "512M or 8589934592\n")


def test_pytest_takes_the_limit_for_its_session_only(pytester, tmp_path):
    path = write(tmp_path, SMALL, "small-cp2.json")
    result = pytester.runpytest("--replay", str(path), "--vdpcp-max-spec-bytes", "1K")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "over --vdpcp-max-spec-bytes 1K of 1.0 KiB" in result.stderr.str()
    result = pytester.runpytest("--replay", str(path), "--vdpcp-max-spec-bytes", "many")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "--vdpcp-max-spec-bytes is 'many'" in result.stderr.str()
    assert budget.override() is None


def test_fuzz_never_draws_over_the_limit(monkeypatch):
    # A limit between the smallest and the largest draw at CP 2: some draws are over it, and none of those runs.
    search = Search(2, budget=6, seed=3)
    limit = int(1.1 * budget.need(search.case(MicrobatchSpec(images=((8, 8),)))).total)  # about a third of draws fit
    sized, ran = [], []
    fits = budget.fits
    monkeypatch.setattr(budget, "fits", lambda case: sized.append(fits(case)) or sized[-1])
    with budget.limited(limit):
        report = fuzz(search, on_run=lambda report, spec, result: ran.append(budget.need(search.case(spec)).total))
    assert report.finding is None and ran and max(ran) <= limit, ran
    assert False in sized and sized.count(True) >= len(ran), sized


# --- out of memory on a rank: a resource failure ------------------------------------------------------------


def test_replay_reports_an_unsharded_out_of_memory_as_a_resource_failure(tmp_path, capsys):
    path = write(tmp_path, SMALL, "small-cp2.json")
    assert main(["replay", str(path), "--impl", f"{OOM}:bad_alloc"]) == 2
    captured = capsys.readouterr()
    why = "rank 0 ran out of memory (RuntimeError: std::bad_alloc) in the unsharded encoder"
    assert f"verdict: resource ({why})" in captured.out.splitlines(), captured.out
    assert captured.err == (f"vdpcp replay: {path}: {why}: a resource failure, not a verdict on the encoder or on "
                            f"sharding; run it where there is the memory, or shrink the spec\n")
    assert "rejects" not in captured.out + captured.err


def test_a_rank_out_of_memory_in_the_sharded_encoder_is_named_with_its_size(tmp_path, capsys):
    path = write(tmp_path, SMALL, "small-cp2.json")
    assert main(["replay", str(path), "--impl", f"{OOM}:cpu_allocator_rank1"]) == 2
    captured = capsys.readouterr()
    assert "verdict: resource (rank 1 ran out of memory: tried to allocate 96.0 GiB (RuntimeError: DefaultCPUAllocator" \
        in captured.out, captured.out
    assert "failing rank 1: raised RuntimeError: DefaultCPUAllocator: can't allocate memory" in captured.out
    assert captured.err.startswith(f"vdpcp replay: {path}: rank 1 ran out of memory: tried to allocate 96.0 GiB")


@pytest.mark.parametrize("target, expected", [
    ("memory_error", "rank 0 ran out of memory (MemoryError) in the unsharded encoder"),
    ("cuda", "rank 0 ran out of memory: tried to allocate 2.0 GiB (OutOfMemoryError: CUDA out of memory."),
])
def test_every_kind_of_allocation_failure_is_a_resource_failure(target, expected):
    judged = runner.run_judged(Case(MicrobatchSpec.from_dict(SMALL), 2, impl=f"{OOM}:{target}"))
    assert judged.verdict == "resource" and judged.why.startswith(expected), judged.why


def test_check_reports_a_resource_row_exit_1_and_a_junit_error(tmp_path, capsys):
    path = write(tmp_path, SMALL, "small-cp2.json")
    out = tmp_path / "out"
    assert main(["check", "--spec", str(path), "--cp", "2", "--impl", f"{OOM}:bad_alloc", "--json", str(out / "c.json"),
                 "--junit-xml", str(out / "c.xml")]) == 1
    assert "resource" in capsys.readouterr().out
    [record] = json.loads((out / "c.json").read_text())["results"]
    assert record["verdict"] == "resource" and record["why"].startswith("rank 0 ran out of memory")
    assert '<error message="resource: rank 0 ran out of memory' in (out / "c.xml").read_text()


def test_pytest_replay_fails_a_resource_failure_with_its_report(pytester, tmp_path):
    path = write(tmp_path, SMALL, "small-cp2.json")
    result = pytester.runpytest("--replay", str(path), "--replay-impl", f"{OOM}:bad_alloc")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["verdict: resource (rank 0 ran out of memory (RuntimeError: std::bad_alloc) in the unsharded encoder)"])


ADDRESS_SPACE = 8 << 30  # per process: torch imports in about 3.5 GB of address space; the image needs 96 GiB


def test_the_huge_image_with_the_limit_raised_fails_fast_as_a_resource_failure_under_an_address_space_cap(tmp_path):
    # The real thing, in a process of its own whose every rank is capped, so the allocation fails at once instead of
    # paging 100 GB in next to other jobs.
    path = write(tmp_path, HUGE_IMAGE, "huge.json")

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "VDPCP_MAX_CASE_TFLOP": "1e9"}  # past the compute limit too: this is the memory path
    done = subprocess.run([sys.executable, "-m", "vdpcp", "replay", str(path), "--cp", "1", "--max-spec-bytes", "16T",
                           "--backend", "gloo"], capture_output=True, text=True, preexec_fn=cap, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "verdict: resource (rank 0 ran out of memory: tried to allocate 96.0 GiB (RuntimeError: DefaultCPUAllocator: " \
           "can't allocate memory: you tried to allocate 103079215104 bytes. Error code 12 (Cannot allocate memory)))" \
           in done.stdout.splitlines(), done.stdout
    assert done.stderr.endswith("a resource failure, not a verdict on the encoder or on sharding; run it where there is the "
                                "memory, or shrink the spec\n"), done.stderr
    assert "rejects" not in done.stdout + done.stderr


# --- long specs are summarized -----------------------------------------------------------------------------


def test_replay_of_a_long_spec_summarizes_it_and_its_plan(tmp_path, capsys):
    data = {"name": "long-cp2", "images": [[4, 4]] * 300 + [[8, 4]] * 100, "seed": 2}
    path = write(tmp_path, data, "long-cp2.json")
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert f"spec: long-cp2: 400 images, 4-8 x 4 px, 1-2 patches each, 500 in all (patch_dim=4), seed 2; the whole spec: {path}" \
        in lines, out
    assert "  rank 0: image 0 (4x4), image 1 (4x4), image 2 (4x4), ... 195 more ..., image 198 (4x4), image 199 (4x4) " \
           "(200 patches)" in lines, out
    assert max(len(line) for line in lines) < 300 and "verdict: pass" in lines


def test_a_long_capture_error_is_not_printed_whole():
    with pytest.raises(Exception) as bad:
        capture([[16, 16, 3]] * 10_000, cp=2, patch_dim=4)
    assert len(str(bad.value)) < 300 and "(10,000 in all)" in str(bad.value)
