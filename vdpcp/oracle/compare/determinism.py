"""Deterministic algorithms, process-wide: on for a case where they make its backward exact (``deterministic``), off
for the stretches held only within a tolerance (``relaxed``), and the op a model ran that has no deterministic
kernel (``lacking``). The regrouped reference (vdpcp.oracle.compare.regrouped) holds gradients bitwise only where
``exact_grads`` says the backward was deterministic.

On CUDA they are strict ``torch.use_deterministic_algorithms(True)``, turned on for the case where the process
started with ``CUBLAS_WORKSPACE_CONFIG`` set (cuBLAS reads it when CUDA starts), and restored after; the CPU's
kernels already are deterministic. ``telemetry``: a rank's (RankResult.telemetry), whose ``deterministic`` says
what held.
"""

from __future__ import annotations

import os
import warnings
import weakref
from contextlib import contextmanager

import torch

NONDETERMINISTIC = "does not have a deterministic implementation"  # torch's error (its warning under warn_only)
CPU, ON = "cpu", "on"  # RankResult.deterministic where the backward is
STRICT = ("cuda",)  # devices whose cases run under deterministic algorithms (the CPU's kernels already are)
_LACKING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> an op it ran with no deterministic kernel


@contextmanager
def deterministic(device: torch.device, telemetry, model):
    """Deterministic algorithms for the case, where they make the backward exact: on CUDA, if cuBLAS can take
    them (CUBLAS_WORKSPACE_CONFIG set before CUDA started: the caller's environment, e.g.
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``). ``telemetry.deterministic`` says what held; the previous setting is
    restored after (it is process-global).

    They are strict (``warn_only=False``): under ``warn_only`` torch keeps flash and memory-efficient attention's
    backward on their non-deterministic kernels and says so once per process, so the regrouped run's gradients
    differ run to run and the exact check could not hold them. A ``model`` whose unsharded
    arm raised for an op with no deterministic kernel (``lacking``) runs under ``warn_only`` from then on, and its
    gradients are left to the whole-microbatch checks."""
    if device.type not in STRICT:
        telemetry.deterministic = CPU  # the CPU kernels the arms run are deterministic for a fixed thread count
        yield
        return
    if device.type == "cuda" and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        telemetry.deterministic = "off (CUBLAS_WORKSPACE_CONFIG unset when CUDA started)"
        yield
        return
    before = _setting()
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    op = _LACKING.get(model)
    torch.use_deterministic_algorithms(True, warn_only=op is not None)
    # cuDNN's attention backward has no deterministic kernel and says nothing, even under strict mode; flash and
    # memory-efficient attention have one, so SDPA picks one of them for the case.
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            telemetry.deterministic = ON if op is None else _none(op)
            yield
        for w in caught:
            if NONDETERMINISTIC in str(w.message):  # under warn_only: its gradients were not exact after all
                telemetry.deterministic = _none(str(w.message).split(" does not")[0])
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)


@contextmanager
def relaxed():
    """Deterministic algorithms off for a stretch held only within a tolerance (the exact run that measures the
    arms' rounding, vdpcp.oracle.compare.rounding.measure): nothing there is compared bit for bit, so it pays nothing for
    determinism (in float32 at the real size, attention's deterministic backward) and no op of it can be refused.
    The case's setting comes back after, for the sharded arm and the regrouped runs that are held exactly."""
    before = _setting()
    if not before[0]:
        yield
        return
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=before[1])


def lacking(model, err: BaseException, telemetry) -> bool:
    """Whether ``err`` is strict deterministic algorithms refusing an op of ``model`` that has no deterministic
    kernel (bilinear interpolation's CUDA backward, say). If so the op is remembered for the model, the rest of the
    case runs under ``warn_only``, and the caller runs its arm again; every rank raises alike there (the unsharded
    arm, before any collective), so every rank runs it again alike."""
    if _setting() != (True, False) or NONDETERMINISTIC not in str(err):
        return False
    _LACKING[model] = str(err).split(" does not")[0]
    torch.use_deterministic_algorithms(True, warn_only=True)
    telemetry.deterministic = _none(_LACKING[model])
    return True


def _setting() -> tuple[bool, bool]:
    """Deterministic algorithms' process-global setting: (on, warn_only), as use_deterministic_algorithms takes it."""
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _none(op: str) -> str:
    return f"on, but {op} has none"


def exact_grads(telemetry) -> bool:
    """Whether this rank's backward was deterministic, so its gradients can be held bitwise."""
    return telemetry.deterministic in (CPU, ON)
