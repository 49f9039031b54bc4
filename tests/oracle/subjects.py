"""Implementations that are right, or wrong, in how they distribute the work, for the oracle's own tests.

Each is the reference (vdpcp.impls.reference) with one thing changed; nobody registers them: tests select
them by ``module:object`` target (``tests.oracle.subjects:replicating``), so rank workers resolve them too.
"""

import zlib
from dataclasses import replace

import torch
import torch.distributed as dist

from vdpcp.impls.reference import Reference
from vdpcp.mutants import gradient_changed
from vdpcp.protocol import MediaAxes, check_group
from vdpcp.spec import MicrobatchSpec


class Replicating(Reference):
    """Encodes every image on every rank and issues no collective: right features, right gradients, no sharding.
    It says it shards (its plan is the reference's), as an implementation whose split silently fell through would."""

    name = "replicating"
    splits = ("count",)

    def encode_sharded(self, model, batch, config, group):
        check_group(config, dist.get_world_size(group), self.name)
        return self.encode(model, batch)


class StalePlan(Reference):
    """Shards as the reference's packed split does, but states the count plan: an equivalent change of partition
    whose plan was never updated. Features and summed gradients are right; the plan is not what ran."""

    name = "stale-plan"
    splits = ("count",)

    def encode_sharded(self, model, batch, config, group):
        return super().encode_sharded(model, batch, replace(config, strategy="packed"), group)


class Thresholded(Reference):
    """A fallback policy: microbatches of fewer than ``min_images`` images are encoded whole on every rank."""

    name = "thresholded"
    splits = ("count",)
    min_images = 4

    def replicated(self, spec, config):
        return f"fewer than {self.min_images} images" if len(spec.images) < self.min_images else None

    def encode_sharded(self, model, batch, config, group):
        if self.replicated(batch.spec, config):
            check_group(config, dist.get_world_size(group), self.name)
            return self.encode(model, batch)
        return super().encode_sharded(model, batch, config, group)


class IgnoresItsPolicy(Thresholded):
    """States the fallback policy, but shards anyway."""

    name = "ignores-its-policy"

    def encode_sharded(self, model, batch, config, group):
        return Reference.encode_sharded(self, model, batch, config, group)


class TwoOutputs(Reference):
    """Two outputs over the same token rows, as a tower with DeepStack features has: the merged features and a
    second level (here the features through a fixed nonlinearity, so its gradients differ from the first's)."""

    name = "two-outputs"
    splits = ("count",)

    def encode(self, model, batch):
        features = super().encode(model, batch)
        return {"features": features, "deepstack0": features.tanh()}

    def encode_sharded(self, model, batch, config, group):
        features = super().encode_sharded(model, batch, config, group)
        return {"features": features, "deepstack0": features.tanh()}


class SecondOutputUngathered(TwoOutputs):
    """The second output is each rank's own rows, placed in a full-size tensor of zeros: it was never gathered."""

    name = "second-output-ungathered"

    def encode_sharded(self, model, batch, config, group):
        out = super().encode_sharded(model, batch, config, group)
        if not config.shard_vision:
            return out
        plan = self.plan(batch.spec, config)
        rank = dist.get_rank(group)
        own = [owner == rank for owner, tokens in zip(plan.owner, plan.tokens) for _ in range(tokens)]
        mask = out["deepstack0"].new_tensor(own).unsqueeze(-1)
        return {**out, "deepstack0": out["deepstack0"] * mask}


replicating = Replicating()
stale_plan = StalePlan()
thresholded = Thresholded()
ignores_its_policy = IgnoresItsPolicy()
two_outputs = TwoOutputs()
second_output_ungathered = SecondOutputUngathered()


class OwnPartition(Reference):
    """The reference's count split under a name of its own, a tower with a local floor of 50 patch rows, and a
    microbatch of its own: what an implementation from outside declares about itself."""

    name = "own-partition"
    splits = ("contiguous",)
    media = MediaAxes(patch_dim=8, temporal_patch_sizes=(1, 2), min_grid=2, min_rows_per_rank=50)

    def encode_sharded(self, model, batch, config, group):
        return super().encode_sharded(model, batch, replace(config, strategy="count"), group)

    def plan(self, spec, config):
        return super().plan(spec, replace(config, strategy="count"))

    def scenarios(self):
        return (MicrobatchSpec(images=((64, 64),) * 3, patch_dim=8, seed=3, name="own-three-large"),)


own_partition = OwnPartition()


