"""A tensor's gradient as every check reads it: zeros where no gradient reached it (the oracle, the precision model,
the regrouped reference and the loss's prompt tables, alike)."""

from __future__ import annotations

import torch


def grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)
