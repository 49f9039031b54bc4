"""The optimizer side of an A/B arm, as CP training does it: replicated parameters whose gradients are summed
over the CP group, then AdamW.

Gradients of the microbatches of a step accumulate into one flat buffer (one collective reduces them all) in
float32 at least: a bf16 model keeps float32 main copies of its parameters, its gradients and AdamW's state,
and copies the main parameters back after each step, as mixed-precision training does (AdamW on bf16 weights
would round most updates away). At float32 and float64 the main parameters are the model's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

LR, WEIGHT_DECAY = 1e-3, 0.01


class MainParams:
    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtype = torch.promote_types(self.params[0].dtype, torch.float32)
        self.main = [p if p.dtype == dtype else nn.Parameter(p.detach().to(dtype)) for p in self.params]
        self.flat_grad = torch.zeros(sum(p.numel() for p in self.params), dtype=dtype, device=self.params[0].device)
        self.grads = [g.view_as(p) for g, p in zip(self.flat_grad.split([p.numel() for p in self.params]), self.params)]
        self.optimizer = torch.optim.AdamW(self.main, lr=LR, weight_decay=WEIGHT_DECAY)

    def accumulate(self) -> None:
        """Move this microbatch's gradients into the step's buffer (where a rank ran none, it adds nothing)."""
        for p, grad in zip(self.params, self.grads):
            if p.grad is not None:
                grad += p.grad
                p.grad = None

    def reduce(self, group) -> None:
        """Sum the step's gradients over the CP group."""
        dist.all_reduce(self.flat_grad, group=group)

    def grad_norm(self, first: int, stop: int) -> float:
        """2-norm of the gradients of parameters ``first`` to ``stop - 1`` (in the model's order)."""
        return torch.cat([g.reshape(-1) for g in self.grads[first:stop]]).norm().item()

    @torch.no_grad()
    def step(self) -> None:
        for main, grad in zip(self.main, self.grads):
            main.grad = grad
        self.optimizer.step()
        for p, main in zip(self.params, self.main):
            main.grad = None
            if p is not main:
                p.copy_(main)
        self.flat_grad.zero_()

    def flat(self) -> torch.Tensor:
        """The main parameters, flat, on the CPU: what the arms compare."""
        return torch.cat([m.detach().reshape(-1) for m in self.main]).cpu()
