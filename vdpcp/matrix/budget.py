"""Sizing: what a case will need, from its spec's shapes alone, before any tensor is built, and the limit it must
stay under (a rank that ran out of memory all the same is told from a verdict by vdpcp.matrix.expectations).

Pure arithmetic over shapes (no torch, no torch.distributed): a 70-byte spec can ask for a 100 GB image, so
every entry point sizes a case here first (``check``) and refuses one over the limit in one line that names the
field and the figure, instead of starting to allocate it next to other jobs.

What a case costs, as the oracle runs it (vdpcp.oracle.check), on EVERY one of its ranks:

- resident through the case: the model and three sets of its gradients (the unsharded arm's, set aside; this
  rank's own share of them; the sharded arm's), both arms' microbatch and input gradients, the loss weights, and
  this rank's shard through the encoder (estimated under a split by count: whole units, the remainder on the last
  rank, which is the busiest) -- ``resident``;
- on top, for a while: the unsharded arm (the whole microbatch, forward and backward) and, below float64, its
  exact run (vdpcp.oracle.compare.precision: a copy of the model in float32 or float64 with two sets of gradients, and the arm
  again in that dtype) -- ``turn``. Ranks sharing a GPU take those turns as many at a time as fit where all at
  once would not (vdpcp.harness.turns); a GPU is refused only where one at a time would not fit either.

On the CPU every rank of a case is on this machine: they must fit its memory limit together, and their work
(``flops``: 6 x parameters x patches per arm) its compute limit, so a real-size tower is refused here up front,
not left to run for an hour. On a GPU the busiest GPU must hold its ranks.

Every figure of the implementation's own is read through its ``sizing`` (vdpcp.contract.sizing): one arm's cost per
patch is its ``sizing.patch_bytes(case)`` where it declares one, else this module's estimate for vdpcp's toy tower
(``toy_arm_bytes``), measured against the real peak; its parameters and full-attention layers its
``sizing.param_count(case)`` and ``sizing.full_attention(case)``, else the toy tower's where it builds that one.
"""

from __future__ import annotations

import functools
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

from vdpcp.contract.protocol import builds_toy_tower, toy_tower

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
ENV = "VDPCP_MAX_SPEC_BYTES"
FLAG = "--max-spec-bytes"
# Far above the suite's largest case, yet low enough to refuse a size typo, or a microbatch a shared CI runner
# cannot hold, in one line before it runs.
DEFAULT_LIMIT = 8 * GiB
# Far above the toy towers' largest case, and below the matrix's real-size ones: a case over it is refused on the
# CPU, where it would take too long, not run.
DEFAULT_FLOPS = 2e12
FLOPS_ENV, FLOPS_FLAG = "VDPCP_MAX_CASE_TFLOP", "--max-case-tflop"
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2}
CHANNELS = 3
# A microbatch's packed patches are held three times over in an arm: the patches, their gradient, and that
# gradient assembled from each image's piece in backward.
INPUT_COPIES = 3
# The toy tower's activations kept for backward, in hidden-size elements per patch and layer, per patch after the
# blocks, and in lm_hidden elements per output token; PATCH_OVERHEAD is autograd's and the allocator's bookkeeping.
PER_LAYER, AFTER_BLOCKS, PER_TOKEN = 20, 8, 6
PATCH_OVERHEAD = 1024


class BudgetError(ValueError):
    """A limit that is not a number of bytes (``--max-spec-bytes``, VDPCP_MAX_SPEC_BYTES)."""


# --- the limit -------------------------------------------------------------------------------------------

_override: list[tuple[int, str]] = []  # (bytes, where from), innermost last; only limited() changes it


