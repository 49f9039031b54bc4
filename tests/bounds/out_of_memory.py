"""Implementations that run out of memory the ways real ranks do, each at once and without allocating anything:
what vdpcp must report as a resource failure naming the rank and the size, never as the encoder's verdict.
Selected by ``module:object`` target (tests.bounds.out_of_memory:<name>); nobody registers them."""

import torch
import torch.distributed as dist

from vdpcp.impls.reference import Reference

# What torch's CPU allocator, the C++ runtime, Python and CUDA say.
CPU_ALLOCATOR = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 103079215104 bytes. "
                 "Error code 12 (Cannot allocate memory)")


class RaisesInEncode(Reference):
    """The unsharded encoder (so every rank) raises ``error``."""

    def __init__(self, error):
        self.error = error
        self.name = f"oom-{type(error).__name__}"

    def encode(self, model, batch):
        raise self.error


class RaisesOnOneRank(Reference):
    """The sharded encoder of CP rank ``rank`` alone raises ``error``; its peers wait in the gather."""

    def __init__(self, error, rank: int):
        self.error, self.rank = error, rank
        self.name = f"oom-rank{rank}"

    def encode_sharded(self, model, batch, config, group):
        if dist.get_rank(group) == self.rank:
            raise self.error
        return super().encode_sharded(model, batch, config, group)


bad_alloc = RaisesInEncode(RuntimeError("std::bad_alloc"))
memory_error = RaisesInEncode(MemoryError())
cuda = RaisesInEncode(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                             "capacity of 139.8 GiB of which 1.2 GiB is free."))
cpu_allocator_rank1 = RaisesOnOneRank(RuntimeError(CPU_ALLOCATOR), rank=1)
