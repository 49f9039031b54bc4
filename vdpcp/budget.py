"""Sizing: what a case will need, from its spec's shapes alone, before any tensor is built; the limit it must
stay under; and how to tell a rank that ran out of memory from a verdict.

Pure arithmetic over shapes (no torch, no torch.distributed): a 70-byte spec can ask for a 100 GB image, so
every entry point sizes a case here first (``check``) and refuses one over the limit in one line that names the
field and the figure, instead of starting to allocate it next to other jobs.

What a case costs, as the oracle runs it (vdpcp.oracle.check), on EVERY one of its ranks, all of them on this
machine (the harness launches them here):

- the unsharded arm: the whole microbatch through the encoder, forward and backward (inputs, their gradient,
  the activations autograd keeps) -- ``unsharded``;
- the sharded arm beside it: the whole microbatch's inputs again, and this rank's shard through the encoder
  (estimated under a split by count: whole units, the remainder on the last rank, which is the busiest);
- the loss weights, one tensor of the features' shape per CP rank, and both models with their gradients.

One arm's cost per patch is the implementation's ``patch_bytes(case)`` where it declares one (vdpcp.protocol),
else this module's estimate for vdpcp's toy tower (``toy_arm_bytes``), measured against the real peak.
"""

from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
ENV = "VDPCP_MAX_SPEC_BYTES"
FLAG = "--max-spec-bytes"
# For a 2-core, 24 GB machine shared with other jobs: a third of its memory. The whole suite peaks at +3.3 GB and
# its largest case (video at CP=8) needs 108 MiB; a captured 12-image microbatch at P=16 (9.4k patches) needs
# 2.1 GiB at CP=4; a 36-image one (83k patches) needs 34 GiB at CP=8, more than such a machine has, and is refused,
# as is a size typo (one 65536 x 65536 image: terabytes).
DEFAULT_LIMIT = 8 * GiB
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2}
CHANNELS = 3
# A microbatch's packed patches are held three times over in an arm: the patches, their gradient, and that
# gradient assembled from each image's piece in backward.
INPUT_COPIES = 3
# The toy tower's activations kept for backward, in elements: per patch and layer (layer norms, qkv, the
# attention's q, k, v and output, its projection, two residuals, the MLP's 4h in and out: about 20 h), per
# patch after the blocks (final norm, even padding, pixel shuffle, the projector's norm: 8 h), per output token
# in the projector (6 lm_hidden). Below float32 they are counted as float32 (CPU kernels compute bf16 in float32),
# and every patch costs 1 KiB whatever the dtype (autograd's and the allocator's bookkeeping: float32 measured
# 8.2 KB a patch, not half of float64's 12.6). Measured (tiny tower, one arm, the slope of peak RSS, P=4 between
# 16k and 64k or 256k patches): 12.6 KB a patch in float64, 8.2 KB in float32; at P=16 (1.6k to 6.4k patches)
# 29.0 KB in float64. This estimate says 15.0, 8.0 and 32.3 KB.
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


def limit() -> tuple[int, str]:
    """(bytes a case may need on this machine, where that figure comes from): limited(), else VDPCP_MAX_SPEC_BYTES,
    else DEFAULT_LIMIT."""
    if _override:
        return _override[-1]
    env = os.environ.get(ENV)
    if env is not None and env.strip():
        return parse_bytes(env, ENV), f"{ENV}={env.strip()}"
    return DEFAULT_LIMIT, "the default limit"


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


def override() -> tuple[int, str] | None:
    """The innermost limited() in force, if any (for tests' setting-leak guard)."""
    return _override[-1] if _override else None


# --- what a case needs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    """A case's estimated memory, in bytes, from its shapes."""

    patches: int  # real patches of the microbatch
    unsharded: int  # one unsharded arm: the whole microbatch through the encoder, forward and backward
    ranks: tuple[int, ...]  # what each CP rank holds at its peak (both arms of the oracle), in CP rank order
    replicas: int  # ranks per CP rank (DP replicas x TP ranks), each holding as much
    dtype: str

    @property
    def per_rank(self) -> int:
        return max(self.ranks, default=0)

    @property
    def world(self) -> int:
        return len(self.ranks) * self.replicas

    @property
    def total(self) -> int:
        """On this machine: every rank of the case."""
        return sum(self.ranks) * self.replicas

    def text(self, patches: bool = True) -> str:
        ranks = f"{self.world} rank{'s' if self.world > 1 else ''}" + (f" x up to {human(self.per_rank)}" if self.world > 1 else "")
        head = f"{self.patches:,} patches: " if patches else ""
        return (f"{head}about {human(self.total)} on this machine ({ranks}, {self.dtype}; the unsharded encoder "
                f"alone {human(self.unsharded)})")


