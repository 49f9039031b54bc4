"""A rank's models: built once per key, reused by the cases after, given back as they were built, and dropped with
a failure naming what changed when a case changed their weights (vdpcp.model_cache)."""

import pytest
import torch

from vdpcp import model_cache
from vdpcp.case import Case
from vdpcp.impls import resolve
from vdpcp.runner import run_judged
from vdpcp.scenarios import SCENARIOS

SPEC = next(s.spec for s in SCENARIOS if s.spec.name == "three-images")


class Keyed:
    """An implementation whose models are keyed by the case's seed, counting its builds."""

    def __init__(self, key=True):
        self.builds, self.keyed = 0, key

    def model_key(self, case):
        return ("keyed", case.spec.seed) if self.keyed else None

    def build_model(self, case, dtype, device):
        self.builds += 1
        return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.1)).to(device=device, dtype=dtype)


def _borrow(impl, seed=1):
    case = Case(SPEC.__class__(images=SPEC.images, seed=seed), 1)
    return model_cache.acquire(impl, f"test:{id(impl)}", case, torch.float64, torch.device("cpu"))


def test_a_model_is_built_once_per_key_and_reused_after():
    impl = Keyed()
    model, how = _borrow(impl)
    assert how == "built" and model_cache.release(model) is None
    again, how = _borrow(impl)
    assert how == "reused" and again is model and impl.builds == 1
    model_cache.release(again)
    _, how = _borrow(impl, seed=2)
    assert how == "built" and impl.builds == 2


def test_without_a_key_every_case_builds_its_own():
    impl = Keyed(key=False)
    first, _ = _borrow(impl)
    model_cache.release(first)
    second, how = _borrow(impl)
    assert how == "built" and second is not first


def test_given_back_with_no_gradients_and_its_flags_and_modes_as_built():
    model, _ = _borrow(Keyed())
    model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    model[0].weight.requires_grad_(False)
    model.eval()
    assert model_cache.release(model) is None
    assert all(p.grad is None and p.requires_grad for p in model.parameters()) and model.training and model[1].training


def test_a_case_that_changed_the_weights_is_told_so_and_the_model_is_dropped():
    impl = Keyed()
    model, _ = _borrow(impl, seed=3)
    with torch.no_grad():
        model[0].bias.add_(1e-12)
    said = model_cache.release(model)
    assert said.startswith("weights: the case changed the model's weights (1 of 2 parameters and buffers, e.g. 0.bias)"), said
    _, how = _borrow(impl, seed=3)
    assert how == "built"


def test_the_shipped_subjects_say_what_their_build_reads():
    case = Case(SPEC, 2)
    assert resolve("reference").model_key(case) == resolve("mcore").model_key(case)  # the same toy tower
    assert resolve("reference").model_key(case.with_(tower="real")) != resolve("reference").model_key(case)
    assert resolve("qwen2_5_vl").model_key(case.with_(tower="real")) == ("real", SPEC.patch_dim, 0)  # every spec alike


@pytest.mark.distributed
def test_a_rank_reuses_its_model_in_the_next_case_and_a_case_that_changes_it_fails():
    case = Case(SPEC, 2)
    run_judged(case, backend="gloo")
    again = run_judged(case, backend="gloo")
    assert again.verdict == "pass" and {r.model for r in again.result.ranks} == {"reused"}, again.result.summary()
    changed = run_judged(case.with_(impl="tests.oracle.subjects:changes_its_weights"), backend="gloo")
    assert changed.verdict == "fail", changed.result.summary()
    assert all(any(f.startswith("weights: the case changed the model's weights") for f in r.failures)
               for r in changed.result.ranks), changed.result.summary()
