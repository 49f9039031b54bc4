"""How the oracle compares parameter gradients (vdpcp.oracle._check_param_grads): summed over the CP group in buckets
of at most precision.BUCKET elements (a larger parameter alone), in float64 element by element, the first parameter
off named once, not every one after it."""

import torch

from vdpcp import oracle, precision
from vdpcp.case import RankResult


def test_float64_parameter_gradients_off_name_the_first_parameter_off_once(one_rank_sums):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)).double()
    model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    expected[1] += 1.0  # 0.bias and 1.weight are off
    expected[2] += 1.0
    result = RankResult(0)
    extra = torch.ones(2, dtype=torch.float64)
    (summed,) = oracle._check_param_grads(result, model, expected, None, [extra], torch.float64, 0.0)
    assert torch.equal(summed, extra)
    (said,) = result.failures
    assert said.startswith("param grads (summed over ranks): 0.bias: Tensor-likes are not close!"), said
    assert result.param_grad_err == 1.0


def test_parameters_go_in_runs_of_at_most_a_bucket_and_a_larger_one_alone():
    bucket = precision.BUCKET
    params = [torch.empty(1).expand(n) for n in (bucket // 2, bucket // 2, 1, 2 * bucket, 3)]  # sizes, no memory
    assert oracle._buckets(params) == [[0, 1], [2], [3], [4]]
    assert oracle._buckets([]) == []
