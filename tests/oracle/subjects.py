"""Implementations that are right, or wrong, in how they distribute the work, for the oracle's own tests.

Each is the reference (vdpcp.impls.reference) with one thing changed; nobody registers them: tests select
them by ``module:object`` target (``tests.oracle.subjects:replicating``), so rank workers resolve them too.
"""

import zlib
from dataclasses import replace

import torch
import torch.distributed as dist

from vdpcp.contract.protocol import GROUP_MISMATCH_TEXT, GroupMismatchError, KnownLimit, MediaAxes, MismatchError, check_group
from vdpcp.feature import sharded
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls.reference import Reference
from vdpcp.tools.mutants import gradient_changed


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
    (vdpcp.oracle.compare.precision). The same group gives the same noise, as the same kernels give the same bits (as
    measured on GPUs): the sharded rows carry their rank's group's noise, the unsharded rows the whole microbatch's. In
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


def _uneven(spec, cp: int) -> bool:
    return cp > 1 and len(spec.images) % cp != 0


BACKWARD_REFUSED = KnownLimit("backward-refused", "its gather's backward refuses shards of unequal image counts on gloo",
                              "backward refused: the images do not divide over the CP ranks", grads_only=True)


class BackwardRefused(Reference):
    """Right forward; on gloo its gather's backward raises on every rank when the images do not divide evenly over
    the CP ranks, and it declares that as a known limit of the backward alone (KnownLimit.grads_only), as a
    subject whose collective's gloo fallback cannot take uneven sizes would."""

    name = "backward-refused"
    splits = ("count",)
    tensor_parallel = ()

    def encode_sharded(self, model, batch, config, group):
        out = super().encode_sharded(model, batch, config, group)
        cp = dist.get_world_size(group)
        if not (config.shard_vision and _uneven(batch.spec, cp) and cp == dist.get_world_size()
                and dist.get_backend(group) == "gloo"):
            return out

        def refuse(grad):
            raise RuntimeError(BACKWARD_REFUSED.signature)

        return gradient_changed(out, refuse)

    def known_limit(self, case, backend):
        # Its outputs-only twin passes; in a CP x DP layout its backward runs.
        sharded = case.grads and case.config.shard_vision and case.config_cp is None and case.dp == 1
        return BACKWARD_REFUSED if backend == "gloo" and sharded and _uneven(case.spec, case.cp) else None


backward_refused = BackwardRefused()
batch_variant = BatchVariant()
batch_variant_one_row_wrong = BatchVariantOneRowWrong()
changes_its_weights = ChangesItsWeights()


# --- what an implementation declares about itself (vdpcp.contract.protocol: the judge is fair to it, and no fairer) --------


def _sharded_with(model, batch, config, group, gather, skip_empty: bool = False):
    """The reference's sharded encode (vdpcp.feature.sharded) with its gather swapped for ``gather(local, counts, group)``;
    ``skip_empty``: a rank with no real rows never runs its tower and hands the gather zeros of its placeholders'
    shape, as a tower with nothing real to encode would."""
    from vdpcp.feature import sharded
    from vdpcp.feature.model import output_tokens

    plan = sharded.plan_for(batch.spec, config)
    shard = plan.shard(dist.get_rank(group))
    if skip_empty and shard.num_real_rows == 0:  # in the graph all the same, so its backward enters the gather's
        local = batch.patches.new_zeros(output_tokens((1, 1)) * shard.num_placeholders, model.config.lm_hidden,
                                        requires_grad=True)
    else:
        local = model.project(model.encode(sharded.split(batch, shard, plan.order), shard.imgs_sizes, shard.num_frames))
    gathered = gather(local, sharded.real_tokens(plan), group)
    index = sharded.image_order(plan)
    return gathered if index is None else gathered[index]


