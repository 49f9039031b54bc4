"""One correctness case: the sharded encoder against the unsharded one, in outputs and in gradients.

``check_case`` runs on every rank of a CP group (through the harness). Each rank r weights the gathered
features with its own deterministic random tensor W_r and takes L_r = sum(W_r * features), as each CP rank's
language model consumes its own tokens; the unsharded reference, computed on the same rank in one process,
takes L = sum over r of L_r. Then:

1. outputs: the gathered features on every rank equal the unsharded features, row for row;
2. input grads: with sharding on, each rank's gradient for its own images' patches equals the unsharded
   one and is zero elsewhere (it read no other image); with sharding off, the sum over ranks does;
3. parameter grads: the sum over CP ranks of the tower's and projector's gradients equals the unsharded ones,
   and each rank's own equal the unsharded gradients of its own images' rows under the summed weights (so
   the projector stays sharded: a gather before the projector passes check 3 but fails this);
4. no rank runs an empty encoder (placeholders exist for exactly that).

``grads=False`` checks the outputs only, for implementations whose backward cannot run on the backend.

Tolerances are torch.testing.assert_close's defaults for the dtype, never loosened.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from vdpcp import comm
from vdpcp.model import TowerConfig, VisionModel
from vdpcp.sharded import VisionDPConfig, encode_sharded, encode_unsharded, plan_for, real_units
from vdpcp.spec import MicrobatchSpec

IMPLS = ("reference", "mcore")
LOSSES = ("rank", "zigzag")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
LOW_PRECISION = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}  # assert_close's default rtol for each
# The fused sequence around the vision tokens, for the zigzag loss: text before and after the media.
TEXT_BEFORE, TEXT_AFTER = 3, 5


@dataclass(frozen=True)
class Case:
    spec: MicrobatchSpec
    cp: int  # world size of the CP group
    impl: str = "reference"
    split: str = "count"
    loss: str = "rank"
    vision_dp_over_cp: bool = True
    config_cp: int | None = None  # the configured context_parallel_size; None means cp
    dtype: str = "float64"
    even_pad: bool = True
    mutant: str | None = None  # name in vdpcp.mutants, applied inside every rank for this case
    grads: bool = True  # False checks the outputs only (no backward): MCore's gather backward fails on gloo

    @property
    def config(self) -> VisionDPConfig:
        return VisionDPConfig(
            context_parallel_size=self.cp if self.config_cp is None else self.config_cp,
            vision_dp_over_cp=self.vision_dp_over_cp,
            strategy=self.split,
        )

    @property
    def tower(self) -> TowerConfig:
        return TowerConfig(
            patch_dim=self.spec.patch_dim,
            temporal_patch_size=self.spec.temporal_patch_size,
            pad_odd_grids=self.even_pad,
            seed=self.spec.seed,
        )

    @property
    def id(self) -> str:
        parts = [self.spec.name, f"cp{self.cp}", self.impl, self.split]
        if self.loss != "rank":
            parts.append(self.loss)
        if not self.vision_dp_over_cp:
            parts.append("optout")
        if self.config_cp is not None:
            parts.append(f"config-cp{self.config_cp}")
        if self.dtype != "float64":
            parts.append(self.dtype)
        if not self.even_pad:
            parts.append("no-even-pad")
        if not self.grads:
            parts.append("outputs")
        if self.mutant:
            parts.append(f"mutant-{self.mutant}")
        return "-".join(parts)

    def with_(self, **changes) -> Case:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["spec"] = self.spec.to_dict()
        return out


@dataclass
class RankResult:
    rank: int
    images: int  # real rows this rank encoded
    placeholders: int
    patches: int
    out_err: float = 0.0
    input_grad_err: float = 0.0
    param_grad_err: float = 0.0
    failures: list[str] = field(default_factory=list)
    backend: str = ""  # what this rank really ran on (the harness's RankContext), not what was asked for
    device: str = ""
    # The unsharded encoder itself raised (e.g. an odd real grid with even padding off): the spec cannot be
    # encoded at all, so the case says nothing about sharding and is neither a pass nor a sharding failure.
    unsharded_error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failures and self.unsharded_error is None


def check_case(ctx, case: Case) -> RankResult:
    """The rank body: run ``case`` on this rank of ``ctx.group`` and compare with the unsharded encoder."""
    from vdpcp import mutants  # only the mutant matrix needs it; kept out of the reference's imports

    with mutants.applied(case.mutant):
        return _check(ctx, case)


def _check(ctx, case: Case) -> RankResult:
    dtype, device = DTYPES[case.dtype], ctx.device
    config = case.config
    result = _assignment(case, ctx.rank)
    result.backend, result.device = ctx.backend, str(ctx.device)

    # The unsharded reference runs first: if it raises too, every rank raises it alike before any
    # collective (no rank hangs) and the case is reported as unsharded_error, not as a sharding failure.
    reference = VisionModel(case.tower).to(device=device, dtype=dtype)
    ref_batch = case.spec.tensors(dtype=dtype, device=device)
    ref_batch.patches.requires_grad_(True)
    try:
        ref_features = encode_unsharded(reference, ref_batch)
    except Exception as err:
        result.unsharded_error = f"{type(err).__name__}: {err}"
        return result

    model = VisionModel(case.tower).to(device=device, dtype=dtype)
    batch = case.spec.tensors(dtype=dtype, device=device)
    batch.patches.requires_grad_(True)
    features = _encode(case, model, batch, ctx)

    weights = [loss_weights(case, r, ref_features.shape, dtype, device) for r in range(case.cp)]
    result.out_err = _compare(result, "outputs", features, ref_features)
    if features.shape != ref_features.shape or not case.grads:
        return result  # every rank gathered the same shape, so every rank stops here: no collective hangs

    # This rank's parameter gradients alone: with sharding, the gather hands each rank the summed gradient of
    # its own images' rows, so they equal the unsharded gradients of those rows under the summed weights
    # (which also says the projector stays sharded); without sharding, those of this rank's own loss.
    if config.shard_vision:
        own_rows = _own_token_mask(case, ctx.rank, device)
        own_weight = torch.zeros_like(ref_features)
        own_weight[own_rows] = sum(weights)[own_rows]
    else:
        own_weight = weights[ctx.rank]
    expected_rank_params = _param_grads(reference, (own_weight * ref_features).sum())

    rank_loss(features, weights, ctx.rank).backward()
    sum((w * ref_features).sum() for w in weights).backward()

    grad = _grad(batch.patches)
    if config.shard_vision:
        own = _own_patch_mask(case, ctx.rank, batch)
        expected_own = _grad(ref_batch.patches)[:, own]
        result.input_grad_err = _compare(result, "input grads (own images)", grad[:, own], expected_own, reduction=True)
        stray = grad[:, ~own].abs().max().item() if (~own).any() else 0.0
        if stray != 0.0:
            result.failures.append(f"input grads: rank {ctx.rank} has gradient {stray:.3g} on images it does not own")
    else:
        summed = comm.all_reduce_sum(grad, ctx.group)
        result.input_grad_err = _compare(result, "input grads (summed over ranks)", summed, _grad(ref_batch.patches), reduction=True)
    summed_params = comm.all_reduce_sum(_flat_grads(model), ctx.group)
    result.param_grad_err = max(
        _compare(result, "param grads (summed over ranks)", summed_params, _flat_grads(reference), reduction=True),
        _compare(result, "param grads (this rank alone)", _flat_grads(model), expected_rank_params, reduction=True),
    )
    return result


def rank_loss(features: torch.Tensor, weights: list[torch.Tensor], rank: int) -> torch.Tensor:
    """L_rank: what this CP rank's language model takes from the gathered features (its own weights only)."""
    return (weights[rank] * features).sum()


