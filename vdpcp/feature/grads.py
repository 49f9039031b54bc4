"""A tensor's gradient as every check reads it: zeros where no gradient reached it (the oracle, the precision model,
the regrouped reference and the loss's prompt tables, alike)."""

from __future__ import annotations

import torch


def grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def or_zeros(grads, tensors) -> list[torch.Tensor]:
    """Each of ``grads`` (autograd.grad's, None where none reached its tensor), or zeros shaped like its tensor."""
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, tensors)]
