"""Subjects whose gather is a plain uneven ``torch.distributed.all_gather`` into per-rank tensors of each rank's
own size (the form Megatron-Bridge's Qwen3-VL gather takes: NCCL runs it, gloo alone refuses it), for
vdpcp.oracle.observe.gloo_collectives's tests. Selected by target (``tests.distributed.uneven_gather:uneven_gather``).

Each is the reference's sharded path with its gather written this way: forward, one all_gather of each rank's real
rows; backward, an all_reduce of the whole gradient, then this rank's own rows (zero for its placeholder rows).
"""

import torch
import torch.distributed as dist

from vdpcp.feature import sharded
from vdpcp.impls.reference import Reference


class _AllGatherUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, counts, expected, group):
        rank = dist.get_rank(group)
        ctx.group, ctx.start, ctx.rows, ctx.local_rows = group, sum(counts[:rank]), counts[rank], local.shape[0]
        outputs = [local.new_empty(n, *local.shape[1:]) for n in expected]
        dist.all_gather(outputs, local[: counts[rank]].contiguous(), group=group)
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        own = grad.new_zeros(ctx.local_rows, *grad.shape[1:])
        own[: ctx.rows] = grad[ctx.start : ctx.start + ctx.rows]
        return own, None, None, None


class UnevenGather(Reference):
    name = "uneven-gather"
    splits = ("count",)

    def expected_counts(self, counts: list[int], rank: int) -> list[int]:
        """The rows this rank expects from each rank: what each sends."""
        return counts

    def encode_sharded(self, model, batch, config, group):
        if not config.shard_vision:
            return super().encode_sharded(model, batch, config, group)
        plan = sharded.plan_for(batch.spec, config)
        rank = dist.get_rank(group)
        shard = plan.shard(rank)
        local = sharded.split(batch, shard, plan.order)
        projected = model.project(model.encode(local, shard.imgs_sizes, shard.num_frames))
        counts = sharded.real_tokens(plan)
        gathered = _AllGatherUneven.apply(projected, counts, self.expected_counts(counts, rank), group)
        index = sharded.image_order(plan)
        return gathered if index is None else gathered.index_select(0, torch.tensor(index, device=gathered.device))


class MiscountedGather(UnevenGather):
    """Its last rank expects more rows from rank 0 than rank 0 sends (more than its own, so that rank too sees
    uneven sizes): sizes NCCL would leave undefined."""

    name = "miscounted-gather"

    def expected_counts(self, counts, rank):
        last = len(counts) - 1
        return [n + counts[last] + 1 if (r, rank) == (0, last) else n for r, n in enumerate(counts)]


uneven_gather = UnevenGather()
miscounted_gather = MiscountedGather()
