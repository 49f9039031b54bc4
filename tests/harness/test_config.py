"""Choosing the backend and the timeout: arguments, then configure(), then the environment."""

import pytest

from vdpcp import pytest_plugin
from vdpcp.harness import BackendUnavailable, config, run_ranks


@pytest.fixture
def unconfigured(monkeypatch):
    """The harness's defaults as a process that never called configure() sees them."""
    monkeypatch.setattr(config, "_configured", {})
    for name in ("VDPCP_BACKEND", "VDPCP_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def never_runs(ctx):
    raise AssertionError("a case ran although its backend was unavailable")


def gpus(monkeypatch, count):
    monkeypatch.setattr(config, "cuda_device_count", lambda: count)


def test_a_case_is_planned_for_the_backend_it_will_run_on_and_forced_nccl_stays_nccl(monkeypatch):
    gpus(monkeypatch, 2)
    assert [config.planned_backend("auto", n) for n in (2, 4)] == ["nccl", "gloo"]
    assert config.planned_backend("gloo", 2) == "gloo"
    assert config.planned_backend("nccl", 4) == "nccl"  # running it raises BackendUnavailable; planning it does not
    with pytest.raises(BackendUnavailable):
        config.resolve_backend("nccl", 4)


def test_auto_takes_nccl_only_with_a_gpu_per_rank(monkeypatch):
    gpus(monkeypatch, 2)
    assert [config.resolve_backend("auto", n) for n in (1, 2, 4)] == ["nccl", "nccl", "gloo"]


def test_forced_nccl_without_enough_gpus_is_unavailable(monkeypatch):
    gpus(monkeypatch, 1)
    with pytest.raises(BackendUnavailable, match="nccl needs 2 GPUs .* found 1"):
        config.resolve_backend("nccl", 2)
    with pytest.raises(BackendUnavailable):
        run_ranks(never_runs, 2, backend="nccl")


def test_gloo_never_counts_gpus(monkeypatch):
    monkeypatch.setattr(config, "cuda_device_count", lambda: pytest.fail("counted GPUs for gloo"))
    assert config.resolve_backend("gloo", 8) == "gloo"


def test_defaults_come_from_configure_before_the_environment(unconfigured):
    assert (config.default_backend(), config.default_timeout()) == ("auto", config.DEFAULT_TIMEOUT_S)
    unconfigured.setenv("VDPCP_BACKEND", "gloo")
    unconfigured.setenv("VDPCP_TIMEOUT", "7.5")
    assert (config.default_backend(), config.default_timeout()) == ("gloo", 7.5)
    config.configure(backend="nccl", timeout=3)
    assert (config.default_backend(), config.default_timeout()) == ("nccl", 3.0)


@pytest.mark.parametrize("name, value", [("VDPCP_BACKEND", "mpi"), ("VDPCP_TIMEOUT", "soon"), ("VDPCP_TIMEOUT", "-1"),
                                         ("VDPCP_TIMEOUT", "inf"), ("VDPCP_TIMEOUT", "nan")])
def test_a_bad_setting_names_where_it_came_from(unconfigured, name, value):
    unconfigured.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} is '{value}'"):
        config.default_backend() if name == "VDPCP_BACKEND" else config.default_timeout()


def test_the_plugin_turns_an_unavailable_backend_into_a_skip():
    call = pytest_plugin.pytest_runtest_call(item=None)
    next(call)
    with pytest.raises(pytest.skip.Exception, match="needs 8 GPUs"):
        call.throw(BackendUnavailable("backend nccl needs 8 GPUs (one per rank), found 0"))
