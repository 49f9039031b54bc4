"""Host-to-device traffic: the bytes of a microbatch's host pixels one rank copies to its tower's device.

Where a loader hands pixels on the host (vdpcp.feature.pixels), a sharded rank should move only its share: the rows its
tower reads. A rank that moves the whole microbatch and slices it on its device (the field's N host-to-device copies
and N x the pixel memory) computes the right features, so only the traffic shows it.

``Copies`` counts, while it is open, every copy of host memory to a device: ``Tensor.to`` / ``.cuda`` naming a
device, and ``copy_`` into a device tensor, from the pixels or from anything made of them on the host (a view, a
cast, a slice, a cat, a placeholder of their dtype and device), counted in the bytes it reads there. On a machine
with no accelerator, host and device are one memory and a move is no copy at all; there the device a ``.to`` names
stands in for the accelerator (the stand-in): the move is counted as if it crossed, and its result is a copy of its
own, as a device tensor would be, so that the same pixels moved again from there are not counted twice.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# A rank may copy the rows its tower reads, plus this many patches (a placeholder or an even-grid pad made from the
# pixels on the host and moved with them) or this share of its own rows, whichever is more.
SLACK_PATCHES = 16
SLACK_SHARE = 1 / 8
_MOVES = (torch.Tensor.to, torch.Tensor.cuda)


class Copies(TorchFunctionMode):
    """While open: ``bytes``, what was copied of ``patches`` (host pixels) to ``device``."""

    def __init__(self, patches: torch.Tensor, device):
        super().__init__()
        self.device = torch.device(device)
        self.stand_in = self.device.type == "cpu"
        self.bytes = 0
        self._host: set[int] = set()
        self._kept: list[torch.Tensor] = []
        self._hold([patches])

    def _hold(self, tensors) -> None:
        """Storages in host memory, by address; each kept alive while open, so that no address is freed and reused
        by a tensor that holds nothing of the pixels."""
        for t in tensors:
            ptr = _storage(t)
            if ptr != -1 and ptr not in self._host:
                self._host.add(ptr)
                self._kept.append(t)

    def __exit__(self, *exc):
        self._kept.clear()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _MOVES and source is not None and self._held(source):
            target = self._target(func, args, kwargs)
            if target is not None:
                self.bytes += source.numel() * source.element_size()
                out = func(*args, **kwargs)
                return out.clone() if self.stand_in and _storage(out) in self._host else out
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor) and self._held(args[1]):
            if not self._held(source) and (source.device.type != "cpu" or self.stand_in):
                self.bytes += args[1].numel() * args[1].element_size()
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if any(self._held(t) for t in _tensors(args, kwargs)):  # made on the host from host memory: host memory
            self._hold(t for t in _tensors(out) if t.device.type == "cpu")
        return out

    def hosts(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in host memory: on the CPU where the tower is not, or, on the stand-in, made on the host
        from the pixels (or from anything made of them there, a placeholder of their dtype and device included)."""
        return t.device.type == "cpu" and (not self.stand_in or self._held(t))

    def _held(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and _storage(t) in self._host

    def _target(self, func, args, kwargs):
        """The device a move names (None: a cast on the host, no copy to a device)."""
        if func is torch.Tensor.cuda:
            return torch.device("cuda")
        device = _named_device(args[1:], kwargs)
        if device is None or (device.type == "cpu" and not self.stand_in):
            return None
        return device


def _storage(t: torch.Tensor) -> int:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own (a wrapper subclass): not host pixels
        return -1
    return ptr or -1  # every empty tensor's storage is at 0: none holds anything


def _named_device(args, kwargs) -> torch.device | None:
    """The device ``Tensor.to(*args, **kwargs)`` names: its ``device=``, a device, string or ordinal among its
    arguments, or the device of a tensor it is to match (None: a cast only)."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
        if isinstance(arg, (torch.device, str)) or (isinstance(arg, int) and not isinstance(arg, bool)):
            return torch.device(arg)
    return None


def _tensors(*trees) -> list[torch.Tensor]:
    """The tensors in ``trees`` (nested tuples, lists and dict values), in order."""
    found, stack = [], list(reversed(trees))
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found


def allowed(whole: int, read_patches: int, patches: int) -> int:
    """What a rank may copy when its tower read ``read_patches`` of the microbatch's ``patches``, where the unsharded
    encode copied ``whole`` bytes for all of them (in the implementation's own layout, which may hold a patch twice):
    that share of ``whole``, plus SLACK_PATCHES patches' worth or SLACK_SHARE of the share, whichever is more."""
    per_patch = whole / max(patches, 1)
    share = per_patch * read_patches
    return int(share + max(SLACK_PATCHES * per_patch, SLACK_SHARE * share))


def judge(copied: int, whole: int, read_rows, spec, rank: int, cp: int) -> str | None:
    """The not-sharded line for a rank that copied more of the host pixels than its share, or None."""
    patches = sum(spec.row_patches)
    read = sum(spec.row_patches[row] for row in read_rows)
    limit = allowed(whole, read, patches)
    if copied <= limit:
        return None
    return (f"not sharded: rank {rank} copied {copied:,} bytes of host pixels to its device, {copied / max(whole, 1):.2g}x "
            f"what the unsharded encode copied for the whole microbatch ({whole:,}), where its tower read {read} of "
            f"{patches} patches (allowed {limit:,}; at CP {cp}, every rank moving the whole microbatch and slicing it "
            f"there is CP x the host-to-device traffic and pixel memory)")
