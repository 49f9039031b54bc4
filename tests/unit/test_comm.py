"""What a sum over ranks accumulates in (vdpcp.feature.comm.accumulator): wide enough that the check's sum is the
rounding of the exact one, narrow enough for the real size's parameter-gradient sum."""

import torch

from vdpcp.feature import comm


def test_16_bit_floats_sum_in_float32_and_everything_else_in_float64():
    bf16, f16, f32 = (torch.zeros(3, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert comm.accumulator([bf16, f16]) == torch.float32
    assert comm.accumulator([f32]) == torch.float64
    assert comm.accumulator([bf16, f32]) == torch.float64  # one wide tensor widens the collective
    assert comm.accumulator([torch.zeros(3, dtype=torch.int64)]) == torch.float64  # counts stay exact
    assert comm.accumulator([]) == torch.float64


def test_a_float32_sum_of_bf16_values_rounds_as_the_float64_sum_does():
    """Eight ranks' bf16 gradients of mixed scale: their float32 sum, rounded to bf16, is the float64 sum's
    rounding in all but a rare tie; a bf16 accumulation (what a narrower accumulator would do) is not."""
    gen = torch.Generator().manual_seed(0)
    parts = [(torch.randn(200_000, generator=gen) * 10 ** torch.randint(-3, 3, (200_000,), generator=gen)).bfloat16()
             for _ in range(8)]
    exact = sum(p.double() for p in parts).bfloat16()
    wide = comm.accumulator(parts)
    summed = sum(p.to(wide) for p in parts).bfloat16()
    narrow = parts[0].clone()
    for p in parts[1:]:
        narrow += p
    assert (summed != exact).float().mean() < 1e-3
    assert (narrow != exact).float().mean() > 0.1
