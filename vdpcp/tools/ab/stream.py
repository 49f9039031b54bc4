"""The microbatches of an A/B run: dataset-shaped vision inputs with text around them, ``steps x accumulate``.

Microbatch i is vdpcp.feature.datasets' draw of the chosen dataset at the tower's scale (``SCALES``). A run must cross
the two paths the count split adds to plain data parallelism: a microbatch with fewer images (tubelets) than
CP ranks, where placeholders are injected and dropped again, and one whose count CP does not divide, where
the last rank takes the remainder. A few draws rarely give both (doc-qa never has fewer pages than samples),
so each kind the draws lack is mixed in: a small microbatch of that kind, cut from a draw of the same dataset,
takes the last slot of step 1 (placeholders) or of step 2 (remainder). The report lists every microbatch.

Text: a prefix and a suffix of tokens drawn from a Zipf law (so the loss has something to learn in a few
steps), the microbatch's vision features between them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vdpcp.feature.datasets import generate
from vdpcp.feature.spec import MicrobatchSpec

PREFIX, SUFFIX = 8, 32  # text tokens before and after the vision features
KINDS = ("placeholders", "remainder")  # the paths every run must cross, in the order they are mixed in
SEED_STRIDE = 1_000_003  # run seed s draws microbatch i with dataset seed s * SEED_STRIDE + i


@dataclass(frozen=True)
class Scale:
    """How big a tower's microbatches are: its patch size, the grid downscale and samples per microbatch."""

    patch_dim: int
    downscale: int
    samples: int | None  # None: the dataset's own


SCALES = {
    "toy": Scale(patch_dim=4, downscale=4, samples=4),  # seconds on two CPU cores
    "real": Scale(patch_dim=16, downscale=1, samples=None),  # the dataset's real sizes, for GPU memory
}


@dataclass(frozen=True)
class Draw:
    spec: MicrobatchSpec
    kind: str  # "placeholders", "remainder" or "even", at the run's CP size
    mixed_in: bool = False  # a small microbatch put in so that the run crosses that path


def kind_of(spec: MicrobatchSpec, cp: int) -> str:
    units = spec.num_tubelets  # what the count split divides: images, or a video's tubelets
    if units < cp:
        return "placeholders"
    return "remainder" if units % cp else "even"


def schedule(dataset: str, cp: int, steps: int, accumulate: int, seed: int, tower: str) -> list[list[Draw]]:
    """The run's microbatches, step by step; every kind in KINDS occurs once there are two slots for it."""
    scale = SCALES[tower]
    draws = [_draw(dataset, seed * SEED_STRIDE + i, scale) for i in range(steps * accumulate)]
    flat = [Draw(spec, kind_of(spec, cp)) for spec in draws]
    kinds = {d.kind for d in flat}
    slots = [accumulate - 1, 2 * accumulate - 1]  # the last microbatch of steps 1 and 2
    for kind, slot in zip(KINDS, slots):
        if kind not in kinds and slot < len(flat):
            source = _draw(dataset, flat[slot].spec.seed, scale, samples=cp + 1)  # at least cp + 1 units
            flat[slot] = Draw(cut(source, cp - 1 if kind == "placeholders" else cp + 1), kind, mixed_in=True)
    return [flat[s * accumulate : (s + 1) * accumulate] for s in range(steps)]


def cut(spec: MicrobatchSpec, units: int) -> MicrobatchSpec:
    """The leading ``units`` images or tubelets of a microbatch (a video cut on a tubelet boundary)."""
    T, frames, left = spec.temporal_patch_size, [], units
    for n in spec.media_frames:
        if left <= 0:
            break
        frames.append(min(n, T * left))
        left -= -(-frames[-1] // T)  # its tubelets, a short last one included
    return replace(spec, images=spec.images[: sum(frames)], num_frames=None if spec.num_frames is None else tuple(frames),
                   name=f"{spec.name}-first{units}")


def text(draw: Draw, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The microbatch's prefix and suffix tokens, deterministic in its seed."""
    gen = torch.Generator().manual_seed(draw.spec.seed)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    tokens = torch.multinomial(zipf, PREFIX + SUFFIX, replacement=True, generator=gen)
    return tokens[:PREFIX], tokens[PREFIX:]


def _draw(dataset: str, seed: int, scale: Scale, samples: int | None = None) -> MicrobatchSpec:
    samples = samples if samples is not None else scale.samples
    return generate(dataset, seed, samples=samples, patch_dim=scale.patch_dim, downscale=scale.downscale)
