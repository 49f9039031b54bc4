"""The unsharded run the precision tests measure: the reference tower in float32 on one scenario, its loss weights,
its gradients set aside (as vdpcp.oracle sets them aside), and a float64 copy of its weights."""

from dataclasses import dataclass

import torch

from vdpcp.impls import resolve
from vdpcp.matrix.case import Case
from vdpcp.matrix.scenarios import SCENARIOS

SPECS = {s.spec.name: s.spec for s in SCENARIOS}


@dataclass
class Run:
    impl: object
    case: Case
    model: torch.nn.Module
    batch: object
    out: dict
    weights: dict
    own_weights: dict
    grads: list
    own: list | None  # d (own loss) / d params, where asked for


def unsharded_run(spec_name: str, seed: int, own: bool = False) -> Run:
    """Forward, (the own loss's parameter gradients,) then the summed loss's backward, its gradients set aside."""
    impl, case = resolve("reference"), Case(SPECS[spec_name], 2, dtype="float32")
    model = impl.build_model(case, torch.float32, torch.device("cpu"))
    batch = case.spec.tensors(dtype=torch.float32)
    batch.patches.requires_grad_(True)
    out = {"features": impl.encode(model, batch)}
    gen = torch.Generator().manual_seed(seed)
    weights, own_weights = ({"features": torch.randn(out["features"].shape, generator=gen)} for _ in range(2))
    own_grads = list(torch.autograd.grad((out["features"] * own_weights["features"]).sum(), list(model.parameters()),
                                         retain_graph=True)) if own else None
    (out["features"] * weights["features"]).sum().backward()
    grads = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return Run(impl, case, model, batch, out, weights, own_weights, grads, own_grads)


def exact_copy(run: Run) -> torch.nn.Module:
    """The same tower in float64, with the run's weights."""
    exact = run.impl.build_model(run.case, torch.float64, torch.device("cpu"))
    exact.load_state_dict(run.model.state_dict())
    return exact