def _encode(case: Case, model, batch, ctx):
    if case.impl == "reference":
        return encode_sharded(model, batch, case.config, ctx.group)
    if case.impl == "mcore":
        from vdpcp.mcore import encode_sharded_mcore, ensure_parallel_state

        ensure_parallel_state(case.cp)  # MCore's groups follow the world; the config may disagree on purpose
        return encode_sharded_mcore(model, batch, case.config)
    raise ValueError(f"impl must be one of {IMPLS}, got {case.impl!r}")


def _assignment(case: Case, rank: int) -> RankResult:
    """What this rank encodes; a sharded rank with no rows at all would run an empty encoder."""
    if not case.config.shard_vision:
        spec = case.spec
        return RankResult(rank, len(spec.images), 0, sum(spec.row_patches))
    plan = plan_of(case)
    if rank >= plan.cp_size:  # a config CP smaller than the group: the implementation must raise, not this
        return RankResult(rank, 0, 0, 0)
    shard = plan.shard(rank)
    result = RankResult(rank, shard.num_real_rows, shard.num_placeholders, shard.num_patches)
    if shard.num_rows == 0:
        result.failures.append(f"plan: rank {rank} got no image and no placeholder (an empty encoder)")
    return result


def loss_weights(case: Case, rank: int, shape, dtype, device) -> torch.Tensor:
    """W_rank: deterministic per (spec seed, rank); under zigzag, zero outside the rank's LM shard."""
    gen = torch.Generator().manual_seed(1_000_003 * case.spec.seed + rank)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    if case.loss == "zigzag":
        w = w * zigzag_rows(shape[0], case.cp, rank).unsqueeze(-1)
    return w.to(dtype=dtype, device=device)


