"""The regrouped check's bitwise comparison of many tensors at once says what torch.equal of each pair says."""

import math

import pytest
import torch

from vdpcp.oracle.compare.regrouped import bitwise_equal, within_ulps


def _pairs(change):
    base = [torch.arange(6, dtype=torch.float64).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16), torch.zeros(3)]
    got = [t.clone() for t in base]
    change(got)
    return got, base


@pytest.mark.parametrize("change", [
    lambda got: None,
    lambda got: got[1].__setitem__(2, 1.0078125),  # one bf16 step on one element of the second tensor
    lambda got: got[0].__setitem__((1, 2), math.nan),
    lambda got: got[2].__setitem__(0, -0.0),  # equal in value, as torch.equal counts it
    lambda got: got.__setitem__(2, torch.zeros(4)),  # a shape that differs
    lambda got: got.__setitem__(2, torch.zeros(3, dtype=torch.float64)),  # a dtype that differs
])
def test_many_pairs_at_once_say_what_each_torch_equal_says(change):
    got, want = _pairs(change)
    assert bitwise_equal(got, want) == all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_difference_within_the_allowed_units_of_rounding_is_the_same_and_one_past_them_is_not():
    want = [torch.ones(1000, dtype=torch.float64)]
    eps = torch.finfo(torch.float64).eps
    assert not within_ulps([want[0] * (1 + 3 * eps)], want, 0)
    assert within_ulps([want[0] * (1 + 3 * eps)], want, 16)
    assert not within_ulps([want[0] * (1 + 40 * eps)], want, 16)