def plain_all_gather(local, counts, group):
    """An inference engine's gather: dist.all_gather, padded to the longest shard, with no autograd."""
    padded = local.detach().new_zeros(max(counts), *local.shape[1:])
    padded[: counts[dist.get_rank(group)]] = local.detach()[: counts[dist.get_rank(group)]]
    shards = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(shards, padded, group=group)
    return torch.cat([s[:n] for s, n in zip(shards, counts)])


class EmptyBare(Reference):
    """For an empty microbatch it encodes nothing and returns an empty tensor with no autograd graph, as Bridge's
    _encode_images does; otherwise the reference."""

    name = "empty-bare"
    splits = ("count",)

    def encode(self, model, batch):
        if not batch.spec.images:
            return batch.patches.new_zeros(0, model.config.lm_hidden)  # no graph: nothing was encoded
        return super().encode(model, batch)

    def encode_sharded(self, model, batch, config, group):
        check_group(config, dist.get_world_size(group), self.name)
        return self.encode(model, batch) if not batch.spec.images else super().encode_sharded(model, batch, config, group)


class OmniGroupError(ValueError):
    """An implementation's own error for a configured CP that disagrees with its process group."""


OMNI_TEXT = "vision_dp_over_cp does not match its process group: config="


class OwnMismatchError(Reference):
    """Raises its own documented mismatch error, in its own words (Bridge's), which it declares."""

    name = "own-mismatch-error"
    splits = ("count",)
    mismatch_error = MismatchError("OmniGroupError", OMNI_TEXT, names_sizes=False)

    def encode_sharded(self, model, batch, config, group):
        size = dist.get_world_size(group)
        if config.context_parallel_size > 1 and config.context_parallel_size != size:
            raise OmniGroupError(f"Nemotron Omni {OMNI_TEXT}{config.context_parallel_size}, group={size}.")
        return super().encode_sharded(model, batch, config, group)


class DeclaresAnotherError(Reference):
    """Declares its own mismatch error but raises vdpcp's check_group's (the reference's): not what it documents."""

    name = "declares-another-error"
    splits = ("count",)
    mismatch_error = OwnMismatchError.mismatch_error


class ChecksCP1(Reference):
    """Validates a configured CP of 1 against a larger group too, and says so (checks_cp1)."""

    name = "checks-cp1"
    splits = ("count",)
    checks_cp1 = True

    def encode_sharded(self, model, batch, config, group):
        size = dist.get_world_size(group)
        if config.context_parallel_size != size:
            raise GroupMismatchError(f"{self.name}: {GROUP_MISMATCH_TEXT}: context_parallel_size="
                                     f"{config.context_parallel_size} but the CP group has {size} ranks")
        return super().encode_sharded(model, batch, config, group)


class ClaimsToCheckCP1(Reference):
    """Says it validates a configured CP of 1 (checks_cp1), but self-disables like the reference: no error."""

    name = "claims-to-check-cp1"
    splits = ("count",)
    checks_cp1 = True


class CollectsWhenOff(Reference):
    """Right results with the feature off, but it still sums a tensor over the CP group first (a stray collective:
    at CP 1 on a larger group a peer that really is off would hang on it)."""

    name = "collects-when-off"
    splits = ("count",)

    def encode_sharded(self, model, batch, config, group):
        if not config.shard_vision:
            dist.all_reduce(torch.zeros(1, dtype=batch.patches.dtype, device=batch.patches.device), group=group)
        return super().encode_sharded(model, batch, config, group)


class EvenGridsOnly(Reference):
    """A tower whose unsharded path takes even patch grids only (Nemotron Omni's), which it declares; its sharded
    path pads the split's 1x1 placeholders, as the design says it must."""

    name = "even-grids-only"
    splits = ("count",)
    media = MediaAxes(even_grids=True)
    towers = {"toy": media}

    def encode(self, model, batch):
        odd = [grid for grid in batch.spec.grids if grid[0] % 2 or grid[1] % 2]
        if odd:
            raise ValueError(f"{self.name}: takes even patch grids only, got {odd[0][0]}x{odd[0][1]}")
        return super().encode(model, batch)