def parse_bytes(value, source: str) -> int:
    """A positive byte count: an integer, or a number with K/M/G/T (binary: 8G is 8 GiB), B or iB optional."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, scale = value, 1
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(value), re.IGNORECASE)
        if match is None:
            raise BudgetError(f"{source} is {value!r}; expected a number of bytes, e.g. 8G, 512M or 8589934592")
        number, scale = float(match.group(1)), {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}[match.group(2).upper()]
    if not number * scale >= 1:
        raise BudgetError(f"{source} is {value!r}; expected a positive number of bytes")
    return int(number * scale)


def limit(device: str = "cpu") -> tuple[int, str]:
    """(bytes a case may need, where that figure comes from): limited(), else VDPCP_MAX_SPEC_BYTES, else
    DEFAULT_LIMIT on the CPU and on a GPU nine tenths of its memory (the rest is CUDA's and the allocator's)."""
    if _override:
        return _override[-1]
    env = os.environ.get(ENV)
    if env is not None and env.strip():
        return parse_bytes(env, ENV), f"{ENV}={env.strip()}"
    if device == "cuda":  # the GPU's whole memory named too: the figure after "of" is the limit, not the GPU
        total = gpu_memory()
        return int(0.9 * total), f"the GPU's limit (nine tenths of its {human(total)})"
    return DEFAULT_LIMIT, "the default limit"


_flops_override: list[tuple[float, str]] = []


@contextmanager
def limited_flops(tflop, source: str = FLOPS_FLAG):
    """The CPU's compute limit is ``tflop`` TFLOP for the block, then as it was (None: as it is)."""
    if tflop is None:
        yield
        return
    entry = (float(tflop) * 1e12, f"{source} {tflop:g}")
    _flops_override.append(entry)
    try:
        yield
    finally:
        _flops_override.remove(entry)


def flops_limit() -> tuple[float, str]:
    """(floating-point operations a case may take on the CPU, where that figure comes from): limited_flops(), else
    VDPCP_MAX_CASE_TFLOP, else DEFAULT_FLOPS. A GPU has no such limit."""
    if _flops_override:
        return _flops_override[-1]
    env = os.environ.get(FLOPS_ENV)
    if env is None or not env.strip():
        return DEFAULT_FLOPS, "the default limit"
    try:
        tflop = float(env)
    except ValueError:
        tflop = -1.0
    if not (math.isfinite(tflop) and tflop > 0):
        raise BudgetError(f"{FLOPS_ENV} is {env!r}; expected a positive number of TFLOP, e.g. 50")
    return tflop * 1e12, f"{FLOPS_ENV}={env.strip()}"


@contextmanager
def limited(value, source: str = FLAG):
    """The limit is ``value`` (bytes, or "16G") for the block, then as it was: an in-process CLI call or a pytest
    session never leaves its limit to the next. None leaves the limit as it is."""
    if value is None:
        yield
        return
    entry = (parse_bytes(value, source), f"{source} {value}")
    _override.append(entry)
    try:
        yield
    finally:
        _override.remove(entry)


def override() -> tuple | None:
    """The innermost limited() and limited_flops() in force, if any (for tests' setting-leak guard)."""
    return (_override[-1] if _override else None, _flops_override[-1] if _flops_override else None) \
        if _override or _flops_override else None


# --- what a case needs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    """A case's estimated memory, in bytes, and work, from its shapes."""

    patches: int  # real patches of the microbatch
    unsharded: int  # one unsharded arm: the whole microbatch through the encoder, forward and backward
    ranks: tuple[int, ...]  # each CP rank's own peak (resident + its turn), in CP rank order
    replicas: int  # ranks per CP rank (DP replicas x TP ranks), each holding as much
    dtype: str
    resident: tuple[int, ...] = ()  # what each CP rank holds through the case: the model, gradients, its shard's arm
    turn: tuple[int, ...] = ()  # on top, while it runs the unsharded arm and its exact run (a few at a time on a shared GPU)
    flops: float = 0.0  # the whole case, every rank: forward and backward of every arm

    @property
    def per_rank(self) -> int:
        return max(self.ranks, default=0)

    @property
    def world(self) -> int:
        return len(self.ranks) * self.replicas

    @property
    def total(self) -> int:
        """On this machine: every rank of the case at its peak at once."""
        return sum(self.ranks) * self.replicas

    def colocated(self, turns: bool | int, ranks: int | None = None) -> int:
        """The peak of ``ranks`` of the case's ranks (default: all) sharing one device, the busiest ones; with
        ``turns`` they run their unsharded arms that many at a time (True: one; vdpcp.harness.turns), else all at
        once."""
        every = sorted(zip(self.resident * self.replicas, self.turn * self.replicas), reverse=True)[: ranks or self.world]
        at_once = len(every) if turns is False else max(int(turns), 1)
        return sum(r for r, _ in every) + sum(sorted((t for _, t in every), reverse=True)[:at_once])

    def text(self, patches: bool = True) -> str:
        ranks = f"{self.world} rank{'s' if self.world > 1 else ''}" + (f" x up to {human(self.per_rank)}" if self.world > 1 else "")
        head = f"{self.patches:,} patches: " if patches else ""
        return (f"{head}about {human(self.total)} on this machine ({ranks}, {self.dtype}; the unsharded encoder "
                f"alone {human(self.unsharded)})")


