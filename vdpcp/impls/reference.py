"""vdpcp's reference implementation (vdpcp.feature.sharded) as an Implementation: count, balanced and packed splits."""

from __future__ import annotations

from vdpcp.contract.protocol import Balance, Implementation, MediaAxes, Ownership
from vdpcp.feature import sharded
from vdpcp.feature.model import REAL_PATCH
from vdpcp.feature.plan import STRATEGIES


class Reference(Implementation):
    name = "reference"
    splits = STRATEGIES
    pixel_grads = True  # its shards are views of the pixels (vdpcp.feature.sharded): gradients reach every real patch
    loader_pixels = "host"  # each rank moves its own shard of a loader's host pixels to its device (vdpcp.feature.sharded)
    tensor_parallel = (2,)  # TP sizes of its tower (vdpcp.feature.tensor_parallel): the matrix runs CP x TP layouts

    towers = {"toy": MediaAxes(), "real": MediaAxes(patch_dim=REAL_PATCH)}

    def subject_model(self, reference, case, dtype, device):
        """At TP > 1 a copy of the plain reference with its MLPs split over the case's TP group: the reference stays
        the plain tower (build_model is the default), so the TP tower is held to it, not to itself."""
        if case.tp == 1:
            return reference
        import copy

        from vdpcp.feature import layout, tensor_parallel

        model = copy.deepcopy(reference)
        return tensor_parallel.parallelize(model, layout.groups(layout.Layout(case.cp, case.dp, case.tp)).tp)

    def encode(self, model, batch):
        return sharded.encode_unsharded(model, batch)

    def encode_sharded(self, model, batch, config, group):
        return sharded.encode_sharded(model, batch, config, group)

    def plan(self, spec, config) -> Ownership | None:
        return sharded.ownership(sharded.plan_for(spec, config)) if config.shard_vision else None

    def balance(self, case) -> Balance | None:
        """balanced and packed minimise the busiest rank's cost (its config's), contiguous or in any order; count
        divides by count and promises no balance."""
        config = case.config
        if config.strategy == "count":
            return None
        return Balance(config.cost, contiguous=config.strategy == "balanced", alpha=config.alpha)


reference = Reference()
