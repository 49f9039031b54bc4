"""Every test starts from a known state and leaves it so; rank workers start with the heavy imports preloaded.

The preload: the case modules and the imports of the built-ins (MCore) and of the adapters tested in tests/impls
(transformers' Qwen2.5-VL and Qwen3-VL towers, Automodel's sharding), and pytest, one import per pool, not one per
rank. The guard: a test (or an in-process CLI call inside it) that leaves the harness configuration, the spec limit, the
environment, torch's default dtype or a SIGTERM/SIGINT handler changed fails, so no setting reaches the next test
(a GPU job once ran gloo because one did).
"""

import os
import signal
from importlib.metadata import entry_points

import pytest
import torch

from vdpcp.harness import config as harness_config
from vdpcp.impls import BUILT_INS
from vdpcp.matrix import budget
from vdpcp.matrix.runner import preload_case_modules

# The suite's own rank bodies live in test modules, which import pytest: preloaded, a worker forked fresh after a
# fault does not import it again with its first such body.
SUITE_PRELOAD = ("pytest",)


def pytest_configure(config):
    # The plugin's session settings scope it (restored at pytest_unconfigure); a vdpcp_preload setting wins.
    preload_case_modules((*BUILT_INS, "qwen2_5_vl", "automodel"), extra=SUITE_PRELOAD)


# Not settings a test chose: pytest's own per-phase marker, and the cache folder torch's inductor exports the first
# time a process imports it (through megatron-core or transformers, in whichever test first does).
NOT_SETTINGS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


def _process_settings() -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in NOT_SETTINGS}
    return {"harness configuration": dict(harness_config._configured), "spec limit": budget.override(),
            "environment": environment, "torch default dtype": torch.get_default_dtype(),
            "signal handlers": {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}}


@pytest.fixture(autouse=True)
def no_setting_leaks():
    before = _process_settings()
    yield
    after = _process_settings()
    changed = [name for name in before if before[name] != after[name]]
    assert not changed, f"this test left process-global settings changed: {changed}"


@pytest.fixture
def on_the_cpu(monkeypatch):
    """Gloo ranks keep their tensors on the CPU and cases are sized for this machine's CPU, whatever the job exports:
    a GPU runner may set VDPCP_DEVICE=cuda job-wide (the README does for the real-size step), and a test that asserts
    a CPU fact (the "ran on" column, figures not measured off a GPU, the CPU's limits) must choose the CPU itself.
    The rank workers read the caller's environment at every case, so they see it too. The backend too: on a machine
    with GPUs ``auto`` picks NCCL for a case that fits them, and sizes it for the GPU."""
    monkeypatch.delenv("VDPCP_DEVICE", raising=False)
    monkeypatch.setenv("VDPCP_BACKEND", "gloo")


def _plugin_autoloads() -> bool:
    """Whether a pytest session started inside a test loads vdpcp's plugin by itself: by its pytest11 entry point,
    where vdpcp is installed and plugin autoload is on."""
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == "vdpcp.pytest_plugin" for ep in entry_points(group="pytest11"))


@pytest.fixture
def pytester(pytester, monkeypatch):
    """pytest's pytester, whose sessions load vdpcp's plugin also where vdpcp runs from a checkout, not installed (a
    GPU runner's ``PYTHONPATH=$PWD python3 -m pytest -p vdpcp.pytest_plugin``, where an inner session would refuse
    ``--replay`` as an unknown option). PYTEST_PLUGINS is what pytest reads for that; the
    monkeypatch takes it back after the test."""
    if not _plugin_autoloads():
        monkeypatch.setenv("PYTEST_PLUGINS", "vdpcp.pytest_plugin")
    return pytester
