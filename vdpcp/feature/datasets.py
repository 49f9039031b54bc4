"""Dataset-shaped microbatches: what a VLM's packed vision input looks like for three kinds of data.

- ``doc-qa``: single-image document QA; one portrait page per sample, large and similar in size.
- ``multi-image``: 1 to 5 images per sample of independent sizes (448 to 1024 px a side), the mix that
  leaves the count split's tail rank hot: counts even out, patches do not.
- ``video``: one clip per sample, 4 to 32 frames of one size, encoded as tubelets of 2 frames.

Sizes are drawn as patch grids of real pixel sizes at P=16 (448 px -> 28 patches a side, 1024 px -> 64),
sides even as dynamic-resolution processors round them. At another ``patch_dim`` the grids stay and the
pixel sizes scale with it, so the token counts, which are all that balance and memory depend on, stay
realistic for the toy tower too. ``downscale`` divides every grid side (for small CPU runs).
Every microbatch is a deterministic function of (name, seed, samples, patch_dim, downscale).
"""

from __future__ import annotations

import random
from typing import Callable

from vdpcp.feature.spec import MicrobatchSpec

REFERENCE_PATCH = 16  # the pixel sizes below are for this patch size
MIN_SIDE, MAX_SIDE = 448 // REFERENCE_PATCH, 1024 // REFERENCE_PATCH  # 28 and 64 patches
VIDEO_TUBELET = 2


class DatasetError(ValueError):
    """An unknown dataset name or an impossible size argument."""


def _even_side(rng: random.Random, lo: int, hi: int) -> int:
    return 2 * rng.randint(lo // 2, hi // 2)


def _doc_qa(rng: random.Random, samples: int):
    """One page per sample: width 28-48 patches (448-768 px), height about sqrt(2) x width, capped."""
    images = []
    for _ in range(samples):
        w = _even_side(rng, MIN_SIDE, 48)
        h = min(MAX_SIDE, 2 * round(w * rng.uniform(1.3, 1.45) / 2))
        images.append((h, w))
    return images, None, 1


def _multi_image(rng: random.Random, samples: int):
    images = []
    for _ in range(samples):
        for _ in range(rng.randint(1, 5)):
            images.append((_even_side(rng, MIN_SIDE, MAX_SIDE), _even_side(rng, MIN_SIDE, MAX_SIDE)))
    return images, None, 1


# Frame grids of common clip resolutions after a processor's resize: 448x448, 448x784 (16:9), 576x1024.
VIDEO_GRIDS = ((28, 28), (28, 50), (36, 64))


def _video(rng: random.Random, samples: int):
    images, num_frames = [], []
    for _ in range(samples):
        grid = rng.choice(VIDEO_GRIDS)
        frames = rng.randint(4, 32)  # odd counts leave a short last tubelet
        images += [grid] * frames
        num_frames.append(frames)
    return images, num_frames, VIDEO_TUBELET


# name -> (grid generator, default samples per microbatch)
DATASETS: dict[str, tuple[Callable, int]] = {
    "doc-qa": (_doc_qa, 16),
    "multi-image": (_multi_image, 12),  # about 36 images, within the 16-64 a packed microbatch holds
    "video": (_video, 3),
}


def generate(
    name: str, seed: int = 0, *, samples: int | None = None, patch_dim: int = REFERENCE_PATCH, downscale: int = 1
) -> MicrobatchSpec:
    """One packed microbatch of dataset ``name``, deterministic in its arguments."""
    if name not in DATASETS:
        raise DatasetError(f"dataset must be one of {sorted(DATASETS)}, got {name!r}")
    make, default_samples = DATASETS[name]
    samples = default_samples if samples is None else samples
    if not isinstance(samples, int) or samples < 1:
        raise DatasetError(f"samples must be a positive integer, got {samples!r}")
    if not isinstance(downscale, int) or downscale < 1:
        raise DatasetError(f"downscale must be a positive integer, got {downscale!r}")
    rng = random.Random(f"{name}:{seed}")  # str seeds hash deterministically, unlike hash()
    grids, num_frames, T = make(rng, samples)
    images = tuple((max(1, gh // downscale) * patch_dim, max(1, gw // downscale) * patch_dim) for gh, gw in grids)
    return MicrobatchSpec(
        images=images,
        num_frames=None if num_frames is None else tuple(num_frames),
        temporal_patch_size=T,
        patch_dim=patch_dim,
        seed=seed,
        name=f"{name}-seed{seed}",
    )
