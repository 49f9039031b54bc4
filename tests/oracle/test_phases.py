"""How a rank's case is paced, timed and sized (vdpcp.oracle): ranks sharing a GPU take turns for the unsharded arm
only where all of them at once would not fit (a GPU-only decision, taken here with the GPU's figures stood in for),
each phase's seconds are kept to a tenth of a millisecond, and the bytes a rank held are reported per part."""

from types import SimpleNamespace

import pytest
import torch

from vdpcp import oracle
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix.case import Case, RankResult
from vdpcp.oracle import arms
from vdpcp.oracle.observe import telemetry

CASE = Case(MicrobatchSpec(images=((8, 8),) * 3, name="three"), 2)
GPU = 10 * 2**30


@pytest.fixture
def shared_gpu(monkeypatch):
    """A GPU of GPU bytes that every rank of the case shares, and a case whose ranks together need ``need`` bytes."""
    need = {"bytes": 0}  # two ranks: one at a time is the only turn there is, so no other estimate is asked for
    monkeypatch.setattr(arms.budget, "need", lambda case, device: SimpleNamespace(
        colocated=lambda turns: need["bytes"] if turns is False else pytest.fail("asked for the estimate with turns")))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=GPU))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(arms, "turn", lambda device, slot: ("turn", device, slot))
    return need


@pytest.mark.parametrize("share, turns", [(0.5, False), (0.8, False), (0.81, True), (1.5, True)])
def test_ranks_sharing_a_gpu_take_turns_only_when_all_at_once_needs_over_four_fifths_of_it(shared_gpu, share, turns):
    shared_gpu["bytes"] = share * GPU
    result = RankResult(0)
    pacing = arms._turns(SimpleNamespace(shares_device=True, device="cuda:0", rank=1), CASE, result)
    assert result.turns is turns
    assert (pacing == ("turn", "cuda:0", 0)) is turns, pacing


@pytest.mark.parametrize("fits, slots", [(1, [0] * 8), (2, [0, 1] * 4), (3, [0, 1, 2, 0, 1, 2, 0, 1]), (7, [0, 1, 2, 3, 4, 5, 6, 0])])
def test_ranks_sharing_a_gpu_take_their_turns_as_many_at_once_as_fit_each_in_its_slot(shared_gpu, monkeypatch, fits, slots):
    """Eight ranks (CP 4 x DP 2 on one H200 in bf16: the real towers fit seven at once, not eight), each resident
    with a tenth of the GPU's four fifths and a turn of a twentieth: as many turns at once as fit."""
    case = CASE.with_(cp=4, dp=2)
    monkeypatch.setattr(arms.budget, "need", lambda case, device: SimpleNamespace(
        colocated=lambda turns: GPU if turns is False else 8 * 0.04 * GPU + turns * 0.47 / fits * GPU))
    got = []
    for rank in range(8):
        result = RankResult(rank)
        got.append(arms._turns(SimpleNamespace(shares_device=True, device="cuda:0", rank=rank), case, result))
        assert result.turns
    assert got == [("turn", "cuda:0", slot) for slot in slots]




def test_each_phase_is_timed_from_the_last_to_a_tenth_of_a_millisecond(monkeypatch):
    ticks = iter([100.0, 101.23456, 101.5])
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(ticks))
    result = RankResult(0)
    clock = oracle.Clock(result)
    clock.lap("build")
    clock.lap("unsharded")
    assert result.seconds == {"build": pytest.approx(1.2346, abs=1e-9), "unsharded": pytest.approx(0.2654, abs=1e-9)}


@pytest.mark.parametrize("device, waits", [(torch.device("cuda:1"), True), (torch.device("cpu"), False), (None, False)])
def test_on_cuda_each_lap_waits_for_the_device_before_it_reads_the_time(monkeypatch, device, waits):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: events.append(("sync", d)))
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: events.append("time") or float(len(events)))
    clock = oracle.Clock(RankResult(0), device)
    clock.lap("unsharded")
    assert events == ([("sync", device), "time"] * 2 if waits else ["time"] * 2)


def test_a_rank_reports_the_bytes_it_held_and_none_for_an_arm_that_never_ran():
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2)).double()
    held = 14 * 8 + 4 * 8 + 8  # 14 parameters; running mean and variance (float64), the batch count (int64)
    grads = [torch.zeros(2, 4, dtype=torch.float64), None]
    memory = oracle.Memory(torch.device("cpu"))
    assert memory.figures(model, SimpleNamespace(grads=grads, own_grads=None)) == {
        "model": held, "unsharded grads": 64, "rank-alone grads": 0}
    assert memory.figures(model, SimpleNamespace(grads=grads, own_grads=grads)) == {
        "model": held, "unsharded grads": 64, "rank-alone grads": 64}
    assert memory.figures(model, None) == {"model": held}  # the unsharded encoder raised


@pytest.mark.parametrize("ctx, gives_back", [(SimpleNamespace(device="cuda:0"), False),  # a context that does not say
                                             (SimpleNamespace(device="cuda:0", shares_device=False), False),
                                             (SimpleNamespace(device="cuda:0", shares_device=True, rank=0), True)])
def test_only_a_rank_sharing_its_gpu_gives_its_cached_memory_back_and_waits_its_turn(shared_gpu, monkeypatch, ctx,
                                                                                     gives_back):
    given = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: given.append(1))
    arms._give_back(ctx)
    assert given == ([1] if gives_back else [])
    shared_gpu["bytes"] = 100 * GPU
    result = RankResult(0)
    arms._turns(ctx, CASE, result)
    assert result.turns is gives_back
