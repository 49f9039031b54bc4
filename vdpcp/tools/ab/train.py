"""On every CP rank: the A/B's two training runs, one after the other, from the same weights on the same data.

Arm "on" encodes with the implementation's sharded path (vision_dp_over_cp=True; a --mutant is in force here
only), arm "off" with the flag off (every rank encodes every image). Each step: the microbatches' forward and
backward (each rank's loss on its own zigzag shard), the gradients summed over the CP group, AdamW. Each arm
records what a training log shows: the global loss and the grad norms (vision, LM) per step and, on a GPU, its peak
allocated memory (reset per arm) and step times; at the end the arms' final parameters are compared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from vdpcp.feature.layout import zigzag_positions
from vdpcp.feature.model import positions_needed
from vdpcp.feature.sharded import VisionDPConfig
from vdpcp.impls import resolve
from vdpcp.matrix.case import Case
from vdpcp.oracle import TORCH_DTYPES
from vdpcp.oracle.observe import gloo_collectives
from vdpcp.tools import mutants
from vdpcp.tools.ab import vlm
from vdpcp.tools.ab.optim import MainParams
from vdpcp.tools.ab.stream import Draw, schedule, text

ARMS = ("on", "off")  # vision_dp_over_cp True, then False


@dataclass(frozen=True)
class Run:
    """What every rank is told: the A/B's whole input."""

    impl: str
    cp: int
    steps: int
    accumulate: int
    dtype: str
    dataset: str
    tower: str
    seed: int
    mutant: str | None = None

    def schedule(self) -> list[list[Draw]]:
        return schedule(self.dataset, self.cp, self.steps, self.accumulate, self.seed, self.tower)


def ab_ranks(ctx, run: Run) -> dict:
    """Both arms on this rank: their per-step records and how far apart their final parameters are."""
    impl, dtype, draws = resolve(run.impl), TORCH_DTYPES[run.dtype], run.schedule()
    model = _build(impl, _build_case(run, draws), draws, dtype, ctx)
    initial = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}
    arms, finals = {}, {}
    for arm in ARMS:
        model.load_state_dict(initial)
        with mutants.applied(run.mutant if arm == "on" else None, impl) as subject:
            config = VisionDPConfig(context_parallel_size=run.cp, vision_dp_over_cp=arm == "on")
            arms[arm], finals[arm] = _train(ctx, model, subject, config, draws, dtype)
    start = torch.cat([initial[name].reshape(-1) for name, p in model.named_parameters() if p.requires_grad])
    diff, update = finals["on"] - finals["off"], finals["off"] - start.to(finals["off"].dtype)
    return {"device": str(ctx.device), "backend": ctx.backend, "arms": arms, "max_param_diff": diff.abs().max().item(),
            "param_diff_norm": diff.norm().item(), "param_update_norm": update.norm().item()}


def _parts(model: vlm.VLM) -> dict[str, tuple[int, int]]:
    """The vision (tower + projector) and LM parameters' places in the model's parameter order."""
    vision = sum(1 for p in model.vision.parameters() if p.requires_grad)
    return {"vision": (0, vision), "lm": (vision, sum(1 for p in model.parameters() if p.requires_grad))}


def _build_case(run: Run, draws) -> Case:
    """The case the model is built for: the first microbatch's seed (so its weights), the widest microbatch's grids
    (a case's tower keeps the positions its microbatch needs, and one model trains on every draw)."""
    widest = max((d.spec for step in draws for d in step), key=lambda spec: positions_needed(spec.grids))
    spec = replace(widest, seed=draws[0][0].spec.seed)
    return Case(spec, run.cp, impl=run.impl, dtype=run.dtype, tower=run.tower)


def _build(impl, case: Case, draws, dtype, ctx) -> vlm.VLM:
    """The implementation's tower and the LM after it, rank 0's weights on every rank (as DDP starts)."""
    vision = impl.build_model(case, dtype, ctx.device)
    smallest = min((d.spec for step in draws for d in step), key=lambda spec: sum(spec.row_patches))
    with torch.no_grad():  # the projector's output width, whatever the implementation's model
        width = impl.encode(vision, impl.inputs(smallest.tensors(dtype=dtype, device=ctx.device))).shape[-1]
    model = vlm.build(vision, width, dtype, ctx.device, seed=case.spec.seed)
    for p in model.parameters():
        dist.broadcast(p.data, src=dist.get_global_rank(ctx.group, 0), group=ctx.group)
    return model


def _train(ctx, model: vlm.VLM, impl, config: VisionDPConfig, draws, dtype) -> tuple[dict, torch.Tensor]:
    cuda = ctx.device.type == "cuda"
    optimizer = MainParams(model)
    if cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    record = {"loss": [], "vision_grad_norm": [], "lm_grad_norm": [], "step_s": [] if cuda else None, "peak_bytes": None}
    for step in draws:
        started = time.perf_counter()
        loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
        for draw in step:
            loss += _microbatch(ctx, model, impl, config, draw, len(step), dtype)
            optimizer.accumulate()
        optimizer.reduce(ctx.group)
        for part, (first, stop) in _parts(model).items():
            record[f"{part}_grad_norm"].append(optimizer.grad_norm(first, stop))
        optimizer.step()
        dist.all_reduce(loss, group=ctx.group)  # the global loss: the ranks' shares add up to it
        record["loss"].append(loss.item())
        if cuda:
            torch.cuda.synchronize(ctx.device)
            record["step_s"].append(time.perf_counter() - started)
    if cuda:
        record["peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    return record, optimizer.flat()


def _microbatch(ctx, model: vlm.VLM, impl, config: VisionDPConfig, draw: Draw, accumulate: int, dtype) -> torch.Tensor:
    """Forward and backward of one microbatch on this rank; its share of the step's loss."""
    batch = draw.spec.tensors(dtype=dtype, device=ctx.device)
    with gloo_collectives.on_gloo(ctx.group):  # torch.distributed.nn's all_to_all made right on gloo, as in a check
        features = impl.encode_sharded(model.vision, impl.inputs(batch), config, ctx.group)
        prefix, suffix = (t.to(ctx.device) for t in text(draw, model.lm.config.vocab))
        targets = vlm.labels(prefix, features.shape[0], suffix)
        held = zigzag_positions(len(targets), config.context_parallel_size, dist.get_rank(ctx.group)).to(ctx.device)
        loss = vlm.rank_loss(model.logits(prefix, features, suffix), targets, held) / accumulate
        loss.backward()
    return loss.detach().double()
