"""Microbatch specs: a JSON-able description of one microbatch's vision inputs, and its tensors.

A spec holds shapes and a seed, never pixels: the same spec always yields the same packed patches,
so a failing microbatch from a training run becomes a small file that reproduces anywhere.

    {"name": "doc-qa", "images": [[448, 448], [448, 896]], "num_frames": [1, 1],
     "temporal_patch_size": 1, "patch_dim": 4, "seed": 0}

``images`` has one row per image or video frame, (H, W) in pixels; ``num_frames`` groups rows into media
items (a still image is a one-frame item) and is required when ``temporal_patch_size`` > 1, where
consecutive frames of a video are encoded together as tubelets.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

DEFAULT_PATCH_DIM = 4  # the toy tower's patch size; real towers use 14 or 16
FIELDS = ("name", "images", "num_frames", "temporal_patch_size", "patch_dim", "seed")


class SpecError(ValueError):
    """A microbatch spec that does not describe a valid microbatch; the message names the field."""


class SpecTooLarge(SpecError):
    """A valid spec whose estimated memory on this machine is over the limit (vdpcp.matrix.budget); names the field."""


@dataclass(frozen=True)
class MicrobatchSpec:
    images: tuple[tuple[int, int], ...]
    num_frames: tuple[int, ...] | None = None
    temporal_patch_size: int = 1
    patch_dim: int = DEFAULT_PATCH_DIM
    seed: int = 0
    name: str = "microbatch"

    def __post_init__(self):
        _validate(self)

    def __repr__(self) -> str:
        """As a dataclass's, but a long spec (a test's failure, a log) by its counts and sizes, not every image."""
        if len(self.images) <= 8:
            return f"MicrobatchSpec({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields(self))})"
        return f"MicrobatchSpec(<{summary(self)}>)"

    # --- shapes -------------------------------------------------------------------------------
    # Computed once per spec (its fields never change): callers index them row by row, so recomputing them on every
    # access would make a loop over the rows quadratic.
    @functools.cached_property
    def media_frames(self) -> tuple[int, ...]:
        """Frames per media item; every row is its own item when num_frames is not given."""
        return self.num_frames if self.num_frames is not None else (1,) * len(self.images)

    @functools.cached_property
    def grids(self) -> tuple[tuple[int, int], ...]:
        """Patch grid (rows, cols) of each image row."""
        return tuple((h // self.patch_dim, w // self.patch_dim) for h, w in self.images)

    @functools.cached_property
    def row_patches(self) -> tuple[int, ...]:
        return tuple(gh * gw for gh, gw in self.grids)

    @functools.cached_property
    def media_rows(self) -> tuple[int, ...]:
        """The first row of each media item, and the end."""
        return tuple(itertools.accumulate(self.media_frames, initial=0))

    def media_groups(self, patches: int, kinds: Sequence | None = None) -> list[tuple[int, int]]:
        """Consecutive media items [first, stop) of at most ``patches`` patches each (an item larger alone); with
        ``kinds`` (one per media item), never two items of different kinds in one group."""
        rows, bounds, size = self.media_rows, [0], 0
        for m in range(len(self.media_frames)):
            item = sum(self.row_patches[rows[m] : rows[m + 1]])
            if size and (size + item > patches or (kinds is not None and kinds[m] != kinds[m - 1])):
                bounds.append(m)
                size = 0
            size += item
        bounds.append(len(self.media_frames))
        return list(zip(bounds, bounds[1:])) if self.media_frames else []

    @property
    def num_tubelets(self) -> int:
        return sum(math.ceil(n / self.temporal_patch_size) for n in self.media_frames)

    # --- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "images": [list(s) for s in self.images]}
        if self.num_frames is not None:
            out["num_frames"] = list(self.num_frames)
        out.update(temporal_patch_size=self.temporal_patch_size, patch_dim=self.patch_dim, seed=self.seed)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "spec") -> MicrobatchSpec:
        if not isinstance(data, dict):
            raise SpecError(f"{source}: expected a JSON object with fields {list(FIELDS)}, got {type(data).__name__}")
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise SpecError(f"{source}: unknown field(s) {unknown}; expected only {list(FIELDS)}")
        if "images" not in data:
            raise SpecError(f"{source}: field 'images' is missing; expected a list of [H, W] pairs")
        images = data["images"]
        bad = [] if not isinstance(images, list) else [i for i, s in enumerate(images) if not (
            isinstance(s, list | tuple) and len(s) == 2 and all(_is_int(v) for v in s))][:1]
        if not isinstance(images, list) or bad:
            first = f" ('images'[{bad[0]}] = {images[bad[0]]!r})" if bad and len(images) > 8 else ""
            raise SpecError(f"{source}: field 'images' must be a list of [H, W] integer pairs, got {clipped(images)}{first}")
        num_frames = data.get("num_frames")
        if num_frames is not None and (not isinstance(num_frames, list) or not all(_is_int(n) for n in num_frames)):
            raise SpecError(f"{source}: field 'num_frames' must be a list of integers, got {clipped(num_frames)}")
        for key in ("temporal_patch_size", "patch_dim", "seed"):
            if key in data and not _is_int(data[key]):
                raise SpecError(f"{source}: field '{key}' must be an integer, got {data[key]!r}")
        if "name" in data and not isinstance(data["name"], str):
            raise SpecError(f"{source}: field 'name' must be a string, got {data['name']!r}")
        try:
            return cls(
                images=tuple((int(h), int(w)) for h, w in images),
                num_frames=None if num_frames is None else tuple(num_frames),
                temporal_patch_size=data.get("temporal_patch_size", 1),
                patch_dim=data.get("patch_dim", DEFAULT_PATCH_DIM),
                seed=data.get("seed", 0),
                name=data.get("name", "microbatch"),
            )
        except SpecError as err:
            raise SpecError(f"{source}: {err}") from None

    @classmethod
    def load(cls, path: str | Path) -> MicrobatchSpec:
        return cls.from_dict(read_json(Path(path)), source=str(path))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    # --- tensors ------------------------------------------------------------------------------
    def tensors(self, dtype=torch.float64, device="cpu") -> Microbatch:
        """The microbatch's deterministic packed patches and per-row metadata."""
        gen = torch.Generator().manual_seed(self.seed)
        total = sum(self.row_patches)
        patches = torch.randn(1, total, 3 * self.patch_dim**2, generator=gen, dtype=torch.float64)
        cu = [0]
        for n in self.row_patches:
            cu.append(cu[-1] + n)
        return Microbatch(
            spec=self,
            patches=patches.to(dtype=dtype, device=device),
            imgs_sizes=torch.tensor(self.images, dtype=torch.int64, device=device).reshape(-1, 2),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        )


