"""A duck-typed implementation (not an Implementation subclass) has every optional part it defines used.

Two levels: every optional part of the protocol that a duck defines is what resolve() hands out (so no part is
shadowed by a default); and, run through the oracle and the judge, a duck whose parts are needed to pass (its
own model, model under test and inputs), whose plan must be obeyed (a wrong plan fails), whose known limit
turns its failure into an xfail, and whose splits, TP sizes and preloads the matrix and the rank workers take.
If any one of them were ignored, its test fails: the default model, inputs or plan would reach the duck, or
its declared failure would be an error.
"""

import pytest

from vdpcp.contract import protocol
from vdpcp.contract.protocol import Implementation, KnownLimit, Ownership
from vdpcp.feature import sharded
from vdpcp.feature.model import TowerConfig, VisionModel
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.harness import config as harness_config
from vdpcp.impls import ImplError, resolve
from vdpcp.matrix import scenarios
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import preload_case_modules, run_case, run_judged

OPTIONAL = [part for part in protocol.PROTOCOL if part not in protocol.REQUIRED]
SPEC = MicrobatchSpec(images=((16, 16), (8, 24), (24, 8)), seed=2, name="three")


def test_every_optional_part_of_the_implementation_class_is_forwarded_for_a_duck():
    parts = {name for name in vars(Implementation) if not name.startswith("_")}
    assert parts - set(protocol.PROTOCOL) == set(), "an optional part a duck's own would never replace"
    assert set(OPTIONAL) >= {"build_model", "subject_model", "inputs", "plan", "known_limit", "replicated", "media",
                             "scenarios", "splits", "preload", "tensor_parallel"}


class Sentinels:
    """A duck whose every optional part is its own object."""

    name = "sentinels"

    def encode(self, model, inputs):
        raise AssertionError("not run here")

    encode_sharded = encode


SENTINELS = Sentinels()
for _part in OPTIONAL:  # each part a distinct object, so the test below sees which one it got
    setattr(SENTINELS, _part, type(f"{_part}_sentinel", (), {})())


@pytest.mark.parametrize("part", OPTIONAL)
def test_each_optional_part_a_duck_defines_is_the_one_resolve_hands_out(part):
    adapted = resolve("tests.unit.test_duck_parts:SENTINELS")
    assert isinstance(adapted, Implementation)
    assert getattr(adapted, part) is getattr(SENTINELS, part)


# --- through the oracle -------------------------------------------------------------------------------------


class OwnTower(VisionModel):
    """The duck's own model class (the toy tower's, as a tower of its own would be): the default model is not one."""

    under_test = False


class OwnInputs:
    """The duck's own encoder input: vdpcp's microbatch is not one."""

    def __init__(self, batch):
        self.batch = batch


class Full:
    """Its own build_model, subject_model, inputs and plan, each needed to pass (a class: resolve builds it)."""

    name = "full-duck"

    def build_model(self, case, dtype, device):
        return OwnTower(TowerConfig(patch_dim=case.spec.patch_dim, seed=case.spec.seed)).to(device=device, dtype=dtype)

    def subject_model(self, reference, case, dtype, device):
        model = self.build_model(case, dtype, device)
        model.load_state_dict(reference.state_dict())
        model.under_test = True
        return model

    def inputs(self, batch):
        return OwnInputs(batch)

    def encode(self, model, inputs):
        if not isinstance(model, OwnTower) or not isinstance(inputs, OwnInputs):
            raise TypeError(f"full-duck got {type(model).__name__} and {type(inputs).__name__}, not its own")
        return sharded.encode_unsharded(model, inputs.batch)

    def encode_sharded(self, model, inputs, config, group):
        if not isinstance(model, OwnTower) or not model.under_test or not isinstance(inputs, OwnInputs):
            raise TypeError(f"full-duck's sharded encode got a {type(model).__name__} that is not its model under test")
        return sharded.encode_sharded(model, inputs.batch, config, group)

    def plan(self, spec, config):
        return sharded.ownership(sharded.plan_for(spec, config)) if config.shard_vision else None


class WrongPlan(Full):
    """Encodes as Full does but states a plan with the first image on another rank: it must fail."""

    name = "wrong-plan-duck"

    def plan(self, spec, config):
        right = super().plan(spec, config)
        if right is None:
            return None
        owner = ((right.owner[0] + 1) % config.context_parallel_size,) + right.owner[1:]
        return Ownership(owner, right.tokens, right.placeholders)


LIMIT = KnownLimit("duck-gather", "the duck's gather cannot run yet", "the duck's gather is not written yet")


class Limited(Full):
    name = "limited-duck"

    def encode_sharded(self, model, inputs, config, group):
        raise NotImplementedError(LIMIT.signature)  # on every rank, before any collective

    def known_limit(self, case, backend):
        return LIMIT


class Extras(Full):
    name = "extras-duck"
    splits = ("count", "halves")
    tensor_parallel = (2,)
    preload = ("tests.unit.test_duck_parts",)


def _case(duck: str, **fields):
    return Case(SPEC, 2, f"tests.unit.test_duck_parts:{duck}", **fields)


@pytest.mark.distributed
def test_a_duck_with_its_own_model_model_under_test_inputs_and_plan_passes():
    result = run_case(_case("Full"))
    assert result.verdict == "pass", result.summary()
    assert [r.images for r in result.ranks] == [1, 2]  # its plan: the count split's, as stated


@pytest.mark.distributed
def test_a_duck_whose_stated_plan_is_not_what_ran_is_a_plan_mismatch():
    result = run_case(_case("WrongPlan"))
    assert result.verdict == "plan-mismatch", result.summary()
    assert any("row 0 encoded on rank 0, the plan says rank 1" in failure for failure in result.failures), result.summary()


@pytest.mark.distributed
def test_a_ducks_known_limit_turns_its_declared_failure_into_an_xfail():
    judged = run_judged(_case("Limited"))
    assert (judged.verdict, judged.why.split(":")[0]) == ("xfail", "duck-gather"), judged.result.summary()


def test_the_matrix_runs_a_ducks_tp_sizes():
    cases = scenarios.matrix(impls=("tests.unit.test_duck_parts:Extras",))
    assert {c.tp for c in cases} == {1, 2}
    assert {c.tp for c in scenarios.matrix(impls=("tests.unit.test_duck_parts:Full",))} == {1}


def test_the_matrix_runs_a_ducks_own_split_names():
    cases = scenarios.matrix(impls=("tests.unit.test_duck_parts:Extras",), splits=Extras.splits)
    assert {c.split for c in cases} == {"count", "halves"}


def test_rank_workers_preload_a_ducks_modules():
    with harness_config.configured(preload=()):  # nothing configured yet, as in a fresh `vdpcp check`
        preload_case_modules(("tests.unit.test_duck_parts:Extras",))
        assert "tests.unit.test_duck_parts" in harness_config.default_preload()


class NeedsArguments:
    name = "needs-arguments"

    def __init__(self, size):
        self.size = size

    def encode(self, model, inputs):
        return None

    encode_sharded = encode


def test_a_duck_class_is_built_and_one_that_needs_arguments_is_one_clear_error():
    full = resolve("tests.unit.test_duck_parts:Full")
    assert full.name == "full-duck" and isinstance(full.build_model.__self__, Full)  # bound: an instance
    with pytest.raises(ImplError, match=r"class NeedsArguments cannot be built with no arguments"):
        resolve("tests.unit.test_duck_parts:NeedsArguments")
