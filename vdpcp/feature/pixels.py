"""How a case's pixels reach the implementation (``Case.pixels``).

``tower``: in the tower's dtype, on its device, as a framework hands its encoder a batch it already cast and moved.
``loader``: as a data loader or an image processor yields them, float32 on the host (in pinned memory where the
tower is on a GPU, as a loader with ``pin_memory=True`` hands them), whatever the tower's dtype: the implementation's
own cast and move are then what runs, and with them the bugs that follow the pixels' dtype or device (an empty
rank's placeholder built like the pixels, every rank moving the whole microbatch). The metadata (sizes, cu_seqlens)
stay on the tower's device either way: they are not what a rank's share is made of.
"""

from __future__ import annotations

from dataclasses import replace

import torch

LOADER_DTYPE = torch.float32  # what image processors yield


def handed(spec, pixels: str, dtype: torch.dtype, device, host: bool = True) -> object:
    """The microbatch as the case hands it to the implementation (a vdpcp.feature.spec.Microbatch); ``host``: a loader's
    pixels on the host (False: on the device already, where the implementation's framework moves its batches)."""
    batch = spec.tensors(dtype=dtype, device=device)
    if pixels == "tower":
        return batch
    loaded = spec.tensors(dtype=LOADER_DTYPE).patches
    return replace(batch, patches=_host(loaded, device) if host else loaded.to(device))


def loader_pixels(impl) -> str | None:
    """How the implementation takes pixels as a loader hands them (Implementation.loader_pixels)."""
    return getattr(impl, "loader_pixels", "device")


def moves_pixels(impl, pixels: str) -> bool:
    """Whether a case whose pixels arrive as ``pixels`` hands the implementation host pixels that it moves itself
    (its declaration, loader_pixels), so that its host-to-device traffic is counted (vdpcp.oracle.observe.traffic)."""
    return pixels == "loader" and loader_pixels(impl) == "host"


def fresh(patches: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A leaf copy of ``patches`` for another arm, where they are (pinned again if they were)."""
    copy = patches.detach().clone()
    if copy.device.type == "cpu" and patches.is_pinned():
        copy = copy.pin_memory()
    return copy.requires_grad_(requires_grad)


def as_tower_sees(patches: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """``patches`` as the tower's first layer takes them: in its dtype, on its device (a loader's float32 pixels
    rounded to a bf16 tower's dtype, say), for a run that must see the values the arms' towers saw."""
    return patches.to(device=device, dtype=dtype)


def on_host(patches: torch.Tensor, device) -> bool:
    """Whether ``patches`` start off ``device``'s memory, so a rank moves them itself (only where the tower is on
    an accelerator: on the CPU, host and device are one memory)."""
    return torch.device(device).type != "cpu" and patches.device.type == "cpu"


def _host(patches: torch.Tensor, device) -> torch.Tensor:
    return patches.pin_memory() if torch.device(device).type == "cuda" else patches
