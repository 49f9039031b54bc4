"""The A/B's language-model loss under CP: the zigzag split gives every position to exactly one rank, and the
per-rank losses, each over its own positions, add up to the loss of the whole sequence."""

import pytest
import torch
from torch.testing import assert_close

from vdpcp.feature.layout import zigzag_positions
from vdpcp.tools.ab.lm import LanguageModel, LMConfig
from vdpcp.tools.ab.vlm import IGNORE, labels, rank_loss


@pytest.mark.parametrize("length", [1, 7, 8, 45, 64])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_gives_each_position_to_one_rank_chunks_r_and_mirror(length, cp):
    held = torch.stack([zigzag_positions(length, cp, r) for r in range(cp)])
    assert held.sum(0).eq(1).all()
    chunk = -(-length // (2 * cp))
    for r in range(cp):
        chunks = {p // chunk for p in held[r].nonzero().flatten().tolist()}
        assert chunks <= {r, 2 * cp - 1 - r}


def test_labels_predict_the_next_text_token_and_skip_vision():
    prefix, suffix = torch.tensor([1, 2, 3]), torch.tensor([7, 8])
    assert labels(prefix, 2, suffix).tolist() == [2, 3, IGNORE, IGNORE, 7, 8, IGNORE]
    assert labels(prefix, 0, suffix).tolist() == [2, 3, 7, 8, IGNORE]


@pytest.mark.parametrize("num_vision", [0, 5, 37])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_per_rank_losses_add_up_to_the_full_sequence_loss(num_vision, cp):
    gen = torch.Generator().manual_seed(num_vision + cp)
    lm = LanguageModel(LMConfig(hidden=16, vocab=32)).double()
    prefix, suffix = torch.randint(32, (8,), generator=gen), torch.randint(32, (11,), generator=gen)
    features = torch.randn(num_vision, 16, generator=gen, dtype=torch.float64)
    logits = lm(torch.cat([lm.embed(prefix), features, lm.embed(suffix)]))
    targets = labels(prefix, num_vision, suffix)
    full = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE)
    shares = [rank_loss(logits, targets, zigzag_positions(len(targets), cp, r)) for r in range(cp)]
    assert_close(sum(shares), full)
