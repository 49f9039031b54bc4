"""An encode that returns something other than tensors is the implementation's error on every rank, never read as
the unsharded encoder rejecting the spec (vdpcp.contract.protocol.outputs_of, vdpcp.oracle); an unsharded encode that raises
is that: unsharded-error, naming what it raised."""

import pytest

from vdpcp.impls.reference import Reference
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_case
from vdpcp.matrix.scenarios import SCENARIOS

SPEC = next(s.spec for s in SCENARIOS if s.spec.name == "three-images")


class ReturnsNothing(Reference):
    name = "returns-nothing"

    def encode(self, model, batch):
        super().encode(model, batch)
        return None


class Rejects(Reference):
    name = "rejects"

    def encode(self, model, batch):
        raise ValueError("this tower takes no such spec")


returns_nothing, rejects = ReturnsNothing(), Rejects()


@pytest.mark.distributed
def test_an_unsharded_encode_that_returns_no_tensors_is_an_error_not_an_unsharded_error():
    result = run_case(Case(SPEC, 1, "tests.oracle.test_outputs:returns_nothing"), backend="gloo")
    assert result.verdict == "error", result.summary()
    assert "OutputsError" in result.error and "returns-nothing.encode returned NoneType" in result.error, result.error


@pytest.mark.distributed
def test_an_unsharded_encode_that_raises_is_an_unsharded_error_naming_what_it_raised():
    result = run_case(Case(SPEC, 1, "tests.oracle.test_outputs:rejects"), backend="gloo")
    assert result.verdict == "unsharded-error", result.summary()
    assert result.ranks[0].unsharded_error == "ValueError: this tower takes no such spec", result.summary()
