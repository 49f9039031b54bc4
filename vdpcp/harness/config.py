"""Defaults for what run_ranks is not told: the backend, the per-case timeout, the modules to preload.

Strongest first: the argument to run_ranks; configure() (the pytest plugin calls it with ``--backend``,
``--vdpcp-timeout`` and the ``vdpcp_preload`` ini setting, the CLI with its own flags); the
``VDPCP_BACKEND`` / ``VDPCP_TIMEOUT`` / ``VDPCP_PRELOAD`` environment; the built-in default (``auto``,
120 s, nothing beyond torch).
"""

import functools
import math
import os
from contextlib import contextmanager

from vdpcp.harness.errors import BackendUnavailable

BACKENDS = ("auto", "nccl", "gloo")
DEFAULT_TIMEOUT_S = 120.0

_configured: dict[str, object] = {}


def configure(*, backend: str | None = None, timeout: float | None = None, preload=None, tolerate_threads=None) -> None:
    """Set this process's defaults; None leaves a setting to the environment.

    ``preload``: module names the rank zygote imports once, after torch, so every worker forked from
    it has them for free (e.g. a heavy library every case imports). They must start no threads at
    import; the zygote refuses to fork otherwise. ``tolerate_threads``: prefixes of OS thread names
    the zygote accepts after its preload all the same, for a thread measured harmless to fork past
    (`python -m vdpcp.harness.forkcheck`); none by default. Changing either restarts the pool at the
    next case.
    """
    if backend is not None:
        _configured["backend"] = _checked_backend(backend, "configure(backend=...)")
    if timeout is not None:
        _configured["timeout"] = _checked_timeout(timeout, "configure(timeout=...)")
    if preload is not None:
        _configured["preload"] = tuple(preload)
    if tolerate_threads is not None:
        _configured["tolerate_threads"] = tuple(tolerate_threads)


@contextmanager
def configured(**settings):
    """configure(**settings) for the duration of a block, then every setting back as it was: an in-process
    CLI call (``vdpcp check --backend gloo``) or a pytest session must not leave its choices to the next."""
    saved = dict(_configured)
    try:
        configure(**settings)
        yield
    finally:
        _configured.clear()
        _configured.update(saved)


def default_backend() -> str:
    if "backend" in _configured:
        return _configured["backend"]
    return _checked_backend(os.environ.get("VDPCP_BACKEND", "auto"), "VDPCP_BACKEND")


def default_timeout() -> float:
    if "timeout" in _configured:
        return _configured["timeout"]
    env = os.environ.get("VDPCP_TIMEOUT")
    return DEFAULT_TIMEOUT_S if env is None else _checked_timeout(env, "VDPCP_TIMEOUT")


def default_preload() -> tuple[str, ...]:
    if "preload" in _configured:
        return _configured["preload"]
    return tuple(name.strip() for name in os.environ.get("VDPCP_PRELOAD", "").split(",") if name.strip())


def default_tolerated_threads() -> tuple[str, ...]:
    return _configured.get("tolerate_threads", ())


def resolve_backend(requested: str | None, ranks_per_host: int) -> str:
    """The concrete backend ("nccl" or "gloo") for a case with this many ranks on one host.

    auto: NCCL when there is a GPU for every rank, else gloo on CPU. nccl without enough GPUs raises
    BackendUnavailable.
    """
    name = _checked_backend(requested, "backend") if requested is not None else default_backend()
    if name == "gloo":
        return "gloo"
    gpus = cuda_device_count()
    if gpus >= ranks_per_host:
        return "nccl"
    if name == "nccl":
        raise BackendUnavailable(f"backend nccl needs {ranks_per_host} GPUs (one per rank), found {gpus}")
    return "gloo"


def planned_backend(requested: str | None, ranks_per_host: int) -> str:
    """The backend a case of this size is planned for: resolve_backend's, and "nccl" where NCCL is forced without
    the GPUs (running it raises BackendUnavailable; planning it must not)."""
    try:
        return resolve_backend(requested, ranks_per_host)
    except BackendUnavailable:
        return "nccl"


@functools.cache
def cuda_device_count() -> int:
    import torch  # only here: choosing gloo never pays for importing torch in the caller

    return torch.cuda.device_count()


def _checked_backend(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} is {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def _checked_timeout(value, source: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not (math.isfinite(seconds) and seconds > 0):  # inf would wait on a hung rank forever
        raise ValueError(f"{source} is {value!r}; expected a positive number of seconds")
    return seconds
