"""Ranks sharing one GPU taking turns for a phase of a case, one at a time.

gloo ranks with VDPCP_DEVICE=cuda share a GPU (fewer GPUs than ranks). A phase that needs no collective and much
memory (a case's unsharded arm, say) can then run on one rank at a time while the others wait, so the GPU holds
one such phase, not one per rank. The turn is an exclusive lock on a file named after the device, in the
machine's temporary folder: ranks of other pools on the same GPU wait too, and a rank that dies lets go.
"""

import fcntl
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def turn(device):
    """Hold ``device``'s turn for the block (no collective may run inside it: a peer may be waiting for it)."""
    path = Path(tempfile.gettempdir()) / f"vdpcp-{device.type}{device.index or 0}.turn"
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
