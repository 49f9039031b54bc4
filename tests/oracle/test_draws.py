"""What a case draws beyond its spec's own pixels, pinned so that a saved case replays to the same numbers in any
version of vdpcp (a saved file holds shapes and a seed, never pixels or weights: docs/replay.md):

- DP replica d encodes the microbatch of seed s + 7919 d: replica 1 of seed 7 is the microbatch of seed 7926,
  whatever the version; the replica's spec (which the implementation is handed, as its batch's spec) wraps at
  2**64, the range a spec's seed takes, not before.
- CP rank r's loss weights for output k are fixed draws of (seed, r, k), as odd sixteenths, written out below, for the main features
  and for a second output, at a small seed and at the largest one; and two specs whose pixels differ draw
  different loss weights too (torch's CPU generator reads a seed's low 32 bits, so
  pixels differ exactly where the seeds' low 32 bits do).

Another draw would be as random, but every saved DP or multi-output case would then replay other pixels or
weights, and its report other figures, than the ones it was saved with.
"""

from dataclasses import replace

import pytest
import torch

from vdpcp import oracle
from vdpcp.feature import loss
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix.case import Case

SPEC = MicrobatchSpec(images=((16, 16), (8, 24), (24, 8)), seed=7, name="three")
CPU = torch.device("cpu")


def test_dp_replicas_encode_the_microbatches_of_the_same_seeds_in_every_version():
    case = Case(SPEC, 2, dp=3)
    assert [oracle.replica_spec(case, d).seed for d in range(3)] == [7, 7926, 15845]
    assert [oracle.replica_spec(Case(replace(SPEC, seed=0), 1, dp=2), d).seed for d in range(2)] == [0, 7919]


def test_a_replicas_seed_wraps_at_2_64_as_a_specs_seed_does():
    assert oracle.replica_spec(Case(replace(SPEC, seed=2**63), 2, dp=2), 1) == replace(SPEC, seed=2**63 + 7919)
    assert oracle.replica_spec(Case(replace(SPEC, seed=2**64 - 1), 2, dp=3), 2) == replace(SPEC, seed=2 * 7919 - 1)


def _weights(seed: int, rank: int, output: int, shape=(2, 3)) -> torch.Tensor:
    spec = replace(SPEC, seed=seed)
    return loss.loss_weights(Case(spec, 4), spec, rank, shape, torch.float64, CPU, output=output)


def _documented_draw(seed: int, rank: int, output: int, shape=(2, 3)) -> torch.Tensor:
    """The draw a saved case of ``seed`` made for CP rank ``rank``'s output ``output``: torch's CPU generator at
    seed 1_000_003 s + r + 104_729 k (mod 2**63), rounded down to a sixteenth-step in [-2, 2) and centred in it
    (odd sixteenths, so that their sums over ranks are exact: vdpcp.oracle.compare.regrouped). Written out here, not taken from
    vdpcp, so that a change of the draw fails; and drawn with this torch, not stored, so that it holds on every
    torch the suite supports."""
    gen = torch.Generator().manual_seed((1_000_003 * seed + rank + 104_729 * output) % 2**63)
    draw = torch.randn(shape, generator=gen, dtype=torch.float64)
    return (torch.floor(draw.clamp(-2, 2 - 1 / 16) * 8) * 2 + 1) / 16


@pytest.mark.parametrize("seed, rank, output", [(7, 0, 0), (7, 1, 1), (2**64 - 1, 3, 2)],
                         ids=["main-features", "second-output", "largest-seed"])
def test_loss_weights_are_the_same_draws_in_every_version(seed, rank, output):
    torch.testing.assert_close(_weights(seed, rank, output), _documented_draw(seed, rank, output), rtol=0, atol=0)


@pytest.mark.parametrize("apart", [2**30, 2**31, 2**32 - 1])
def test_specs_whose_pixels_differ_draw_different_loss_weights(apart):
    assert not torch.equal(replace(SPEC, seed=5).tensors().patches, replace(SPEC, seed=5 + apart).tensors().patches)
    assert not torch.equal(_weights(5, 0, 0), _weights(5 + apart, 0, 0))