class EvenGridsEverywhere(EvenGridsOnly):
    """Declares even grids, and its sharded path rejects the split's odd (1x1) placeholders too: the declaration
    changes the matrix's images, never the placeholders, so this still errors where a rank holds one."""

    name = "even-grids-everywhere"

    def encode_sharded(self, model, batch, config, group):
        from vdpcp.feature import sharded

        if config.shard_vision and sharded.plan_for(batch.spec, config).shard(dist.get_rank(group)).num_placeholders:
            raise ValueError(f"{self.name}: takes even patch grids only, got a 1x1 placeholder")
        return super().encode_sharded(model, batch, config, group)


class ForwardOnly(Reference):
    """An inference engine's tower: the reference's split, and a gather with no autograd (dist.all_gather). It
    declares itself forward-only."""

    name = "forward-only"
    splits = ("count",)
    forward_only = True
    skip_empty = False

    def encode_sharded(self, model, batch, config, group):
        check_group(config, dist.get_world_size(group), self.name)
        if not config.shard_vision:
            return self.encode(model, batch)
        return _sharded_with(model, batch, config, group, plain_all_gather, self.skip_empty)


class ForwardOnlyWrong(ForwardOnly):
    """Forward-only, and its gathered features 1% off: the declaration spares gradients, never outputs."""

    name = "forward-only-wrong"

    def encode_sharded(self, model, batch, config, group):
        out = super().encode_sharded(model, batch, config, group)
        return out * 1.01 if config.shard_vision else out


class UndeclaredGraphlessGather(ForwardOnly):
    """ForwardOnly that does not say so: a training implementation whose gather is not differentiable."""

    name = "undeclared-graphless-gather"
    forward_only = False


class EmptyRankSkips(Reference):
    """A rank with no real rows skips its tower (the design forbids it in training: a TP or FSDP peer would hang);
    its gather is differentiable, so every output and summed gradient is right."""

    name = "empty-rank-skips"
    splits = ("count",)

    def encode_sharded(self, model, batch, config, group):
        from vdpcp.feature.comm import gather_features

        check_group(config, dist.get_world_size(group), self.name)
        if not config.shard_vision:
            return self.encode(model, batch)
        return _sharded_with(model, batch, config, group, gather_features, skip_empty=True)


class EmptyRankMaySkip(EmptyRankSkips):
    """EmptyRankSkips whose tower holds no collective, which it declares (empty_rank_may_skip)."""

    name = "empty-rank-may-skip"
    empty_rank_may_skip = True


class ForwardOnlySkips(ForwardOnly):
    """An inference tower whose empty rank skips it, without declaring that it may: forward_only alone spares
    gradients, not the execution check."""

    name = "forward-only-skips"
    skip_empty = True


class ForwardOnlyMaySkip(ForwardOnlySkips):
    """vLLM's shape: forward-only, and an empty rank may skip its tower, both declared."""

    name = "forward-only-may-skip"
    empty_rank_may_skip = True


empty_bare = EmptyBare()
own_mismatch_error = OwnMismatchError()
declares_another_error = DeclaresAnotherError()
checks_cp1 = ChecksCP1()
claims_to_check_cp1 = ClaimsToCheckCP1()
collects_when_off = CollectsWhenOff()
even_grids_only = EvenGridsOnly()
even_grids_everywhere = EvenGridsEverywhere()
forward_only = ForwardOnly()
forward_only_wrong = ForwardOnlyWrong()
undeclared_graphless_gather = UndeclaredGraphlessGather()
empty_rank_skips = EmptyRankSkips()
empty_rank_may_skip = EmptyRankMaySkip()
forward_only_skips = ForwardOnlySkips()
forward_only_may_skip = ForwardOnlyMaySkip()


# --- a tower with a branch only some rows take (as RADIO's separate video embedder) -----------------------------

LARGE = 20  # patches: a unit of more takes the large embedding


