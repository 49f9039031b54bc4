"""Resolving --impl targets: registered names, module:object, a class, an object that only has the required
methods (the protocol's defaults fill the rest), and one clear ImplError for anything else."""

import pytest

from vdpcp.contract.protocol import Implementation
from vdpcp.impls import ImplError, resolve
from vdpcp.impls.reference import Reference


class Duck:  # not an Implementation subclass: only what the protocol requires
    name = "duck"

    def encode(self, model, inputs):
        return model(inputs.patches, inputs.imgs_sizes)

    def encode_sharded(self, model, inputs, config, group):
        return self.encode(model, inputs)


DUCK = Duck()
NOT_ONE = object()


def test_names_classes_and_objects_resolve_to_implementations():
    assert resolve("reference").name == "reference" and resolve("mcore").name == "mcore"
    assert isinstance(resolve("vdpcp.impls.reference:Reference"), Reference)  # a class is instantiated


def test_an_object_with_the_required_methods_gets_the_protocols_defaults():
    duck = resolve("tests.unit.test_impls:DUCK")
    assert isinstance(duck, Implementation) and duck.name == "duck"
    assert duck.encode.__self__ is DUCK  # its own methods are used...
    assert duck.splits == ("count",) and duck.plan(None, None) is None and duck.tensor_parallel == ()  # ...defaults


def test_anything_else_is_one_clear_error():
    with pytest.raises(ImplError, match=r"--impl tests.unit.test_impls:NOT_ONE: object object is not an implementation "
                                        r"of vision DP over CP \(missing name, encode, encode_sharded"):
        resolve("tests.unit.test_impls:NOT_ONE")


@pytest.mark.parametrize("target, message", [
    ("no_such_module_for_vdpcp:impl", r"--impl no_such_module_for_vdpcp:impl: cannot import module 'no_such_module_for_vdpcp'"),
    ("vdpcp.impls.reference:nothing_here", r"module 'vdpcp.impls.reference' has no attribute 'nothing_here'"),
    ("not-registered", r"--impl not-registered: not a registered implementation \(automodel, automodel-shipped, "
                       r"bridge-exaone45, bridge-qwen3-vl, bridge-qwen3-vl-0.5.0, mcore, "
                       r"nemotron-omni, qwen2_5_vl, reference"),
])
def test_a_target_that_names_nothing_is_one_clear_error(target, message):
    with pytest.raises(ImplError, match=message):
        resolve(target)


def test_a_target_resolves_to_one_object_every_time():  # rank workers and reports resolve the same string often
    assert resolve("vdpcp.impls.reference:Reference") is resolve("vdpcp.impls.reference:Reference")
    assert resolve("tests.unit.test_impls:DUCK") is resolve("tests.unit.test_impls:DUCK")
