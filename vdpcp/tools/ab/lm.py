"""A small causal language model: what consumes the vision features in `vdpcp ab`. It knows nothing about CP.

    input embeddings [L, hidden] (text token embeddings with the projected vision features merged in)
      -> + sinusoidal positions (no parameters, so any sequence length fits)
      -> causal transformer blocks
      -> final norm -> logits [L, vocab]

Its hidden size is the projector's output, so the projected vision features are its inputs as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vdpcp.feature.model import Block


@dataclass(frozen=True)
class LMConfig:
    hidden: int
    vocab: int = 256
    layers: int = 2
    seed: int = 0

    @property
    def heads(self) -> int:
        """Heads of 64 where the hidden size allows it (ViT-L's 2688 -> 42), else one head."""
        return self.hidden // 64 if self.hidden % 64 == 0 else 1


class CausalBlock(Block):
    """The tower's pre-norm block (same layers), attending causally over the one whole sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(1, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(n, d)
        x = x + self.out(attended)
        return x + self.mlp(self.norm2(x))


class LanguageModel(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        c = self.config = config
        with torch.random.fork_rng(devices=[]):
            # Every rank and both A/B arms the same weights; the CPU generator only, as VisionModel seeds it.
            torch.default_generator.manual_seed(c.seed)
            self.embedding = nn.Embedding(c.vocab, c.hidden)
            self.blocks = nn.ModuleList(CausalBlock(c.hidden, c.heads) for _ in range(c.layers))
            self.norm = nn.LayerNorm(c.hidden)
            self.head = nn.Linear(c.hidden, c.vocab)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Input embeddings [L, hidden] -> next-token logits [L, vocab]."""
        x = embeddings + sinusoidal_positions(embeddings.shape[0], self.config.hidden, embeddings)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sinusoidal_positions(length: int, hidden: int, like: torch.Tensor) -> torch.Tensor:
    """The transformer's fixed sin/cos position codes [length, hidden], in ``like``'s dtype and device (worked
    out in at least float32: bf16 cannot tell position 300 from 301)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    position = torch.arange(length, dtype=dtype, device=like.device).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, hidden, 2, dtype=dtype, device=like.device) * (-math.log(10_000.0) / hidden))
    codes = torch.zeros(length, hidden, dtype=dtype, device=like.device)
    codes[:, 0::2] = torch.sin(position * frequency)
    codes[:, 1::2] = torch.cos(position * frequency)[:, : hidden // 2]
    return codes.to(like.dtype)