class BranchEmbed(torch.nn.Module):
    """Two patch embeddings, as RADIO's image and video embedders: a unit (image or tubelet) of more than LARGE
    patches takes ``large``, any other ``small`` (a placeholder's single patch included). Its own gain, on every
    unit first, makes it the tower's first layer on every rank, as RADIO's class tokens make RADIO itself."""

    def __init__(self, small: torch.nn.Linear):
        super().__init__()
        self.gain = torch.nn.Parameter(1 + 0.1 * torch.randn(small.in_features))
        self.small = small
        self.large = torch.nn.Linear(small.in_features, small.out_features)

    def forward(self, unit: torch.Tensor) -> torch.Tensor:
        return (self.large if unit.shape[0] > LARGE else self.small)(unit * self.gain)


class Branching(Reference):
    """The reference whose tower embeds large units with a second embedding: a rank whose rows are all small never
    runs ``large``, a rank of large rows alone never runs ``small``, and correctly so."""

    name = "branching"
    splits = ("count",)
    tensor_parallel = ()

    def build_model(self, case, dtype, device):
        from vdpcp.feature.model import seeded

        model = super().build_model(case, torch.float64, torch.device("cpu"))
        with seeded(1):
            model.embed = BranchEmbed(model.embed)
        return model.to(device=device, dtype=dtype)


class BranchingTrunkSkipped(Branching):
    """Branching whose rank of placeholders alone embeds them, then skips the trunk (blocks, norm, projector) and
    hands the gather zeros: outputs and summed gradients are right (the gather drops placeholders), but a
    tensor-parallel or FSDP peer in the trunk would hang."""

    name = "branching-trunk-skipped"

    def encode_sharded(self, model, batch, config, group):
        from vdpcp.feature import sharded
        from vdpcp.feature.comm import gather_features
        from vdpcp.feature.model import output_tokens

        plan = sharded.plan_for(batch.spec, config)
        shard = plan.shard(dist.get_rank(group))
        if not config.shard_vision or shard.num_real_rows:
            return super().encode_sharded(model, batch, config, group)
        embedded = model.embed(sharded.split(batch, shard, plan.order)[0])  # the placeholders' patches
        local = embedded.sum() * 0 + batch.patches.new_zeros(output_tokens((1, 1)) * shard.num_placeholders,
                                                             model.config.lm_hidden)
        gathered = gather_features(local, sharded.real_tokens(plan), group)
        index = sharded.image_order(plan)
        return gathered if index is None else gathered[index]


branching = Branching()
branching_trunk_skipped = BranchingTrunkSkipped()


class _Jitter(torch.autograd.Function):
    """Identity forward; a backward that differs run to run far below float64's tolerance, as an atomics-based GPU
    kernel's does (cuDNN's attention backward under warn_only, measured on the H200)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * (1 + 1e-13 * torch.rand((), dtype=grad.dtype, device=grad.device))


class JitteryBackward(Reference):
    """A correct reference whose backward does not repeat itself bit for bit: no bitwise gradient verdict is fair."""

    name = "jittery-backward"

    def encode(self, model, batch):
        return _Jitter.apply(super().encode(model, batch))

    def encode_sharded(self, model, batch, config, group):
        return _Jitter.apply(super().encode_sharded(model, batch, config, group))


jittery_backward = JitteryBackward()


def _no_deterministic_kernel(t: torch.Tensor) -> None:
    """``Tensor.put_`` (without accumulate) has no deterministic kernel, on the CPU too: strict deterministic
    algorithms refuse it, as they refuse bilinear interpolation's backward on CUDA."""
    t.detach().clone().put_(torch.zeros(1, dtype=torch.long, device=t.device), t.detach().reshape(-1)[:1])


class _RefusedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _no_deterministic_kernel(grad)
        return grad

    @staticmethod
    def jvp(ctx, tangent):  # forward-mode: the identity, as its forward, so vdpcp's row codes pass through it
        return tangent.clone()