EXACT = {"bfloat16": "float32", "float32": "float64"}  # vdpcp.oracle.compare.precision's exact run, by the case's dtype
EXACT_CHUNK = 4096  # patches of whole media items per call of the exact run (vdpcp.oracle.compare.rounding.measure)
# float64 attention takes CUDA's math kernel, no fused one taking float64: it keeps about this many n x n score
# tensors a head and layer for backward.
SCORES_KEPT = 1.0


def need(case, patch_bytes: int | None = None, device: str = "cpu") -> Need:
    """What ``case`` will need on ``device`` ("cpu" or "cuda"). ``patch_bytes``: one arm's bytes per patch, as an
    implementation declares it (default: its ``sizing.patch_bytes(case)``, else the toy tower's estimate)."""
    spec, d = case.spec, DTYPE_BYTES[case.dtype]
    units = _units(spec)
    patches = sum(spec.row_patches)
    params = _params(case)
    attention = _full_attention(case)

    def arm(shard, dtype: str = case.dtype) -> int:
        per_patch = patch_bytes if patch_bytes is not None else declared_patch_bytes(case.with_(dtype=dtype))
        body = sum(rows * p for rows, p, _ in shard) * per_patch if per_patch is not None else \
            toy_arm_bytes(case.with_(dtype=dtype), shard, device)
        if dtype == "float64" and device == "cuda" and attention:
            layers, heads = attention
            body += int(SCORES_KEPT * layers * heads * sum(p * p for _, p, _ in shard) * DTYPE_BYTES[dtype])
        return body

    # Its own share of the gradients: the rows of a stated plan, or, encoded whole (sharding off, or the
    # implementation's fallback policy replicating the microbatch), its own loss's (vdpcp.oracle.compare.weights.owned_weight).
    replicates = case.config.shard_vision and _replicates(case)
    own = int(not case.config.shard_vision or replicates or _plans(case)) if case.grads else 0
    grads = params * d if case.grads else 0  # an outputs-only case takes no backward
    copies = (2 + own) if case.grads else 1  # the exact run's model, its gradients and its own share's
    unsharded = arm(units)
    exact = EXACT.get(case.dtype)
    chunks = [_units(spec, group) for group in spec.media_groups(EXACT_CHUNK)] or [units]
    # An outputs-only case's exact run is a forward under no_grad: it keeps no activations for a backward.
    kept = max(arm(chunk, exact) for chunk in chunks) if exact and case.grads else 0
    exact_arm = (kept + copies * params * DTYPE_BYTES[exact]) if exact else 0
    turn = (1 + own) * grads + max(unsharded, exact_arm)  # on top of the base, while the unsharded arm runs
    inputs = 2 * patches * CHANNELS * spec.patch_dim**2 * INPUT_COPIES * d  # both arms' microbatch and its gradients
    weights = case.cp * _tokens(units) * _lm_hidden(case) * d  # W_r of every CP rank, on every rank
    base = params * d + inputs + weights
    shards = _count_shards(units, case.cp) if case.config.shard_vision and not replicates else [units] * case.cp
    sharded = [(2 + own) * grads + arm(shard) for shard in shards]  # on top of the base, in the sharded arm
    resident = tuple(base + s for s in sharded)
    arms = 2 + (exact is not None)
    flops = 6.0 * params * patches * arms * case.cp * case.dp * case.tp
    return Need(patches, unsharded, tuple(base + max(turn, s) for s in sharded), case.dp * case.tp, case.dtype,
                resident, tuple(max(turn - s, 0) for s in sharded), flops)


def _replicates(case) -> bool:
    """Whether the implementation's fallback policy encodes the case's microbatch whole on every rank."""
    from vdpcp.impls import ImplError, resolve

    try:
        return resolve(case.impl).replicated(case.spec, case.config) is not None
    except ImplError:
        return False


def _plans(case) -> bool:
    """Whether the implementation states a plan for the case (then each rank holds its own share's gradients)."""
    from vdpcp.impls import ImplError, resolve

    try:
        return resolve(case.impl).plan(case.spec, case.config) is not None
    except ImplError:
        return False


def device_for(backend: str | None, world_size: int) -> str:
    """Where a case's ranks keep their tensors: "cuda" for NCCL ranks (the backend as planned for ``world_size``
    ranks) and for gloo ranks with VDPCP_DEVICE=cuda, else "cpu"."""
    from vdpcp.harness.config import planned_backend

    if os.environ.get("VDPCP_DEVICE") == "cuda" or planned_backend(backend, world_size) == "nccl":
        return "cuda"
    return "cpu"


