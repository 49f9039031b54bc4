"""A CP group of one rank (CP=1, sharding off): the rank encodes everything, and its gradients are held to the
unsharded ones as a sum over its one rank only. A wrong parameter gradient is said once, as that sum, not a second
time as "this rank alone" (the per-rank check is for a CP group of several ranks: there a rank's own gradients
are not the sum). Run in-process: one rank, its sums over the group the rank's own tensors."""

from types import SimpleNamespace

import torch

from vdpcp import oracle
from vdpcp.impls.reference import Reference
from vdpcp.matrix.case import Case
from vdpcp.matrix.scenarios import SCENARIOS
from vdpcp.tools.mutants.interface import gradient_changed

SPEC = next(s.spec for s in SCENARIOS if s.spec.name == "three-images")


class Uncached(Reference):
    """The reference, built afresh for its case: no model stays cached in the test process."""

    name = "uncached-reference"

    def model_key(self, case):
        return None


class GradientTenPercentOff(Uncached):
    """Right features, and their gradient handed back 10% too large: every input and parameter gradient is off.
    It issues no collective, as a CP group of one needs none."""

    name = "gradient-ten-percent-off"

    def encode_sharded(self, model, batch, config, group):
        return gradient_changed(self.encode(model, batch), lambda grad: grad * 1.1)


def _check_alone(impl) -> list[str]:
    ctx = SimpleNamespace(rank=0, backend="gloo", device=torch.device("cpu"))
    groups = SimpleNamespace(cp_rank=0, dp_rank=0, tp_rank=0, cp=None)
    result = oracle.check(ctx, Case(SPEC, 1, impl.name), impl, groups)
    assert result.read == [0, 1, 2] and result.images == 3, result  # the one rank read every row
    return result.failures


def test_at_cp_1_a_wrong_parameter_gradient_is_said_once_as_the_sum_over_the_one_rank(one_rank_sums):
    failures = _check_alone(GradientTenPercentOff())
    params = [f for f in failures if f.startswith("param grads")]
    assert len(params) == 1 and params[0].startswith("param grads (summed over ranks): "), failures
    assert any(f.startswith("input grads (summed over ranks): ") for f in failures), failures


def test_at_cp_1_the_reference_passes_every_check(one_rank_sums):
    assert _check_alone(Uncached()) == []