class NoDeterministicKernel(Reference):
    """A tower op with no deterministic kernel, in its forward (``where="forward"``) or its backward: the case runs
    it under warn_only and says so, never fails for it."""

    def __init__(self, where: str):
        super().__init__()
        self.where, self.name = where, f"no-deterministic-{where}"

    def _into(self, batch):  # backward: refused last, after the parameters' gradients have accumulated
        return replace(batch, patches=_RefusedBackward.apply(batch.patches)) if self.where == "backward" else batch

    def _out(self, out):
        if self.where == "forward":
            _no_deterministic_kernel(out)
        return out

    def encode(self, model, batch):
        return self._out(super().encode(model, self._into(batch)))

    def encode_sharded(self, model, batch, config, group):
        return self._out(super().encode_sharded(model, self._into(batch), config, group))


no_deterministic_forward = NoDeterministicKernel("forward")
no_deterministic_backward = NoDeterministicKernel("backward")


class PixelsAsData(Reference):
    """The reference split as Megatron-Bridge's released split runs: under ``torch.no_grad``, asserting that its
    pixels need no gradient (pixels are data, as a data loader yields them); its tower then runs with autograd on
    its parameters. It declares no ``pixel_grads``: correct, judged on outputs and parameter gradients."""

    name = "pixels-as-data"
    pixel_grads = False

    def encode_sharded(self, model, batch, config, group):
        assert not batch.patches.requires_grad, "pixels are data: they must not require grad"
        if not config.shard_vision:
            return super().encode_sharded(model, batch, config, group)
        check_group(config, dist.get_world_size(group), self.name)
        plan = sharded.plan_for(batch.spec, config)
        shard = plan.shard(dist.get_rank(group))
        with torch.no_grad():
            local = sharded.split(batch, shard, plan.order)
        projected = model.project(model.encode(local, shard.imgs_sizes, shard.num_frames))
        gathered = sharded.gather_features(projected, sharded.real_tokens(plan), group)
        index = sharded.image_order(plan)
        return gathered if index is None else gathered.index_select(0, torch.tensor(index, device=gathered.device))


class DetachesItsPixels(Reference):
    """The reference (which declares ``pixel_grads``) with its pixels detached before its split: correct outputs and
    parameter gradients, no pixel gradient anywhere, and no row code at its tower's input (vdpcp.oracle.observe.reads looks its
    rows up by their bytes instead)."""

    name = "detaches-its-pixels"

    def encode_sharded(self, model, batch, config, group):
        return super().encode_sharded(model, replace(batch, patches=batch.patches.detach()), config, group)


class PixelGradOff(Reference):
    """The reference whose sharded pixel gradients come out 10% too large (a planted pixel-gradient bug); as the
    reference, it declares ``pixel_grads``."""

    name = "pixel-grad-off"

    def encode_sharded(self, model, batch, config, group):
        patches = gradient_changed(batch.patches, lambda grad: grad * 1.1)
        return super().encode_sharded(model, replace(batch, patches=patches), config, group)


class PixelGradOffUndeclared(PixelGradOff):
    """The same bug in a subject that declares no ``pixel_grads``: its pixels need no gradient, so none is wrong."""

    name = "pixel-grad-off-undeclared"
    pixel_grads = False


pixels_as_data = PixelsAsData()
detaches_its_pixels = DetachesItsPixels()
pixel_grad_off = PixelGradOff()
pixel_grad_off_undeclared = PixelGradOffUndeclared()


# --- a backward that writes into the gradient it is handed ---------------------------------------------------


def _summed_where_handed(grad, group):
    """``grad`` summed over ``group`` in the buffer it came in (as an all-reduce in place does); the reference's own
    gather backward then gets the gradient as it was handed, and sums it as it always does."""
    handed = grad.clone()
    dist.all_reduce(grad.contiguous(), group=group)
    return handed


