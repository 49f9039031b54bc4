"""A rank's models: built once per key, reused by the cases after, given back as they were built, dropped with
a failure naming what changed when a case changed their weights or their tensors, and kept while those beyond the
newest hold at most 2 GiB, the oldest dropped first (vdpcp.oracle.model_cache)."""

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.impls import resolve
from vdpcp.matrix.case import Case
from vdpcp.matrix.runner import run_judged
from vdpcp.matrix.scenarios import SCENARIOS
from vdpcp.oracle import model_cache

SPEC = next(s.spec for s in SCENARIOS if s.spec.name == "three-images")


class Keyed:
    """An implementation whose models are keyed by the case's seed, counting its builds; each its own target name
    (not its id(), which a later instance may reuse once this one is gone, and find this one's models cached)."""

    made = itertools.count()

    def __init__(self, key=True):
        self.builds, self.keyed, self.target = 0, key, f"test:keyed-{next(Keyed.made)}"

    def model_key(self, case):
        return ("keyed", case.spec.seed) if self.keyed else None

    def build_model(self, case, dtype, device):
        self.builds += 1
        return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.1)).to(device=device, dtype=dtype)


def _borrow(impl, seed=1):
    case = Case(SPEC.__class__(images=SPEC.images, seed=seed), 1)
    return model_cache.acquire(impl, impl.target, case, torch.float64, torch.device("cpu"))


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
    rebuilt, how = _borrow(impl, seed=3)
    assert how == "built"
    model_cache.release(rebuilt)


def test_the_shipped_subjects_say_what_their_build_reads():
    case = Case(SPEC, 2)
    assert resolve("reference").model_key(case) == resolve("mcore").model_key(case)  # the same toy tower
    assert resolve("reference").model_key(case.with_(tower="real")) != resolve("reference").model_key(case)
    assert resolve("qwen2_5_vl").model_key(case.with_(tower="real")) == ("real", SPEC.patch_dim, 0)  # every spec alike


def test_modes_are_given_back_per_module_as_built_in_a_model_mixed_in_modes():
    """A tower built with a frozen part in eval (a dropout, a norm's statistics): a case that set every module to
    train (or to eval) gets each module back as built, not all of them as the root was."""
    impl = Keyed()
    impl.build_model = lambda case, dtype, device: torch.nn.Sequential(
        torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Dropout(0.2)).eval()).double()
    built = {"": True, "0": True, "1": False, "1.0": False, "1.1": False}
    for case_sets in (True, False):
        model, _ = _borrow(impl, seed=8)
        model.train(case_sets)
        assert model_cache.release(model) is None
        assert {name: m.training for name, m in model.named_modules()} == built, case_sets


# What a build may read of its case, each changed alone from BASE (a video, so tubelets show), and the subjects
# whose build reads it. Every subject's key must change where its build does, and only there: a field left out of
# the key hands one case the model built for another (fixed only by the cache being cold, so by test order); one
# the build does not read costs a build per case. The real tower is too large to build here: its key is
# test_the_shipped_subjects_say_what_their_build_reads's.
BASE = MicrobatchSpec(images=((16, 16), (16, 16), (8, 24), (8, 24)), num_frames=(2, 2), temporal_patch_size=1, seed=1)
TOY = ("reference", "mcore")
CHANGES = {
    "seed": (lambda case: case.with_(spec=replace(BASE, seed=2)), TOY + ("qwen2_5_vl", "automodel", "automodel-shipped")),
    "patch_dim": (lambda case: case.with_(spec=replace(BASE, patch_dim=8)),
                  TOY + ("qwen2_5_vl", "automodel", "automodel-shipped")),
    "images": (lambda case: case.with_(spec=replace(BASE, images=((32, 32), (32, 32), (8, 24), (8, 24)))), TOY),
    "temporal_patch_size": (lambda case: case.with_(spec=replace(BASE, temporal_patch_size=2)), TOY),
    "even_pad": (lambda case: case.with_(even_pad=False), TOY),
    "dtype": (lambda case: case.with_(dtype="float32"), TOY + ("qwen2_5_vl", "automodel", "automodel-shipped")),
    "cp": (lambda case: case.with_(cp=4), ()),
    "split": (lambda case: case.with_(split="balanced"), ()),
}
SUBJECTS = ("reference", "mcore", "qwen2_5_vl", "automodel", "automodel-shipped")
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@pytest.fixture
def cold_cache(monkeypatch):
    """A rank's cache holding nothing, whatever the tests before left in it, and nothing left in it after."""
    monkeypatch.setattr(model_cache, "_cache", model_cache.OrderedDict())
    monkeypatch.setattr(model_cache, "_borrowed", {})


