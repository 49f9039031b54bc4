"""Sized mutants (vdpcp.tools.mutants.sized): NAME@SIZE, a bad name or size refused in one line, and a size planted as
asked in every dtype (in expectation, where it is under the dtype's spacing)."""

import pytest
import torch

from vdpcp.cli import main
from vdpcp.tools.mutants import SIZED, known
from vdpcp.tools.mutants.sized import scaled


def test_a_sized_mutant_is_known_at_a_positive_size_and_plain_names_stay_as_they_are():
    assert known("scale-rank-features@1e-3") and known("features-rolled-on-last-rank")
    assert set(SIZED) == {"scale-rank-features", "scale-rank-grad", "nudge-token", "scale-image"}


@pytest.mark.parametrize("name, says", [("no-such@1e-3", "unknown sized mutant 'no-such'"),
                                        ("scale-rank-grad@abc", "size 'abc' is not a positive number"),
                                        ("scale-rank-grad@-1", "size '-1' is not a positive number"),
                                        ("scale-rank-grad@nan", "size 'nan' is not a positive number")])
def test_a_bad_sized_mutant_is_one_clear_error(name, says, capsys):
    with pytest.raises(ValueError, match=says):
        known(name)
    assert main(["check", "--cp", "2", "--mutant", name]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [1e-2, 1e-3])
def test_a_size_under_the_dtypes_spacing_is_still_planted_in_expectation(dtype, eps):
    t = torch.randn(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    moved = scaled(t, eps).double() - t.double()
    assert moved.abs().sum() > 0  # x (1 + 1e-3) in bf16 itself would round every element back
    assert (moved / t.double()).mean().item() == pytest.approx(eps, rel=0.05)  # each element x (1 + eps) on average


def test_the_instrument_counts_the_elements_it_moved_and_only_a_sized_mutant_carries_a_count():
    from vdpcp.impls import resolve
    from vdpcp.tools.mutants import applied, planted
    from vdpcp.tools.mutants.sized import Planted

    t = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    count = Planted()
    assert torch.equal(scaled(t, 1e-9, count), t) and count.moved == 0  # far under bf16's spacing: nothing moved
    scaled(t, 0.5, count)
    assert count.moved == 4  # x 1.5: every element
    reference = resolve("reference")
    with applied("scale-rank-grad@1e-3", reference) as subject:
        assert planted(subject) == 0  # nothing run yet
    with applied("features-rolled-on-last-rank", reference) as subject:
        assert planted(subject) is None
    assert planted(reference) is None
