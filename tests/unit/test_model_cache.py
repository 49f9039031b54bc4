"""A rank's models: built once per key, reused by the cases after, given back as they were built, dropped with
a failure naming what changed when a case changed their weights or their tensors, and kept while those beyond the
newest hold at most 2 GiB, the oldest dropped first (vdpcp.model_cache)."""

from types import SimpleNamespace

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


GiB = 1 << 30


@pytest.fixture
def empty_cache(monkeypatch):
    """A rank's cache with nothing in it, and the times it gave CUDA's cached memory back."""
    monkeypatch.setattr(model_cache, "_cache", model_cache.OrderedDict())
    given_back = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: given_back.append(1))
    return given_back


def _held_after(*sizes, cuda=()):
    """The models left after models of ``sizes`` bytes (as the cache counts them; those at the indices in ``cuda``
    on a GPU) were put in the cache one after another, each the newest then."""
    for i, size in enumerate(sizes):
        model = SimpleNamespace(parameters=lambda on_gpu=i in cuda: [SimpleNamespace(is_cuda=on_gpu)])
        model_cache._cache[i] = model_cache.Entry(model, torch.zeros(0), {}, {}, size)
        model_cache._evict()
    return list(model_cache._cache)


@pytest.mark.parametrize("sizes, left", [
    ((GiB, GiB, 5 * GiB), [0, 1, 2]),  # 2 GiB beyond the newest: not over
    ((GiB, GiB + 1, 5 * GiB), [1, 2]),  # 2 GiB + 1: the oldest goes, and that is enough
    ((3 * GiB, 1), [1]),
    ((GiB, 3 * GiB, GiB, 1), [2, 3]),  # oldest first, until what is left is not over
    ((100 * GiB,), [0]),  # the newest stays however large
])
def test_models_beyond_the_newest_stay_up_to_two_gib_and_the_oldest_go_first(empty_cache, sizes, left):
    assert _held_after(*sizes) == left
    assert empty_cache == []  # none of them was on a GPU


def test_dropping_models_on_a_gpu_gives_their_cached_memory_back_once(empty_cache):
    assert _held_after(GiB, GiB, 5 * GiB, 1, cuda=(0, 1)) == [3]  # the last one drops all three at once
    assert empty_cache == [1]


def test_a_models_size_is_its_parameters_and_buffers_bytes():
    model = torch.nn.BatchNorm1d(3).double()  # weight, bias, running mean and var in float64; a count in int64
    assert model_cache._entry(model).bytes == 4 * 3 * 8 + 8


class Buffers(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.register_buffer("values", torch.tensor([1, 3], dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_a_change_that_keeps_the_sum_of_the_values_is_still_a_change(dtype):
    impl = Keyed()
    impl.build_model = lambda case, dtype_, device: Buffers(dtype)
    model, _ = _borrow(impl, seed=4)
    model.values.copy_(torch.tensor([2, 2], dtype=dtype) if dtype.is_floating_point else torch.tensor([-1, 5], dtype=dtype))
    said = model_cache.release(model)
    assert said is not None and "e.g. values" in said, (dtype, said)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_change_to_a_complex_weights_imaginary_part_alone_is_a_change(dtype):
    impl = Keyed()
    impl.build_model = lambda case, dtype_, device: Buffers(dtype)
    model, _ = _borrow(impl, seed=6)
    model.values.copy_(torch.tensor([1 + 1j, 3], dtype=dtype))
    said = model_cache.release(model)
    assert said is not None and "e.g. values" in said, (dtype, said)


def test_a_failure_names_three_of_the_weights_that_changed():
    impl = Keyed()
    impl.build_model = lambda case, dtype, device: torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(3))).double()
    model, _ = _borrow(impl, seed=5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    said = model_cache.release(model)
    assert said.startswith("weights: the case changed the model's weights (6 of 6 parameters and buffers, e.g. 0.weight, "
                           "0.bias, 1.weight); "), said


def test_a_model_without_state_is_reused_and_one_that_gains_state_is_told_so():
    impl = Keyed()
    impl.build_model = lambda case, dtype, device: torch.nn.ReLU()
    model, _ = _borrow(impl, seed=6)
    assert model_cache.release(model) is None
    again, how = _borrow(impl, seed=6)
    assert how == "reused" and again is model
    model.register_buffer("gained", torch.zeros(2))  # all-zero bits: only the count of tensors tells
    said = model_cache.release(model)
    assert said is not None and "e.g. gained" in said, said


def test_a_model_that_gains_a_buffer_is_told_so_naming_its_tensors():
    impl = Keyed()
    model, _ = _borrow(impl, seed=7)
    model.register_buffer("gained", torch.ones(1, dtype=torch.float64))
    said = model_cache.release(model)
    assert said is not None and "e.g. 0.weight, 0.bias, gained" in said, said