def _made(model) -> tuple:
    """What a build made: every tensor's name, shape, dtype and bits, and the model's config (a flag like the toy
    tower's even-grid padding changes no weight)."""
    state = model_cache._state(model)
    return ([(n, tuple(t.shape), t.dtype) for n, t in state.items()], model_cache.fingerprint(model).tolist(),
            repr(getattr(model, "config", None)))


def _acquired(impl, subject, case):
    return model_cache.acquire(impl, subject, case, DTYPES[case.dtype], torch.device("cpu"))


@pytest.mark.parametrize("field", list(CHANGES))
@pytest.mark.parametrize("subject", SUBJECTS)
def test_a_case_gets_the_model_its_own_build_makes_whatever_field_changed(cold_cache, subject, field):
    impl, (change, read_by) = resolve(subject), CHANGES[field]
    base = Case(BASE, 2, subject)
    case = change(base)
    first, _ = _acquired(impl, subject, base)
    before = _made(first)
    model_cache.release(first)
    got, how = _acquired(impl, subject, case)
    try:
        own = _made(impl.build_model(case, DTYPES[case.dtype], torch.device("cpu")))
        assert (own != before) == (subject in read_by), f"{subject}'s build reads the {field}: expected {subject in read_by}"
        assert _made(got) == own, f"{subject}: the {field} changed, and the cache handed back the other case's model"
        assert how == ("built" if subject in read_by else "reused"), (subject, field, how)
    finally:
        model_cache.release(got)


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


def test_a_change_whose_bit_deltas_cancel_in_a_sum_still_changes_the_fingerprint():
    """The fingerprint once summed the bit patterns: +1e-12 on this bias moves them by +72058, -36029 and -36029
    units in the last place, which left the sum as it was (test_a_case_that_changed_the_weights_is_told_so failed
    for 27 of 3000 seeds). The same shape at any size: +2, -1, -1 units."""
    layer = torch.nn.Linear(3, 3).double()
    with torch.no_grad():
        layer.bias.copy_(torch.tensor([0.1217464879155159, -0.1550305038690567, -0.15264900028705597]))
        before = model_cache.fingerprint(layer)
        layer.bias.add_(1e-12)
        assert not torch.equal(model_cache.fingerprint(layer), before)
        bits = layer.weight.view(torch.int64).reshape(-1)
        before = model_cache.fingerprint(layer)
        bits[:3] += torch.tensor([2, -1, -1], dtype=torch.int64)
        assert not torch.equal(model_cache.fingerprint(layer), before)


def test_the_fingerprint_reads_every_chunk_of_a_tensor_larger_than_one(monkeypatch):
    """A change past the first chunk, in a tensor of several, is seen (a hash of the first chunk alone would not)."""
    monkeypatch.setitem(model_cache._HASH_CHUNK, "cpu", 4)
    layer = torch.nn.Linear(5, 3).double()
    before = model_cache.fingerprint(layer)
    with torch.no_grad():
        layer.weight.view(-1)[13] += 1e-9
    assert not torch.equal(model_cache.fingerprint(layer), before)


_M64 = (1 << 64) - 1


