"""What a bf16 case's exact run measures, and what it costs, in full float32 against TF32 (vdpcp.oracle.compare.rounding.TF32_EXACT):
one real-size tower on one GPU, its unsharded arm once, then the exact run in each math, timed, and the slack figures
each gives (per output row, the parameter gradients, the pixels' per row).

    python3 scripts/exact_math.py [IMPL ...]     # on a GPU machine; default: reference qwen2_5_vl

A figure the TF32 run gives within a few per cent of the float32 one's (TF32's own error is an eighth of bf16's)
moves no tolerance that matters; the seconds say what the exact run costs in each.
"""

from __future__ import annotations

import sys
import time

import torch

from vdpcp.contract.protocol import outputs_of
from vdpcp.feature import loss
from vdpcp.feature.pixels import handed
from vdpcp.impls import resolve
from vdpcp.matrix.case import Case
from vdpcp.matrix.scenarios import REAL_SCENARIOS, SCENARIOS
from vdpcp.oracle.compare import rounding

SPEC = next(s.spec for s in REAL_SCENARIOS if s.spec.name == "three-images")
TOY = next(s.spec for s in SCENARIOS if s.spec.name == "three-images")


def _measure(impl, model, batch, out, grads, weights, tf32: bool):
    saved = rounding.TF32_EXACT
    rounding.TF32_EXACT = frozenset({torch.bfloat16}) if tf32 else frozenset()
    try:
        _sync(batch.patches.device)
        start = time.perf_counter()
        figures = rounding.measure(impl, model, batch, out, grads, None, weights, None, True)
        _sync(batch.patches.device)
        return figures, time.perf_counter() - start
    finally:
        rounding.TF32_EXACT = saved


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(names: list[str]) -> None:
    # On a machine with no GPU, the toy tower on the CPU: the script's own check (no TF32 there, so no difference)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tower, spec = ("real", SPEC) if device.type == "cuda" else ("toy", TOY)
    for name in names:
        impl = resolve(name)
        case = Case(spec, 1, name, dtype="bfloat16", tower=tower)
        model = impl.build_model(case, torch.bfloat16, device)
        batch = handed(spec, "tower", torch.bfloat16, device)
        batch.patches.requires_grad_(bool(getattr(impl, "pixel_grads", False)))
        out = outputs_of(impl.encode(model, impl.inputs(batch)), name)
        shapes = {n: t.shape for n, t in out.items()}
        weights = {n: w[0] for n, w in loss.case_loss(case, spec, shapes, torch.bfloat16, device).weights.items()}
        loss.features_loss(out, weights).backward()
        grads = [p.grad for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        out = {n: t.detach() for n, t in out.items()}
        _measure(impl, model, batch, out, grads, weights, tf32=True)  # warm-up: kernels chosen, memory cached
        runs = {tf32: _measure(impl, model, batch, out, grads, weights, tf32) for tf32 in (False, True)}
        (ieee, s_ieee), (tf, s_tf) = runs[False], runs[True]
        print(f"{name} (three-images, {tower}, bf16, {device.type}): exact run {s_ieee:.3f} s in float32, {s_tf:.3f} s in TF32")
        for n in out:
            a, b = ieee.outputs[n], tf.outputs[n]
            print(f"  outputs {n!r}: row slack median {a.median():.3e} / {b.median():.3e}, max {a.max():.3e} / "
                  f"{b.max():.3e}; largest relative change of a row's slack {((b - a).abs() / a).max():.2%}")
        print(f"  parameter gradients: slack {ieee.params:.3e} / {tf.params:.3e} ({tf.params / ieee.params - 1:+.2%})")
        if ieee.input is not None:
            a, b = ieee.input, tf.input
            print(f"  pixels: row slack max {a.max():.3e} / {b.max():.3e}; largest relative change "
                  f"{((b - a).abs() / a).max():.2%}")
        del model, out, grads
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["reference", "qwen2_5_vl"])