class RoundsApart(Reference):
    """The reference whose sharded input gradients come out ``apart`` (relative) from the exact ones: a stand-in
    for a correct implementation whose sums round differently, to hold the low-precision comparison to its bounds."""

    name = "rounds-apart"
    splits = ("count",)

    def __init__(self, apart: float):
        self.apart = apart

    def encode_sharded(self, model, batch, config, group):
        patches = gradient_changed(batch.patches, lambda grad: grad * (1 + self.apart))
        return super().encode_sharded(model, replace(batch, patches=patches), config, group)


# float32's rtol for gradients as vectors is 1.3e-6; the reference's float32 unsharded run is about 3.4e-7 from
# float64 on three-images, so the slack the oracle measures there is about 6.7e-7 (its failure message prints half
# of it): 1.6e-6 apart is within rtol + slack, 2.3e-6 beyond (tests/oracle/test_rounding.py).
within_the_slack = RoundsApart(1.6e-6)
beyond_the_slack = RoundsApart(2.3e-6)


class BatchVariant(Reference):
    """The reference as a deep tower runs in bf16 on a GPU: an encode's rows come out ``noise`` (relative) away from
    exact, according to the group they were encoded in, because a row's value depends on what else is in its batch
    (vdpcp.precision). The same group gives the same noise, as the same kernels give the same bits (issue 35's
    measurement): the sharded rows carry their rank's group's noise, the unsharded rows the whole microbatch's. In
    float32 and float64 (the exact run) it is exact. Correct: only the measured slack tells it from a bug."""

    name = "batch-variant"
    splits = ("count",)
    noise = 0.03  # about what the H200 measured at Qwen2.5-VL-7B's size in bf16 (2.3% from float64, 2.6% apart)

    def encode(self, model, batch):
        out = super().encode(model, batch)
        return self._rounded(out, [(torch.arange(out.shape[0]), batch.spec.images)])

    def encode_sharded(self, model, batch, config, group):
        out = super().encode_sharded(model, batch, config, group)
        if not config.shard_vision:
            return self._rounded(out, [(torch.arange(out.shape[0]), batch.spec.images)])
        plan, start = self.plan(batch.spec, config), [0]
        for n in plan.tokens:
            start.append(start[-1] + n)
        groups = []
        for rank in range(dist.get_world_size(group)):
            rows = plan.rows_of(rank)
            tokens = [t for r in rows for t in range(start[r], start[r + 1])]
            groups.append((torch.tensor(tokens, dtype=torch.long), tuple(batch.spec.images[r] for r in rows)))
        return self._rounded(out, groups)

    def _rounded(self, out, groups):
        """``out`` with each group's token rows off by noise drawn from that group's image sizes."""
        if out.dtype != torch.bfloat16:
            return out
        jitter = torch.zeros(out.shape, dtype=torch.float64)
        for tokens, images in groups:
            gen = torch.Generator().manual_seed(zlib.crc32(repr(tuple(images)).encode()))
            jitter[tokens] = torch.randn((len(tokens), *out.shape[1:]), generator=gen, dtype=torch.float64)
        jitter = jitter.to(out.device, out.dtype)
        return out + (self.noise * jitter * out.detach().abs()).detach()  # forward off, gradient untouched


class BatchVariantOneRowWrong(BatchVariant):
    """BatchVariant with one gathered token row wrong by 30% on every rank: a real bug, as large as one misplaced
    token's worth, that only a per-row comparison keeps from hiding in a per-image or whole-tensor norm."""

    name = "batch-variant-one-row-wrong"

    def encode_sharded(self, model, batch, config, group):
        out = super().encode_sharded(model, batch, config, group)
        scale = torch.ones(out.shape[0], 1, dtype=out.dtype, device=out.device)
        scale[out.shape[0] // 2] = 1.3
        return out * scale if config.shard_vision else out


class ChangesItsWeights(Reference):
    """Right in every result, but its sharded encode nudges the projector's last bias in place afterwards (an
    optimizer step or a debug hook left in; a bias, so autograd's saved tensors stay valid): the next case would
    see other weights."""

    name = "changes-its-weights"
    splits = ("count",)

    def encode_sharded(self, model, batch, config, group):
        out = super().encode_sharded(model, batch, config, group)
        with torch.no_grad():
            model.projector[-1].bias.add_(1e-3)
        return out


batch_variant = BatchVariant()
batch_variant_one_row_wrong = BatchVariantOneRowWrong()
changes_its_weights = ChangesItsWeights()