def check(case, source: str | None = None, device: str | None = None) -> Need:
    """need(case), or SpecTooLarge (one line: the field, the figure, the limit and how to raise it) when it is over
    what ``device`` allows (default: device_for the configured backend): on the CPU this machine's memory limit
    and its compute limit; on a GPU the busiest GPU's memory."""
    device = device or device_for(None, case.world_size)
    found = need(case, device=device)
    allowed, where = limit(device)
    prefix = f"{source}: " if source else ""
    from vdpcp.feature.spec import SpecTooLarge

    held = found.total if device == "cpu" else _on_one_gpu(found)
    if held > allowed:
        needs = found.text(patches=False) if device == "cpu" else _gpu_text(found, held)
        raise SpecTooLarge(
            f"{prefix}{_culprit(case.spec)}: at CP={case.cp}{_with_tower(case)} the case needs {needs}, "
            f"over {where} of "
            f"{human(allowed)}; raise it with {FLAG} (pytest: --vdpcp-max-spec-bytes) or {ENV} where the machine has the memory")
    if device == "cpu":
        work, most, said = found.flops, *flops_limit()
        if work > most:
            raise SpecTooLarge(
                f"{prefix}{_culprit(case.spec)}: at CP={case.cp}{_with_tower(case)} the case is about {work / 1e12:,.1f} "
                f"TFLOP on the CPU, too slow for this machine (over {said} of "
                f"{most / 1e12:g} TFLOP, minutes a case on 2 cores); run it on a GPU (VDPCP_DEVICE=cuda or --backend "
                f"nccl), or raise it with {FLOPS_FLAG} or {FLOPS_ENV}")
    return found


def fits(case, device: str | None = None) -> bool:
    from vdpcp.feature.spec import SpecTooLarge

    try:
        check(case, device=device)
    except SpecTooLarge:
        return False
    return True


def _with_tower(case) -> str:
    return "" if case.tower == "toy" else f" with the {case.tower}-size tower ({_params(case) / 1e6:,.0f}M parameters)"


def _on_one_gpu(found: Need) -> int:
    """What the busiest GPU holds: one rank per GPU, or the ranks sharing each taking turns (vdpcp.oracle)."""
    per_gpu = _per_gpu(found)
    return found.colocated(turns=per_gpu > 1, ranks=per_gpu)


