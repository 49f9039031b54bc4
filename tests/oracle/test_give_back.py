"""A rank sharing its GPU hands the memory its turn cached back to the GPU BEFORE it lets the turn go
(vdpcp.oracle, vdpcp.harness.turns): the next rank's turn starts while this rank's peak would otherwise still be
reserved in its process, and turns would no longer bound what the shared GPU holds.

A GPU-only path, run here on the CPU in one process as a CP group of one: the GPU's figures, the allocator's
``empty_cache`` and the case's estimate are stand-ins (monkeypatched, so nothing leaks out of the test); the turn is
the real one, a lock file (in the test's own folder), and each hand-back looks whether that lock is held then."""

import fcntl
import tempfile
from types import SimpleNamespace

import torch

from vdpcp import oracle
from vdpcp.impls.reference import Reference
from vdpcp.matrix.case import Case
from vdpcp.matrix.scenarios import SCENARIOS
from vdpcp.oracle import arms

SPEC = next(s.spec for s in SCENARIOS if s.spec.name == "three-images")
GPU = 10 * 2**30


class Uncached(Reference):
    """The reference, built afresh for its case: no model stays cached in the test process."""

    name = "uncached-reference"

    def model_key(self, case):
        return None


def _held(path) -> bool:
    """Whether some open file holds ``path``'s lock (flock: another open file of this process conflicts too)."""
    with open(path, "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(probe, fcntl.LOCK_UN)
        return False


def test_a_rank_sharing_its_gpu_hands_its_cached_memory_back_inside_its_turn(monkeypatch, tmp_path, one_rank_sums):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the turn's lock file, away from other runs' turns
    cpu = torch.device("cpu")
    lock = tmp_path / f"vdpcp-{cpu.type}0.turn"
    handed_back = []  # per empty_cache call: whether the turn was held then
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: handed_back.append(_held(lock)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=GPU))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(arms.budget, "need", lambda case, device: SimpleNamespace(colocated=lambda turns: 2 * GPU))
    ctx = SimpleNamespace(rank=0, backend="gloo", device=cpu, shares_device=True)
    groups = SimpleNamespace(cp_rank=0, dp_rank=0, tp_rank=0, cp=None)
    result = oracle.check(ctx, Case(SPEC, 1, "uncached-reference", grads=False), Uncached(), groups)
    assert result.turns and result.failures == [], result
    assert lock.exists() and not _held(lock)  # the turn was taken, and let go
    assert handed_back and handed_back[0] is True, handed_back  # first inside the turn, before the next rank's
