"""A deliberately broken Qwen2.5-VL adapter: its gather's backward keeps each rank's own gradient instead of
summing it over the CP group, so an image's features miss what the other ranks' losses asked of them. Nobody
registers it: tests select it by its ``module:object`` target, ``tests.impls.broken_qwen:broken``."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vdpcp.impls.qwen2_5_vl import PLACEHOLDER_TOKENS, Qwen25VL


class GatherWithoutSum(torch.autograd.Function):
    """The forward of the adapter's gather; the backward of a data-parallel habit: keep what is local."""

    @staticmethod
    def forward(ctx, local, kept, group):
        longest = max(*kept, PLACEHOLDER_TOKENS)
        padded = F.pad(local, (0, 0, 0, longest - local.shape[0])).contiguous()
        shards = [torch.empty_like(padded) for _ in kept]
        dist.all_gather(shards, padded, group=group)
        ctx.rows, ctx.kept, ctx.rank = local.shape[0], kept, dist.get_rank(group)
        return torch.cat([shard[:n] for shard, n in zip(shards, kept)])

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.kept[: ctx.rank])
        own = grad[start : start + ctx.kept[ctx.rank]]
        return F.pad(own, (0, 0, 0, ctx.rows - own.shape[0])), None, None


class GradNotSummed(Qwen25VL):
    name = "broken_qwen"

    def gather(self, local, kept, group):
        return GatherWithoutSum.apply(local, kept, group)


broken = GradNotSummed()