def _per_gpu(found: Need) -> int:
    return -(-found.world // max(gpu_count(), 1))


def _gpu_text(found: Need, held: int) -> str:
    """The figure a GPU refusal compared (what the busiest GPU holds), not every rank at its peak at once."""
    per_gpu = _per_gpu(found)
    sharing = (f"its {per_gpu} ranks taking turns for the unsharded arm, each resident up to "
               f"{human(max(found.resident, default=0))}" if per_gpu > 1 else "one rank")
    return (f"about {human(held)} on the busiest GPU ({sharing}; {found.world} rank{'s' if found.world > 1 else ''}, "
            f"{found.dtype}; the unsharded encoder alone {human(found.unsharded)})")


def declared_patch_bytes(case) -> int | None:
    """The implementation's own bytes per patch for one arm (``sizing.patch_bytes(case)``), or None."""
    impl = _implementation(case)
    value = impl.sizing.patch_bytes(case) if impl is not None else None
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise BudgetError(f"{case.impl}: patch_bytes(case) is {value!r}; expected a positive int (bytes per patch)")
    return value


def _implementation(case):
    """The case's implementation, or None where its target does not resolve: it is then sized as the toy tower, and
    the ranks report the bad target as they always have."""
    from vdpcp.impls import ImplError, resolve

    try:
        return resolve(case.impl)
    except ImplError:
        return None


def _full_attention(case) -> tuple[int, int] | None:
    """(layers that attend over a whole image, their heads): as the implementation's sizing declares them, the toy
    tower's where it builds that one, else unknown (None)."""
    impl = _implementation(case)
    if impl is None:
        return None
    declared = impl.sizing.full_attention(case)
    if declared is not None or not builds_toy_tower(impl):
        return declared
    tower = toy_tower(case)
    return tower.layers, tower.heads


def toy_arm_bytes(case, units, device: str = "cpu") -> int:
    """One arm of vdpcp's toy tower (vdpcp.feature.model) over ``units`` [(rows, patches per row, grid)]: its inputs and
    their gradient, tubelet stacks, activations kept for backward, the projector's. On the CPU activations below
    float32 are float32 (its kernels compute bf16 in float32); on a GPU they are the dtype's."""
    c, d, T = _tower(case), DTYPE_BYTES[case.dtype], case.spec.temporal_patch_size
    row_patches = sum(rows * p for rows, p, _ in units)
    unit_patches = sum(p for _, p, _ in units)
    inputs = row_patches * CHANNELS * case.spec.patch_dim**2 * INPUT_COPIES
    stacked = unit_patches * T * CHANNELS * case.spec.patch_dim**2 * 2 if T > 1 else 0
    hidden = unit_patches * (PER_LAYER * c["layers"] + AFTER_BLOCKS) * c["hidden"]
    projector = _tokens(units) * PER_TOKEN * c["lm_hidden"]
    return (inputs + stacked) * d + (hidden + projector) * (max(d, 4) if device == "cpu" else d) + row_patches * PATCH_OVERHEAD


def toy_params(case) -> int:
    """Parameters of the toy tower + projector (vdpcp.feature.model.VisionModel) as a case builds it, counted from its config."""
    from vdpcp.feature.model import positions_needed

    c = _tower(case)
    h, lm, inp = c["hidden"], c["lm_hidden"], case.spec.temporal_patch_size * CHANNELS * case.spec.patch_dim**2
    kept = min(positions_needed(case.spec.grids), c["max_grid"]) if case.tower == "toy" else c["max_grid"]
    embed = inp * h + h + kept**2 * h
    block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (4 * h * h + 4 * h) + (4 * h * h + h)
    projector = 8 * h + (4 * h * lm + lm) + (lm * lm + lm)
    return embed + c["layers"] * block + 2 * h + projector


def _tower(case) -> dict:
    from dataclasses import asdict

    from vdpcp.feature.model import TOWERS, TowerConfig

    return {**asdict(TowerConfig()), **TOWERS.get(case.tower, {})}


def _lm_hidden(case) -> int:
    return _tower(case)["lm_hidden"]


def _params(case) -> int:
    """The tower's parameters: as the implementation's sizing declares them (``sizing.param_count``), vdpcp's toy
    tower's where it builds that one, else unknown (0)."""
    impl = _implementation(case)
    declared = impl.sizing.param_count(case) if impl is not None else None
    if declared is not None:
        return int(declared)
    return toy_params(case) if impl is None or builds_toy_tower(impl) else 0


def gpu_count() -> int:
    from vdpcp.harness.config import cuda_device_count

    return cuda_device_count()


@functools.cache
def gpu_memory() -> int:
    """Bytes of the first GPU (the GPUs of a runner are alike)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def _units(spec, media: tuple[int, int] | None = None) -> list[tuple[int, int, tuple[int, int]]]:
    """The encoder's units (images, or tubelets of T frames) of the spec's media items [first, stop) (default all):
    (rows it holds, patches of each row, its grid)."""
    first, stop = media or (0, len(spec.media_frames))
    out, row, T = [], spec.media_rows[first], spec.temporal_patch_size
    grids = spec.grids
    for frames in spec.media_frames[first:stop]:
        for k in range(0, frames, T):
            gh, gw = grids[row]
            out.append((min(T, frames - k), gh * gw, (gh, gw)))
        row += frames
    return out


def _tokens(units) -> int:
    """Output tokens: the 2x2 pixel shuffle of each unit's grid, padded to even."""
    return sum(math.ceil(gh / 2) * math.ceil(gw / 2) for _, _, (gh, gw) in units)


def _count_shards(units, cp: int) -> list[list]:
    """Units by count, the remainder on the last rank (MCore's rule; the busiest of vdpcp's splits); a rank with
    none encodes a one-patch placeholder."""
    per_rank = len(units) // cp
    starts = [r * per_rank for r in range(cp)] + [len(units)]
    return [units[a:b] or [(1, 1, (1, 1))] for a, b in zip(starts, starts[1:])]


def _culprit(spec) -> str:
    """The field to blame: one image that holds at least half the patches, else the images as a whole."""
    patches = spec.row_patches
    total = sum(patches)
    if not patches:
        return "the case (no images)"
    big = max(range(len(patches)), key=patches.__getitem__)
    if patches[big] * 2 >= total:
        h, w = spec.images[big]
        return f"field 'images'[{big}] = [{h}, {w}] is {patches[big]:,} patches (patch_dim={spec.patch_dim})"
    return f"field 'images' holds {len(spec.images):,} images, {total:,} patches (patch_dim={spec.patch_dim})"


def human(n: float) -> str:
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