@dataclass
class Microbatch:
    """Packed vision input as a VLM hands it to its encoder: patches [1, total_patches, 3*P*P]."""

    spec: MicrobatchSpec
    patches: torch.Tensor
    imgs_sizes: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def device(self) -> torch.device:
        """The tower's device: where the metadata are, whether or not the pixels are there too (a data loader's
        are on the host: vdpcp.feature.pixels)."""
        return self.cu_seqlens.device


def read_json(path: Path):
    """A spec file's JSON; SpecError naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise SpecError(f"{path}: cannot read spec file ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"{path}: not valid JSON (expected UTF-8 text: {err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None


def clipped(values, shown: int = 8) -> str:
    """A list for an error message: whole when short, else its first few items and how many there are (a spec of
    100,000 images is named, not printed)."""
    if not isinstance(values, list | tuple) or len(values) <= shown:
        return repr(list(values) if isinstance(values, tuple) else values)
    return f"[{', '.join(repr(v) for v in values[:shown])}, ... ({len(values):,} in all)]"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(spec: MicrobatchSpec) -> None:
    P, T = spec.patch_dim, spec.temporal_patch_size
    if not _is_int(P) or P <= 0:
        raise SpecError(f"field 'patch_dim' must be a positive integer, got {P!r}")
    if not _is_int(T) or T <= 0:
        raise SpecError(f"field 'temporal_patch_size' must be a positive integer, got {T!r}")
    if not _is_int(spec.seed) or not 0 <= spec.seed < 2**64:  # torch's seed range; -1 would alias 2**64 - 1
        raise SpecError(f"field 'seed' must be an integer in [0, 2**64), got {spec.seed!r}")
    for i, (h, w) in enumerate(spec.images):
        if h <= 0 or w <= 0:
            raise SpecError(f"field 'images'[{i}] = [{h}, {w}]: sizes must be positive")
        if h % P or w % P:
            raise SpecError(f"field 'images'[{i}] = [{h}, {w}]: sizes must be multiples of patch_dim={P}")
    if spec.num_frames is None:
        if T > 1:
            raise SpecError(f"field 'num_frames' is required when temporal_patch_size={T} > 1")
        return
    if any(n <= 0 for n in spec.num_frames):
        raise SpecError(f"field 'num_frames' = {clipped(spec.num_frames)}: every media item needs at least one frame")
    if sum(spec.num_frames) != len(spec.images):
        raise SpecError(
            f"field 'num_frames' = {clipped(spec.num_frames)} sums to {sum(spec.num_frames)}, "
            f"expected len(images) = {len(spec.images)}"
        )
    if T > 1:  # frames of one tubelet are stacked channel-wise, so a video's frames share a size
        start = 0
        for m, n in enumerate(spec.num_frames):
            sizes = set(spec.images[start : start + n])
            if len(sizes) > 1:
                raise SpecError(
                    f"media item {m} (rows {start}..{start + n - 1}): frames of a video must share one size, got {sorted(sizes)}"
                )
            start += n


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
