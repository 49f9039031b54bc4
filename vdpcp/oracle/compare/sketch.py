"""A count sketch of parameter gradients: how the oracle sums a real-size tower's gradients over the CP ranks
without sending them.

Below float64 the oracle needs one figure of the summed parameter gradients: |sum_r g_r - g| against |g| (2-norms,
vdpcp.oracle.compare.precision.compare_vector). A count sketch (Charikar, Chen and Farach-Colton, 2002) maps a vector x to WIDTH
numbers, S(x)[j] = the sum of sign(i) * x[i] over the elements i hashed to j. It is linear, so S(sum_r g_r) =
sum_r S(g_r): each rank sketches its own gradients, one all-reduce of WIDTH float64 numbers sums the sketches, and
|S(sum) - S(g)|^2 is an unbiased estimate of |sum - g|^2. With a random bucket and sign per element its relative
standard deviation is sqrt(2 (1 - sum x_i^4 / |x|^4) / WIDTH) <= sqrt(2 / WIDTH): at 2**20, 0.14% of the squared
norm, 0.07% of the norm, whatever the difference is like; a difference in a few elements is kept exactly (they
collide with probability about their count squared over WIDTH, and a collision still adds them with random signs).
The tolerance it is held to is at least twice the unsharded run's own measured rounding (vdpcp.oracle.compare.precision), so an
error of the estimate a thousand times smaller than that margin moves no verdict.

At the real size a rank sends a sketch far smaller than the gradients themselves, whose sum would otherwise be a
case's largest phase over gloo (reports/gpu/README.md). A tower with fewer parameters than WIDTH sends its
gradients as they are (``pays``): then the sketch would be the larger of the two, and float64 is
compared element by element in any case.

The buckets and signs come from a seeded generator on the gradients' device, per (parameter, chunk of CHUNK
elements), so every rank of a case (one device type) draws the same hash, and the same case draws it again.
"""

from __future__ import annotations

import torch

WIDTH = 1 << 20
CHUNK = 1 << 22  # elements hashed at a time: the temporaries stay this size, whatever the parameter's
SEED = 0x5EED


def pays(numel: int) -> bool:
    """Whether sketching ``numel`` gradient elements sends less than the elements themselves."""
    return numel > WIDTH


def sketch(pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The count sketches of two lists of tensors hashed alike: ``pairs`` yields (got, want) per parameter, in the
    same order on every rank (None: zeros). Returns (S(got), S(want)), float64 vectors of WIDTH on ``device``."""
    width = WIDTH
    got_sketch = torch.zeros(width, dtype=torch.float64, device=device)
    want_sketch = torch.zeros_like(got_sketch)
    gen = torch.Generator(device=device)
    for k, (got, want) in enumerate(pairs):
        flat = [t.detach().reshape(-1) if t is not None else None for t in (got, want)]
        numel = next((t.numel() for t in flat if t is not None), 0)
        for c, start in enumerate(range(0, numel, CHUNK)):
            gen.manual_seed(hash_seed(k, c))
            n = min(CHUNK, numel - start)
            drawn = torch.randint(0, 2 * width, (n,), generator=gen, device=device)
            bucket, sign = drawn >> 1, 1.0 - 2.0 * (drawn & 1).double()
            for out, t in zip((got_sketch, want_sketch), flat):
                if t is not None:
                    out.index_add_(0, bucket, sign * t[start : start + n].double())
    return got_sketch, want_sketch


def hash_seed(parameter: int, chunk: int) -> int:
    """The generator's seed for one chunk of one parameter: distinct for every (parameter, chunk) of any tower."""
    return SEED + (parameter << 24) + chunk
