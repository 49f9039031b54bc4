"""The oracle's inputs, pure: each DP replica's own microbatch, each CP rank's loss weights (deterministic, distinct
per rank, zero outside the rank's LM shard under zigzag), and which gathered rows are a rank's own. The merged loss
itself: tests/unit/test_loss.py."""

from dataclasses import replace

import pytest
import torch

from vdpcp import oracle
from vdpcp.contract.protocol import Ownership
from vdpcp.feature import loss as lm_loss
from vdpcp.feature.spec import MicrobatchSpec
from vdpcp.matrix.case import Case

SPEC = MicrobatchSpec(images=((16, 16), (8, 24), (24, 8)), seed=7, name="three")
SHAPE = (4 + 3 + 3, 48)  # tokens of the three images, lm_hidden


def test_each_dp_replica_encodes_its_own_pixels_of_the_same_shapes():
    case = Case(SPEC, 2, dp=4)
    specs = [oracle.replica_spec(case, d) for d in range(4)]
    assert specs[0] is SPEC
    assert [s.seed for s in specs] == [(7 + oracle.DP_SEED_STRIDE * d) % 2**64 for d in range(4)]
    assert len({s.seed for s in specs}) == 4 and all(replace(s, seed=7) == SPEC for s in specs)
    pixels = [s.tensors().patches for s in specs]
    assert all(not torch.equal(pixels[0], p) for p in pixels[1:])
    wrapped = Case(replace(SPEC, seed=2**64 - 1), 2, dp=2)  # seeds stay 64-bit
    assert oracle.replica_spec(wrapped, 1).seed == (2**64 - 1 + oracle.DP_SEED_STRIDE) % 2**64


@pytest.mark.parametrize("loss", ["rank", "zigzag"])
def test_loss_weights_are_deterministic_distinct_per_rank_and_in_the_cases_dtype(loss):
    case = Case(SPEC, 4, loss=loss)
    weights = [lm_loss.loss_weights(case, SPEC, r, SHAPE, torch.float32, torch.device("cpu")) for r in range(4)]
    again = lm_loss.loss_weights(case, SPEC, 2, SHAPE, torch.float32, torch.device("cpu"))
    assert torch.equal(weights[2], again) and weights[2].dtype == torch.float32 and weights[2].shape == SHAPE
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(weights[a], weights[b])
    other_seed = lm_loss.loss_weights(case, replace(SPEC, seed=8), 2, SHAPE, torch.float32, torch.device("cpu"))
    assert not torch.equal(other_seed, weights[2])
    held = torch.stack([(w != 0).all(dim=1) for w in weights])  # rows a rank's loss reads
    if loss == "rank":
        assert held.all()
    else:  # every vision row read by exactly one rank: the one whose zigzag LM shard holds it
        assert held.sum(0).tolist() == [1] * SHAPE[0]
        assert torch.equal(held, torch.stack([lm_loss.zigzag_rows(SHAPE[0], 4, r).bool() for r in range(4)]))


def test_zigzag_rows_are_the_vision_part_of_the_fused_sequences_split():
    from vdpcp.feature.layout import zigzag_positions

    n, before, after = 10, lm_loss.TEXT_BEFORE, lm_loss.TEXT_AFTER
    for rank in range(4):
        rows = lm_loss.zigzag_rows(n, 4, rank)
        assert rows.dtype == torch.float64 and rows.shape == (n,)
        assert torch.equal(rows.bool(), zigzag_positions(before + n + after, 4, rank)[before : before + n])


def test_own_token_mask_marks_the_gathered_rows_of_a_ranks_own_images():
    plan = Ownership(owner=(0, 1, 1, 0), tokens=(2, 3, 0, 1), placeholders=(0, 0))
    assert oracle.own_token_mask(plan, 0, "cpu").tolist() == [True, True, False, False, False, True]
    assert oracle.own_token_mask(plan, 1, "cpu").tolist() == [False, False, True, True, True, False]
    assert plan.rows_of(1) == [1, 2]


def test_a_seed_of_any_size_draws_weights_and_the_main_features_are_output_0():
    case = Case(SPEC, 4)
    largest = replace(SPEC, seed=2**64 - 1)  # the largest a spec takes (and a DP replica's seed can wrap to)
    w = lm_loss.loss_weights(case, largest, 3, SHAPE, torch.float64, torch.device("cpu"))
    assert torch.equal(w, lm_loss.loss_weights(case, largest, 3, SHAPE, torch.float64, torch.device("cpu"), output=0))
    assert not torch.equal(w, lm_loss.loss_weights(case, largest, 3, SHAPE, torch.float64, torch.device("cpu"), output=1))


def test_each_media_item_is_the_ranks_own_another_ranks_or_shared_between_them():
    video = MicrobatchSpec(images=((16, 16),) * 5, num_frames=(1, 3, 1), seed=7, name="video")
    plan = Ownership(owner=(0, 1, 1, 0, 1), tokens=(4,) * 5, placeholders=(0, 0))  # the video's frames split
    assert oracle.own_media(plan, video, 1) == ("other", "mixed", "own")
    assert oracle.own_media(plan, video, 0) == ("own", "mixed", "other")
    assert oracle.own_media(None, video, 0) is None
    assert oracle.own_media(Ownership((0, 1), (4, 4), (0, 0)), video, 0) is None  # not this microbatch's rows
