"""A preload that starts a thread: the zygote never forks past it (unless the thread's name is tolerated), the
workers import it after the fork instead and the cases run, and forkcheck says which statement started it and
whether children forked after it still work."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from vdpcp.harness import config
from vdpcp.harness.outcome import OK
from vdpcp.harness.pool import Deferred, WorkerPool

REPO = Path(__file__).resolve().parents[2]

# A module whose body starts an OS thread named like a driver's helper, at a line the tests know.
DRIVER = '''import ctypes, threading

named = threading.Event()


def helper():
    ctypes.CDLL(None).prctl(15, b"fakedrv00042")  # PR_SET_NAME: the OS name, as /proc/self/task/*/comm shows it
    named.set()
    threading.Event().wait()


threading.Thread(target=helper, daemon=True).start()
named.wait(30)
'''
STARTING_LINE = 12


@pytest.fixture
def driver_module(tmp_path, monkeypatch):
    (tmp_path / "fake_driver.py").write_text(DRIVER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH")))))
    return tmp_path / "fake_driver.py"


def has_driver(ctx):
    return "fake_driver" in sys.modules


def test_a_preload_that_starts_a_thread_is_imported_after_the_fork_and_said_once(driver_module, capfd):
    pool = WorkerPool()
    try:
        first = pool.run(pickle.dumps((has_driver, (), {})), 2, "gloo", timeout=60, preload=("fake_driver",))
        again = pool.run(pickle.dumps((has_driver, (), {})), 2, "gloo", timeout=60, preload=("fake_driver",))
    finally:
        pool.shutdown()
    assert [(o.kind, o.value) for o in first + again] == [(OK, True)] * 4  # every worker imported it itself
    [deferred] = pool.deferred.values()
    assert (deferred.module, deferred.why) == ("fake_driver", "it leaves 1 thread(s) besides the main one (fakedrv00042)")
    assert capfd.readouterr().err.count("vdpcp harness: importing fake_driver makes forking unsafe") == 1


def test_a_tolerated_thread_is_forked_past(driver_module):
    pool = WorkerPool()
    try:
        outcomes = pool.run(pickle.dumps((has_driver, (), {})), 2, "gloo", timeout=60, preload=("fake_driver",),
                            tolerate_threads=("fakedrv",))
    finally:
        pool.shutdown()
    assert [(o.kind, o.value) for o in outcomes] == [(OK, True), (OK, True)]
    assert pool.deferred == {}


def has_torch(ctx):
    return "torch" in sys.modules


def test_where_torch_itself_is_unsafe_to_fork_past_the_workers_import_it(monkeypatch):
    pool = WorkerPool()
    pool.deferred["torch", ()] = Deferred("torch", "stand-in", 0.0)  # as if importing torch had started a thread
    try:
        outcomes = pool.run(pickle.dumps((has_torch, (), {})), 2, "gloo", timeout=60, preload=("xml.dom.minidom",))
        zygote_argv = pool._zygote.process.args
    finally:
        pool.shutdown()
    assert [(o.kind, o.value) for o in outcomes] == [(OK, True), (OK, True)]
    assert "--after-fork=torch,xml.dom.minidom" in zygote_argv and not any(a.startswith("--preload") for a in zygote_argv)


def test_forkcheck_names_the_statement_that_started_the_thread_and_forks_past_it(driver_module):
    done = subprocess.run([sys.executable, "-m", "vdpcp.harness.forkcheck", "fake_driver", "--fork", "--repeats", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["threads_after"] == ["fakedrv00042"]
    [appeared] = report["appeared"]
    assert appeared["threads"] == ["fakedrv00042"] and appeared["imports"] == ["fake_driver"]
    assert appeared["while"] == f"{driver_module}:{STARTING_LINE}"
    assert appeared["statement"] == "threading.Thread(target=helper, daemon=True).start()"
    assert {name: child["ok"] for name, child in report["children"].items()} == {"tensor op #1": True, "gloo pair": True}


def test_where_gpus_are_seen_a_preload_after_which_children_cannot_use_cuda_is_imported_after_the_fork(tmp_path,
                                                                                                       monkeypatch):
    # Counting devices through the CUDA runtime registers torch's fork handler: every child forked later is marked a
    # bad fork and raises at its first CUDA use (so on CPU too, where it is harmless). torch.cuda.is_available() does
    # that only where NVML is missing; where a driver answers NVML it asks NVML and the preload is kept, so the
    # preload calls the runtime's count itself, as is_available falls back to.
    (tmp_path / "counts_devices.py").write_text("import torch\n\ntorch._C._cuda_getDeviceCount()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH")))))
    monkeypatch.setattr(config, "cuda_device_count", lambda: 1)  # as the caller on a GPU machine sees it
    # Without NVML (this CPU machine) torch's own import counts them so, and torch is the one imported after the fork.
    pool = WorkerPool()
    try:
        outcomes = pool.run(pickle.dumps((has_module, ("counts_devices",), {})), 1, "gloo", timeout=60,
                            preload=("counts_devices",))
        after_fork = next(a for a in pool._zygote.process.args if a.startswith("--after-fork="))
    finally:
        pool.shutdown()
    assert [(o.kind, o.value) for o in outcomes] == [(OK, True)]
    assert "counts_devices" in after_fork.removeprefix("--after-fork=").split(",")
    assert all("PYTORCH_NVML_BASED_CUDA_CHECK=1" in deferred.why for deferred in pool.deferred.values())


def has_module(ctx, name):
    return name in sys.modules


# Without a driver (no NVML) torch counts devices through the CUDA runtime even under the NVML-based check, and the
# zygote's own import of torch.utils.cpp_extension does that: only a machine with GPUs shows a preload kept.
@pytest.mark.distributed
@pytest.mark.skipif(config.cuda_device_count() == 0, reason="needs a GPU (NVML): the GPU job runs it")
def test_where_gpus_are_seen_a_preload_that_leaves_forks_usable_is_kept():
    pool = WorkerPool()
    try:
        outcomes = pool.run(pickle.dumps((has_driver, (), {})), 1, "gloo", timeout=60, preload=("xml.dom.minidom",))
    finally:
        pool.shutdown()
    assert [o.kind for o in outcomes] == [OK]


def test_check_says_which_import_moved_after_the_fork_in_its_output_and_report(driver_module, tmp_path):
    report = tmp_path / "check.json"
    env = dict(os.environ, VDPCP_PRELOAD="fake_driver")
    done = subprocess.run([sys.executable, "-m", "vdpcp", "check", "--impl", "reference", "--cp", "2", "-k",
                           "three-images-cp2-reference-count", "--json", str(report)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = "vdpcp harness: importing fake_driver makes forking unsafe"
    assert line in done.stdout and done.stderr.count(line) == 1
    assert [entry.startswith(line) for entry in json.loads(report.read_text())["harness"]] == [True]
