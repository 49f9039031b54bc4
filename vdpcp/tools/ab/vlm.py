"""The tiny VLM in the A/B's loop: an implementation's tower + projector, and a small causal LM after it.

    text prefix | projected vision features | text suffix   ->  the LM  ->  next-token logits

Under CP every rank holds the whole parameter set and here runs the LM on the whole sequence, but takes the
next-token loss only at the positions its zigzag shard holds (vdpcp.feature.layout.zigzag_positions). Each rank
divides by the count of loss positions in the WHOLE sequence, so the per-rank losses add up to the global
mean loss and their gradients, summed over CP, to its gradient. Labels: a text position predicts the next
text token; a position whose next token is a vision feature has none (IGNORE), as VLM training masks them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vdpcp.tools.ab.lm import LanguageModel, LMConfig

IGNORE = -100  # cross_entropy's ignore_index


class VLM(nn.Module):
    def __init__(self, vision: nn.Module, lm: LanguageModel):
        super().__init__()
        self.vision, self.lm = vision, lm

    def logits(self, prefix: torch.Tensor, features: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
        merged = torch.cat([self.lm.embed(prefix), features, self.lm.embed(suffix)])
        return self.lm(merged)


def build(vision: nn.Module, feature_width: int, dtype: torch.dtype, device, seed: int) -> VLM:
    """The VLM around a built tower; the LM's hidden size is the projector's output width."""
    return VLM(vision, LanguageModel(LMConfig(hidden=feature_width, seed=seed)).to(device=device, dtype=dtype))


def labels(prefix: torch.Tensor, num_vision: int, suffix: torch.Tensor) -> torch.Tensor:
    """Next-token targets of the merged sequence: the next text token, or IGNORE where a vision feature is next."""
    return torch.cat([prefix[1:], prefix.new_full((num_vision,), IGNORE), suffix, suffix.new_full((1,), IGNORE)])


def rank_loss(logits: torch.Tensor, targets: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """This rank's share of the sequence's mean next-token loss: its ``held`` positions over ALL loss positions.

    Cross-entropy in float32 at least, as low-precision training takes it."""
    counted = targets != IGNORE
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_position = F.cross_entropy(wide, targets, ignore_index=IGNORE, reduction="none")
    return (per_position * held).sum() / counted.sum()