def need(case, patch_bytes: int | None = None) -> Need:
    """What ``case`` will need. ``patch_bytes``: one arm's bytes per patch, as an implementation declares it
    (default: its ``patch_bytes(case)``, else the toy tower's estimate)."""
    if patch_bytes is None:
        patch_bytes = declared_patch_bytes(case)
    spec, d = case.spec, DTYPE_BYTES[case.dtype]
    units = _units(spec)
    patches = sum(spec.row_patches)
    inputs = patches * CHANNELS * spec.patch_dim**2 * INPUT_COPIES * d  # the sharded arm's whole microbatch

    def arm(shard) -> int:
        if patch_bytes is not None:
            return sum(rows * p for rows, p, _ in shard) * patch_bytes
        return toy_arm_bytes(case, shard)

    unsharded = arm(units)
    weights = case.cp * _tokens(units) * _lm_hidden(case) * d  # W_r of every CP rank, on every rank
    fixed = 4 * _params(case) * d  # two models, each with its gradients
    if case.config.shard_vision:
        shards = _count_shards(units, case.cp)
        ranks = tuple(unsharded + inputs + arm(shard) + weights + fixed for shard in shards)
    else:
        ranks = (2 * unsharded + weights + fixed,) * case.cp
    return Need(patches, unsharded, ranks, case.dp * case.tp, case.dtype)


def check(case, source: str | None = None) -> Need:
    """need(case), or SpecTooLarge (one line: the field, the figure, the limit and how to raise it) when it is over."""
    found = need(case)
    allowed, where = limit()
    if found.total > allowed:
        spec = case.spec
        prefix = f"{source}: " if source else ""
        from vdpcp.spec import SpecTooLarge

        raise SpecTooLarge(
            f"{prefix}{_culprit(spec)}: at CP={case.cp} the case needs {found.text(patches=False)}, over {where} of "
            f"{human(allowed)}; raise it with {FLAG} (pytest: --vdpcp-max-spec-bytes) or {ENV} where the machine has the memory")
    return found


def fits(case) -> bool:
    return need(case).total <= limit()[0]


def declared_patch_bytes(case) -> int | None:
    """The implementation's own bytes per patch for one arm (``patch_bytes(case)``), or None."""
    from vdpcp.impls import ImplError, resolve

    try:
        declared = getattr(resolve(case.impl), "patch_bytes", None)
    except ImplError:
        return None  # sized as the toy tower; the ranks then report the bad target as they always have
    value = declared(case) if callable(declared) else declared
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BudgetError(f"{case.impl}: patch_bytes(case) is {value!r}; expected a positive int (bytes per patch)")
    return value


def toy_arm_bytes(case, units) -> int:
    """One arm of vdpcp's toy tower (vdpcp.model) over ``units`` [(rows, patches per row, grid)]: its inputs and
    their gradient, tubelet stacks, activations kept for backward, the projector's."""
    c, d, T = _tower(case), DTYPE_BYTES[case.dtype], case.spec.temporal_patch_size
    row_patches = sum(rows * p for rows, p, _ in units)
    unit_patches = sum(p for _, p, _ in units)
    inputs = row_patches * CHANNELS * case.spec.patch_dim**2 * INPUT_COPIES
    stacked = unit_patches * T * CHANNELS * case.spec.patch_dim**2 * 2 if T > 1 else 0
    hidden = unit_patches * (PER_LAYER * c["layers"] + AFTER_BLOCKS) * c["hidden"]
    projector = _tokens(units) * PER_TOKEN * c["lm_hidden"]
    return (inputs + stacked) * d + (hidden + projector) * max(d, 4) + row_patches * PATCH_OVERHEAD


def toy_params(case) -> int:
    """Parameters of the toy tower + projector (vdpcp.model.VisionModel) as a case builds it, counted from its config."""
    from vdpcp.model import positions_needed

    c = _tower(case)
    h, lm, inp = c["hidden"], c["lm_hidden"], case.spec.temporal_patch_size * CHANNELS * case.spec.patch_dim**2
    embed = inp * h + h + min(positions_needed(case.spec.grids), c["max_grid"]) ** 2 * h
    block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (4 * h * h + 4 * h) + (4 * h * h + h)
    projector = 8 * h + (4 * h * lm + lm) + (lm * lm + lm)
    return embed + c["layers"] * block + 2 * h + projector