def _beside_its_rows(grad):
    """One row of the buffer just before the rows ``grad`` views (the text row the merge put there) nudged, its own
    rows untouched: a write the handed gradient itself does not show."""
    before = torch.as_strided(grad, (1, *grad.shape[1:]), grad.stride(), grad.storage_offset() - grad.stride(0))
    before.add_(1.0)
    return grad


class WritesItsGradient(Reference):
    """Right in every result, but its gather's backward all-reduces the gradient it is handed in place, as
    Megatron-Core's ``_reduce`` does: the merged stream's gradient becomes the sum over the CP group."""

    name = "writes-its-gradient"
    splits = ("count",)

    def encode_sharded(self, model, batch, config, group):
        out = super().encode_sharded(model, batch, config, group)
        return gradient_changed(out, lambda grad: _summed_where_handed(grad, group)) if config.shard_vision else out


class WritesItsGradientMergesCopy(WritesItsGradient):
    """The same, in a model whose merges copy the gathered features (an index assignment), as it declares."""

    name = "writes-its-gradient-merges-copy"
    merges_copy = True


class WritesBesideItsRows(Reference):
    """Leaves the rows it is handed as they were, but writes into the text row before them: the text stream's
    gradient differs, and no write into its own gradient explains it."""

    name = "writes-beside-its-rows"
    splits = ("count",)

    def encode_sharded(self, model, batch, config, group):
        out = super().encode_sharded(model, batch, config, group)
        return gradient_changed(out, _beside_its_rows) if config.shard_vision else out


class WritesBothMergesCopy(WritesItsGradientMergesCopy):
    """Writes into its own gradient (which its copying merge makes harmless) and beside it (which nothing does)."""

    name = "writes-both-merges-copy"

    def encode_sharded(self, model, batch, config, group):
        out = super().encode_sharded(model, batch, config, group)
        return gradient_changed(out, _beside_its_rows) if config.shard_vision else out


writes_its_gradient = WritesItsGradient()
writes_its_gradient_merges_copy = WritesItsGradientMergesCopy()
writes_beside_its_rows = WritesBesideItsRows()
writes_both_merges_copy = WritesBothMergesCopy()


# --- no opt-out, and a collective counted as the subject issued it --------------------------------------------


class GathersUnevenWhenOff(Reference):
    """Right results with the feature off, but it still gathers one tensor of a size of each rank's own over the CP
    group first: one uneven all_gather, which on gloo vdpcp's stand-in runs (its own collectives are not the
    subject's)."""

    name = "gathers-uneven-when-off"
    splits = ("count",)

    def encode_sharded(self, model, batch, config, group):
        if not config.shard_vision and dist.get_world_size(group) > 1:
            sizes = range(1, dist.get_world_size(group) + 1)
            mine = torch.zeros(sizes[dist.get_rank(group)], dtype=batch.patches.dtype, device=batch.patches.device)
            dist.all_gather([mine.new_zeros(n) for n in sizes], mine, group=group)
        return super().encode_sharded(model, batch, config, group)


class NoOptOut(Reference):
    """Shards at every CP above 1, whatever vision_dp_over_cp says, and declares it has no opt-out."""

    name = "no-opt-out"
    splits = ("count",)
    has_opt_out = False

    def encode_sharded(self, model, batch, config, group):
        return super().encode_sharded(model, batch, replace(config, vision_dp_over_cp=True), group)


class ShardsAtTheOptOut(NoOptOut):
    """The same, without the declaration: the opt-out's no-op is what it is held to."""

    name = "shards-at-the-opt-out"
    has_opt_out = True


class ClaimsNoOptOut(Reference):
    """Declares it has no opt-out, but honours it: every rank encodes everything where the feature is off."""

    name = "claims-no-opt-out"
    splits = ("count",)
    has_opt_out = False


gathers_uneven_when_off = GathersUnevenWhenOff()
no_opt_out = NoOptOut()
shards_at_the_opt_out = ShardsAtTheOptOut()
claims_no_opt_out = ClaimsNoOptOut()