def zigzag_rows(num_vision: int, cp: int, rank: int) -> torch.Tensor:
    """Which vision rows rank ``rank`` holds when the fused text+vision sequence is CP-split zigzag-wise.

    The sequence (text, vision tokens, text) is padded to a multiple of 2*cp and cut into 2*cp chunks;
    rank r holds chunks r and 2*cp-1-r, so most ranks' gradient for an image comes from other ranks.
    """
    length = TEXT_BEFORE + num_vision + TEXT_AFTER
    chunk = math.ceil(length / (2 * cp))
    chunk_of = torch.arange(TEXT_BEFORE, TEXT_BEFORE + num_vision) // chunk
    return ((chunk_of == rank) | (chunk_of == 2 * cp - 1 - rank)).to(torch.float64)


def plan_of(case: Case):
    """The plan the case's implementation follows (MCore always splits by count: that plan is parity-tested)."""
    return plan_for(case.spec, case.config if case.impl == "reference" else replace(case.config, strategy="count"))


def _own_token_mask(case: Case, rank: int, device) -> torch.Tensor:
    """Rows of the gathered features (in image order) that come from this rank's real images.

    Not one range under the packed split, whose ranks hold images out of order: built unit by unit.
    """
    own = []
    for owner, _, tokens in sorted(real_units(plan_of(case)), key=lambda unit: unit[1]):  # image order
        own += [owner == rank] * tokens
    return torch.tensor(own, dtype=torch.bool, device=device)


def _own_patch_mask(case: Case, rank: int, batch) -> torch.Tensor:
    """Patch positions of the real images this rank encodes."""
    plan = plan_of(case)
    shard = plan.shard(rank)
    mask = torch.zeros(batch.patches.shape[1], dtype=torch.bool, device=batch.patches.device)
    for row in plan.order[shard.start : min(shard.stop, plan.num_real_rows)]:
        mask[int(batch.cu_seqlens[row]) : int(batch.cu_seqlens[row + 1])] = True
    return mask


def _compare(result: RankResult, what: str, actual: torch.Tensor, expected: torch.Tensor, reduction: bool = False) -> float:
    """Element by element with assert_close's tolerances for the dtype; see _compare_norm for ``reduction``."""
    if actual.shape != expected.shape:
        result.failures.append(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
        return math.inf
    actual, expected = actual.detach(), expected.detach()
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    if reduction and actual.dtype in LOW_PRECISION:
        _compare_norm(result, what, actual, expected)
        return err
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as mismatch:
        result.failures.append(f"{what}: {str(mismatch).splitlines()[0]} (max abs error {err:.3g})")
    return err


def _compare_norm(result: RankResult, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Gradients in bf16/fp16 are sums over tokens (and ranks) rounded to a 8- or 11-bit mantissa: splitting the
    sum differently (which is what sharding does) moves elements near cancellation by far more than an
    element-wise rtol allows, while any sharding bug moves the whole tensor. So in low precision they are
    compared as vectors: |actual - expected| <= rtol * |expected| (2-norms), rtol being assert_close's for the
    dtype."""
    rtol = LOW_PRECISION[actual.dtype]
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    if diff > rtol * scale:
        result.failures.append(
            f"{what}: relative 2-norm error {diff / max(scale, 1e-300):.3g} exceeds {actual.dtype}'s rtol {rtol:g}"
        )


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([_grad(p).reshape(-1) for p in model.parameters()])


def _param_grads(model, loss: torch.Tensor) -> torch.Tensor:
    """d loss / d params, flattened like _flat_grads, leaving the graph for the full backward."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])