def _tower(case) -> dict:
    from dataclasses import asdict

    from vdpcp.model import TOWERS, TowerConfig

    return {**asdict(TowerConfig()), **TOWERS.get(case.tower, {})}


def _lm_hidden(case) -> int:
    return _tower(case)["lm_hidden"]


def _params(case) -> int:
    return toy_params(case) if declared_patch_bytes(case) is None else 0


def _units(spec) -> list[tuple[int, int, tuple[int, int]]]:
    """The encoder's units (images, or tubelets of T frames): (rows it holds, patches of each row, its grid)."""
    out, row, T = [], 0, spec.temporal_patch_size
    grids = spec.grids
    for frames in spec.media_frames:
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


# --- resource failures -----------------------------------------------------------------------------------

# What torch, the C++ runtime, CUDA and the kernel say when an allocation fails.
_OUT_OF_MEMORY = re.compile(r"MemoryError|OutOfMemoryError|can't allocate memory|std::bad_alloc|out of memory|"
                            r"Cannot allocate memory", re.IGNORECASE)
_TRIED = re.compile(r"[Tt]ried to allocate ([\d.]+) ?(bytes|[KMGT]iB|B)\b")
_SECTION = re.compile(r"^----- rank (\d+): (.+?) -----$", re.MULTILINE)
_HEADLINE_RANK = re.compile(r"rank (\d+) (raised .*?)(?=; rank \d+ |$)")


def out_of_memory(text: str) -> str | None:
    """``text`` (an exception's line) as "out of memory (tried to allocate 96.0 GiB: ...)", or None when it is
    not an allocation failure."""
    if not text or not _OUT_OF_MEMORY.search(text):
        return None
    line = re.sub(r"^raised |\[enforce fail at [^]]*\] (err == 0\. )?", "", " ".join(text.split())).rstrip(": ")
    tried = _TRIED.search(line)
    if tried is None:
        return f"out of memory ({_clip(line)})"
    number, unit = float(tried.group(1)), tried.group(2)
    size = human(number * {"bytes": 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}[unit])
    return f"out of memory: tried to allocate {size} ({_clip(line)})"


def resource_failure(result) -> str | None:
    """"rank N ran out of memory: ..." for a CaseResult where some rank's allocation failed (it raised, or its
    unsharded encoder did), else None. A resource failure says nothing about the encoder or about sharding."""
    error = getattr(result, "error", None)
    if error:
        found = _SECTION.findall(error) or _HEADLINE_RANK.findall(error.splitlines()[0])
        for rank, what in found:
            if not what.startswith("raised "):
                continue  # a peer that hung or died quotes the raiser's error: the raiser is the one out of memory
            oom = out_of_memory(what)
            if oom is not None:
                return f"rank {rank} ran {oom}"
        return None
    for r in getattr(result, "ranks", ()):
        oom = out_of_memory(r.unsharded_error or "")
        if oom is not None:
            return f"rank {r.rank} ran {oom} in the unsharded encoder"
    return None


def _clip(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


# --- long specs in reports -------------------------------------------------------------------------------

SHORT_ROWS = 8  # a spec of at most this many rows is printed whole


def summary(spec, path=None) -> str:
    """The spec as reports print it: whole when short; else counts and size ranges, and where the whole is."""
    if len(spec.images) <= SHORT_ROWS:
        return str(spec.to_dict())
    frames = spec.media_frames
    videos = [n for n in frames if n > 1]
    patches = spec.row_patches
    if videos:
        parts = [f"{spec.name}: {len(spec.images):,} rows in {len(frames):,} media items",
                 f"{len(videos):,} videos of {_span(min(videos), max(videos))} frames (T={spec.temporal_patch_size})"]
    else:
        parts = [f"{spec.name}: {len(spec.images):,} images"]
    hs, ws = [h for h, _ in spec.images], [w for _, w in spec.images]
    parts.append(f"{_span(min(hs), max(hs))} x {_span(min(ws), max(ws))} px")
    parts.append(f"{_span(min(patches), max(patches))} patches each, {sum(patches):,} in all (patch_dim={spec.patch_dim})")
    parts.append(f"seed {spec.seed}")
    return ", ".join(parts) + (f"; the whole spec: {path}" if path else "")


def _span(low: int, high: int) -> str:
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def spec_record(spec) -> dict:
    """The spec for a JSON report: whole when short; else its name, counts and size ranges."""
    if len(spec.images) <= SHORT_ROWS:
        return spec.to_dict()
    return {"name": spec.name, "rows": len(spec.images), "media": len(spec.media_frames),
            "patches": sum(spec.row_patches), "summary": summary(spec)}
