"""What a rank held and how long it took: seconds per phase and, on CUDA, peak memory, for the report and
vdpcp bench; figures, never asserted."""

from __future__ import annotations

import time

import torch

from vdpcp.matrix.case import Telemetry
from vdpcp.oracle.unsharded import Unsharded


class Clock:
    """Seconds per phase of a case on this rank (build, unsharded, exact, sharded, gradients: their sums over ranks
    and comparison), into ``telemetry.seconds``. On CUDA each lap waits for the device first: kernels run after the
    host queued them, so an unsynchronised lap bills a phase's GPU work to whichever later phase first waits for
    a result, and the phases could not say which was slow."""

    def __init__(self, telemetry: Telemetry, device: torch.device | None = None):
        self.telemetry, self.device = telemetry, device
        self.last = self._now()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.telemetry.seconds[phase] = round(now - self.last, 4)
        self.last = now

    def _now(self) -> float:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class Memory:
    """On CUDA, this rank's peak allocated bytes over the case and what it held (vdpcp bench towers prints it)."""

    def __init__(self, device: torch.device):
        self.device, self.peaks = device, {}
        if device.type == "cuda":
            torch.cuda.init()  # a worker's first case: resetting the allocator's statistics needs CUDA up
            torch.cuda.reset_peak_memory_stats(device)

    def phase(self, name: str) -> None:
        """The peak since the last phase, as ``name``; the next phase's counted from now."""
        if self.device.type == "cuda":
            self.peaks[name] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def figures(self, model, unsharded: Unsharded | None) -> dict[str, int]:
        held = {"model": _bytes(model.parameters()) + _bytes(model.buffers())}
        if unsharded is not None:
            held["unsharded grads"] = _bytes(unsharded.grads or [])
            held["rank-alone grads"] = _bytes(unsharded.own_grads or [])
        if self.peaks:
            held.update(self.peaks)
            held["peak"] = max(self.peaks.values())
        return held


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
