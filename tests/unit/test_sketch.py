"""vdpcp.oracle.compare.sketch: a count sketch is linear (so it commutes with the sum over ranks), estimates a squared 2-norm within
its stated standard deviation, keeps a difference in a few elements exactly, and hashes alike on every call."""

import math

import pytest
import torch

from vdpcp.oracle.compare import sketch


def _vectors(seed: int, sizes=(300, 7, 1200)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen, dtype=torch.float64) for n in sizes]


def _norm_sq(tensors) -> float:
    return sum(float(t.double().square().sum()) for t in tensors)


def test_the_sketch_of_a_sum_over_ranks_is_the_sum_of_the_ranks_sketches(monkeypatch):
    monkeypatch.setattr(sketch, "WIDTH", 64)
    ranks = [_vectors(seed) for seed in range(3)]
    each = [sketch.sketch(zip(grads, [None] * 3), "cpu")[0] for grads in ranks]
    summed = [sum(parts) for parts in zip(*ranks)]
    of_sum, _ = sketch.sketch(zip(summed, [None] * 3), "cpu")
    torch.testing.assert_close(of_sum, sum(each), rtol=0, atol=1e-12)
    assert of_sum.abs().sum() > 0


def test_got_and_want_are_hashed_alike_and_none_is_zeros(monkeypatch):
    monkeypatch.setattr(sketch, "WIDTH", 64)
    grads = _vectors(0)
    got, want = sketch.sketch(zip(grads, grads), "cpu")
    assert torch.equal(got, want)
    again, nothing = sketch.sketch(zip(grads, [None] * 3), "cpu")
    assert torch.equal(again, got) and not nothing.any()  # the same hash on every call


def test_a_parameter_hashes_by_its_place_so_moving_values_between_parameters_shows():
    a = torch.zeros(50, dtype=torch.float64)
    a[3] = 1.0
    first, _ = sketch.sketch(zip([a, torch.zeros(50)], [None, None]), "cpu")
    second, _ = sketch.sketch(zip([torch.zeros(50), a], [None, None]), "cpu")
    assert float((first - second).square().sum()) > 0


@pytest.mark.parametrize("width", [1024, 4096])
def test_the_squared_norm_estimate_is_unbiased_within_the_stated_deviation(monkeypatch, width):
    monkeypatch.setattr(sketch, "WIDTH", width)
    errors = []
    for seed in range(64):
        grads = _vectors(seed, sizes=(20_000, 3_000))
        monkeypatch.setattr(sketch, "SEED", seed * 1_000)  # another hash each draw
        got, _ = sketch.sketch(zip(grads, [None] * 2), "cpu")
        errors.append(float(got.square().sum()) / _norm_sq(grads) - 1)
    stated = math.sqrt(2 / width)
    spread = math.sqrt(sum(e * e for e in errors) / len(errors))
    # the bound is the deviation, not loose: 64 draws measure it within about 9% (half the buckets would be 1.41)
    assert 0.75 * stated < spread < 1.25 * stated, (spread, stated)
    assert abs(sum(errors) / len(errors)) < 3 * stated / math.sqrt(len(errors))  # unbiased
    assert max(abs(e) for e in errors) < 5 * stated


def test_a_constant_gradient_is_estimated_alike_the_signs_cancel_what_collides(monkeypatch):
    """A bias or a norm's gradient can be one value throughout: without random signs every collision would add."""
    monkeypatch.setattr(sketch, "WIDTH", 1024)
    flat = torch.full((20_000,), 0.5, dtype=torch.float64)
    got, _ = sketch.sketch(zip([flat], [None]), "cpu")
    assert float(got.square().sum()) / _norm_sq([flat]) == pytest.approx(1, abs=5 * math.sqrt(2 / 1024))


def test_a_difference_in_one_element_is_kept_exactly(monkeypatch):
    monkeypatch.setattr(sketch, "WIDTH", 256)
    want = _vectors(1)
    got = [t.clone() for t in want]
    got[2][777] += 0.25
    s_got, s_want = sketch.sketch(zip(got, want), "cpu")
    assert float((s_got - s_want).square().sum()) == pytest.approx(0.25**2, rel=1e-9)


def test_a_parameter_larger_than_a_chunk_is_hashed_chunk_by_chunk_and_estimated_alike(monkeypatch):
    monkeypatch.setattr(sketch, "WIDTH", 4096)
    monkeypatch.setattr(sketch, "CHUNK", 1000)
    grads = _vectors(2, sizes=(25_001,))
    got, _ = sketch.sketch(zip(grads, [None]), "cpu")
    assert float(got.square().sum()) / _norm_sq(grads) == pytest.approx(1, abs=5 * math.sqrt(2 / 4096))
    assert len({sketch.hash_seed(k, c) for k in range(3) for c in range(26)}) == 78
    last = torch.zeros(25_001, dtype=torch.float64)
    last[-1] = 3.0  # alone in a short last chunk: hashed once, like every other element
    got, _ = sketch.sketch(zip([last], [None]), "cpu")
    assert float(got.square().sum()) == 9.0


def test_the_shipped_width_and_chunk_keep_the_stated_accuracy_and_bytes():
    """What the module's docstring promises: 0.14% relative deviation of the squared norm, 8 MB sent a rank, and
    float64 temporaries of 32 MB a chunk."""
    assert math.sqrt(2 / sketch.WIDTH) <= 0.0014
    assert sketch.WIDTH * 8 <= 8 * 2**20 and sketch.CHUNK * 8 <= 32 * 2**20


def test_a_low_precision_gradient_sketches_in_float64():
    grad = torch.full((10,), 1 + 2**-7, dtype=torch.bfloat16)
    got, _ = sketch.sketch(zip([grad], [None]), "cpu")
    assert got.dtype == torch.float64
    assert sorted(got[got != 0].abs().tolist()) == [1 + 2**-7] * 10  # ten buckets of the 2**20: no collision here


def test_it_pays_only_for_more_elements_than_its_width():
    assert not sketch.pays(sketch.WIDTH) and sketch.pays(sketch.WIDTH + 1)


def test_at_the_shipped_chunk_every_chunk_of_every_parameter_hashes_on_its_own():
    """Parameters spanning several of the shipped chunks, as a real tower's largest do (Qwen2.5-VL-7B's merger: 26M
    elements, seven chunks): one 1 at the same offset of every chunk lands alone in its bucket, so the squared norm of
    the sketch is exactly their count. A chunk hashed as another (a seed from the wrong offset: parameter k's fifth
    chunk seeded as parameter k + 1's first) puts two of them in one bucket with one sign: 2 more, or 2 fewer."""
    chunk = sketch.CHUNK
    sizes = (4 * chunk + 3, 2 * chunk, 3)  # five chunks, the last short; two; one, short
    params, ones = [], 0
    for size in sizes:
        t = torch.zeros(size, dtype=torch.bfloat16)  # sketched in float64 a chunk at a time, 32 MB each
        t[2::chunk] = 1.0
        params.append(t)
        ones += len(range(2, size, chunk))
    got, _ = sketch.sketch(zip(params, [None] * len(params)), "cpu")
    assert ones == 8 and float(got.square().sum()) == ones
