"""Ranks sharing one GPU taking turns for a phase of a case, a few at a time.

gloo ranks with VDPCP_DEVICE=cuda share a GPU (fewer GPUs than ranks). A phase that needs no collective and much
memory (a case's unsharded arm, say) can then run on a few ranks at a time while the others wait, so the GPU holds
that many such phases, not one per rank. A turn is an exclusive lock on one of the device's slots, a file named
after the device and the slot in the machine's temporary folder: ranks given the same slot go one after another
(ranks of other pools on the same GPU too), and a rank that dies lets go.
"""

import fcntl
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def turn(device, slot: int = 0):
    """Hold ``device``'s turn in ``slot`` for the block (no collective may run inside it: a peer may be waiting for
    it). Ranks in different slots run their turns at once."""
    path = Path(tempfile.gettempdir()) / f"vdpcp-{device.type}{device.index or 0}{f'-{slot}' if slot else ''}.turn"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def shared(backend: str, device, world_size: int) -> bool:
    """Whether ranks of this world share ``device``: gloo ranks on CUDA when there are fewer GPUs than ranks."""
    if backend != "gloo" or device.type != "cuda":
        return False
    import torch

    return world_size > torch.cuda.device_count()
