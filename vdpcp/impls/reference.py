"""vdpcp's reference implementation (vdpcp.sharded) as an Implementation: count, balanced and packed splits."""

from __future__ import annotations

from vdpcp import sharded
from vdpcp.impls.base import Implementation, Ownership
from vdpcp.plan import STRATEGIES


class Reference(Implementation):
    name = "reference"
    splits = STRATEGIES

    def encode(self, model, batch):
        return sharded.encode_unsharded(model, batch)

    def encode_sharded(self, model, batch, config, group):
        return sharded.encode_sharded(model, batch, config, group)

    def plan(self, spec, config) -> Ownership | None:
        return sharded.ownership(sharded.plan_for(spec, config)) if config.shard_vision else None


reference = Reference()
