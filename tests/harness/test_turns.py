"""Turns on a shared GPU (vdpcp.harness.turns): ranks in the same slot go one after another, ranks in different
slots at once. Locks on files, so taken here from threads with their own open files, as ranks' processes take them."""

import threading

import torch

from vdpcp.harness import turns


def _taken_while_held(tmp_path, monkeypatch, held_slot: int, other_slot: int, wait: float) -> bool:
    """Whether a second turn in ``other_slot`` is taken while a first holds ``held_slot`` (within ``wait`` seconds:
    the first lets go only after it)."""
    monkeypatch.setattr(turns.tempfile, "gettempdir", lambda: str(tmp_path))
    device, holding, taken = torch.device("cuda", 3), threading.Event(), threading.Event()
    release = threading.Event()

    def first():
        with turns.turn(device, held_slot):
            holding.set()
            release.wait(60)  # held until the test has seen whether the second got in

    def second():
        with turns.turn(device, other_slot):
            taken.set()

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert holding.wait(5)
    threads.append(threading.Thread(target=second))
    threads[1].start()
    got = taken.wait(wait)
    release.set()
    for t in threads:
        t.join(5)
    assert taken.is_set()  # the second always gets its turn once the first lets go
    return got


def test_a_turn_in_the_same_slot_waits_for_the_one_before(tmp_path, monkeypatch):
    assert not _taken_while_held(tmp_path, monkeypatch, 2, 2, wait=0.2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vdpcp-cuda3-2.turn"]


def test_turns_in_different_slots_run_at_once(tmp_path, monkeypatch):
    assert _taken_while_held(tmp_path, monkeypatch, 0, 1, wait=10)  # at once, however loaded the machine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vdpcp-cuda3-1.turn", "vdpcp-cuda3.turn"]
