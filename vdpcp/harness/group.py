"""A worker's process group: kept across cases with the same GroupSpec, rebuilt when it changes."""

import os

import torch
import torch.distributed as dist

from vdpcp.harness.messages import GroupSpec

_current: GroupSpec | None = None


def ensure(spec: GroupSpec, rank: int) -> None:
    """Make the default process group the one ``spec`` describes, with this worker as ``rank``."""
    global _current
    if spec == _current:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = None
    if spec.backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(spec.store_path, spec.world_size)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size)
    _current = spec


def device(backend: str, local_rank: int) -> torch.device:
    """cuda:<local rank> on NCCL; on gloo the CPU, or with VDPCP_DEVICE=cuda a GPU that several gloo ranks may
    share (gloo moves CUDA tensors), which runs the CUDA path on fewer GPUs than ranks."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    wanted = os.environ.get("VDPCP_DEVICE", "cpu")
    if wanted not in ("cpu", "cuda"):
        raise ValueError(f"VDPCP_DEVICE is {wanted!r}; expected cpu or cuda")
    if wanted == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