def _splitmix64_finalizer(z: int) -> int:
    """splitmix64's finalizer on unsigned 64-bit ints, as its definition states it (Steele, Lea and Flood, 2014)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _odd(i: int) -> int:
    return _splitmix64_finalizer((i * 0x9E3779B97F4A7C15) & _M64) | 1


@pytest.mark.parametrize("step", [3, 1 << 16])
def test_the_fingerprint_is_the_sum_of_bits_times_odd_weights_by_position_as_documented(monkeypatch, step):
    """Against a pure-Python statement of it, over three spans of four positions and chunks that straddle them
    (3 a step): each element's bits (sign-extended) times its position's weight, splitmix64 of the position times
    the golden-ratio constant with its lowest bit set, and past the first span times its span's own such factor,
    summed modulo 2^64."""
    monkeypatch.setitem(model_cache._HASH_CHUNK, "cpu", step)
    monkeypatch.setattr(model_cache, "_SPAN", 4)

    def stated(bits: list[int]) -> int:
        def weight(i: int) -> int:
            span = i // 4
            return _odd(i % 4) * (_odd(model_cache._SPAN_SALT + span) if span else 1)

        return sum(b * weight(i) for i, b in enumerate(bits)) & _M64

    values = torch.tensor([0.0, -0.0, 1.5, -2.25, 3e-300, -7.0, 0.1, 2.0, -1e10], dtype=torch.float64)
    assert model_cache._bits(values).item() & _M64 == stated(values.view(torch.int64).tolist())
    halves = torch.tensor([-1.0, 2.0, -0.5], dtype=torch.bfloat16)  # 16-bit patterns, negative ones sign-extended
    assert model_cache._bits(halves).item() & _M64 == stated(halves.view(torch.int16).tolist())
    singles = torch.tensor([0.5, -3.0, 1e-30, 7.0, -0.25, 9.5], dtype=torch.float32)  # two spans exactly
    assert model_cache._bits(singles).item() & _M64 == stated(singles.view(torch.int32).tolist())


@pytest.mark.parametrize("table, span", [("_tables", None), ("_factor_tables", 1)])
def test_a_table_grows_for_a_longer_tensor_and_keeps_each_entry(monkeypatch, table, span):
    """The positions' weights (and, one position a span, the spans' factors: past the 64 drawn at first) are drawn
    for the longest tensor seen so far: a longer one later grows the table, and every figure is the one a table
    drawn for the longer tensor at once gives."""
    if span is not None:
        monkeypatch.setattr(model_cache, "_SPAN", span)
    short, long = torch.randn(10, dtype=torch.float64), torch.randn(3000, dtype=torch.float64)
    monkeypatch.setattr(model_cache, table, {})
    grown = [model_cache._bits(short).item(), model_cache._bits(long).item()]
    monkeypatch.setattr(model_cache, table, {})
    at_once = [model_cache._bits(long).item(), model_cache._bits(short).item()][::-1]
    assert grown == at_once
    assert getattr(model_cache, table)[torch.device("cpu")].numel() >= 3000


def test_two_elements_a_span_apart_swapped_change_the_fingerprint(monkeypatch):
    """Each span reuses the first span's weights: its own factor keeps a swap of rows a span apart from cancelling."""
    monkeypatch.setattr(model_cache, "_SPAN", 4)
    layer = torch.nn.Linear(4, 3).double()
    before = model_cache.fingerprint(layer)
    with torch.no_grad():
        layer.weight[[0, 1]] = layer.weight[[1, 0]]
    assert not torch.equal(model_cache.fingerprint(layer), before)


def test_every_devices_hash_step_is_a_positive_count_and_a_gpus_the_larger():
    """A step of 0 would make range() raise on the GPU alone (the CPU suite never reads the GPU's); a GPU takes
    the larger steps, each a few kernel launches."""
    steps = model_cache._HASH_CHUNK
    assert all(isinstance(n, int) and n >= 1 for n in steps.values()) and steps["cuda"] > steps["cpu"], steps


class _Mixed(torch.nn.Module):
    """Tensors of every width (bf16, float32, float64, complex64), an empty one, and one larger than a hash step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        for i, (n, dtype) in enumerate([(3, torch.float64), (2, torch.bfloat16), (4, torch.float64), (0, torch.float32),
                                        (5, torch.float32), (11, torch.float64), (2, torch.complex64),
                                        (1, torch.bfloat16), (3, torch.float64)]):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(n).to(dtype), requires_grad=False))


@pytest.mark.parametrize("step", [8, 1 << 16])
def test_the_fingerprint_hashes_small_tensors_together_as_each_alone(monkeypatch, step):
    """Runs of small tensors are hashed in one pass: each tensor's figure is still its own _bits, whatever the runs
    (8 elements a step: several runs, and the 11-element tensor alone in two chunks)."""
    monkeypatch.setitem(model_cache._HASH_CHUNK, "cpu", step)
    model = _Mixed()
    tensors = list(model_cache._state(model).values())
    assert model_cache.fingerprint(model).tolist() == [model_cache._bits(t).item() for t in tensors]


def test_a_run_hashed_together_is_one_device_and_at_most_a_step_a_larger_tensor_alone_in_chunks(monkeypatch):
    monkeypatch.setitem(model_cache._HASH_CHUNK, "cpu", 8)
    hashed = []
    weigh = model_cache._weigh
    monkeypatch.setattr(model_cache, "_weigh", lambda bits, weights: hashed.append(bits.numel()) or weigh(bits, weights))
    tensors = list(model_cache._state(_Mixed()).values())
    runs = model_cache._batches(tensors)
    assert sorted(i for run in runs for i in run) == list(range(len(tensors)))
    # elements hashed 3, 2 | 4, 0 | 11 alone | 5 | 4 (a complex one's two parts), 1, 3: a run that fills its step
    assert runs == [[0, 1], [2, 3], [5], [4], [6, 7, 8]], runs
    model_cache.fingerprint(_Mixed())
    assert max(hashed) <= 8, hashed  # the 11-element tensor in chunks, never whole


def test_a_module_without_tensors_has_an_empty_fingerprint():
    assert model_cache.fingerprint(torch.nn.Module()).shape == (0,)
