"""vdpcp's reference implementation (vdpcp.sharded) as an Implementation: count, balanced and packed splits."""

from __future__ import annotations

import torch

from vdpcp import sharded
from vdpcp.plan import STRATEGIES
from vdpcp.protocol import Implementation, Ownership


class Reference(Implementation):
    name = "reference"
    splits = STRATEGIES
    tensor_parallel = (2,)  # TP sizes of its tower (vdpcp.tensor_parallel): the matrix runs CP x TP layouts

    def build_model(self, case, dtype, device):
        model = super().build_model(case, dtype, device)
        if case.tp == 1:
            return model
        from vdpcp import layout, tensor_parallel

        tp_group = layout.groups(layout.Layout(case.cp, case.dp, case.tp)).tp
        return tensor_parallel.parallelize(model.to(torch.float64), tp_group).to(device=device, dtype=dtype)

    def encode(self, model, batch):
        return sharded.encode_unsharded(model, batch)

    def encode_sharded(self, model, batch, config, group):
        return sharded.encode_sharded(model, batch, config, group)

    def plan(self, spec, config) -> Ownership | None:
        return sharded.ownership(sharded.plan_for(spec, config)) if config.shard_vision else None


reference = Reference()
