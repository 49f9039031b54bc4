"""What `vdpcp ab` shows: a table of both arms' losses and vision grad norms per step, the parameters'
difference, memory and step time, the verdict; the same as JSON for CI; the loss curves as a PNG."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from vdpcp.matrix import report
from vdpcp.tools.ab.judge import Judged
from vdpcp.usage import UsageError

GIB = 2**30
KIND_MARK = {"placeholders": "p", "remainder": "r", "even": ""}


def table(judged: Judged) -> Table:
    run = judged.run
    title = (f"vdpcp ab: {run.impl}, CP={run.cp}, {run.dataset}, {run.tower} tower, {run.dtype}, "
             f"{run.accumulate} microbatches/step" + (f", mutant {run.mutant} in arm on" if run.mutant else ""))
    out = Table(title=title)
    for name in ("step", "microbatches (units)", "loss on", "loss off", "|diff|", "rel", "vision grad norm on",
                 "vision grad norm off", "rel", "LM grad rel", ""):
        out.add_column(name, justify="left" if name.startswith("micro") else "right", no_wrap=True)
    for step in judged.steps:
        loss = step.values["loss"]
        vision = step.values["vision_grad_norm"]
        ok = all(step.rel(q) <= judged.tolerance for q in step.values)
        out.add_row(str(step.index), microbatches(step.draws), f"{loss['on']:.10f}", f"{loss['off']:.10f}",
                    f"{abs(loss['on'] - loss['off']):.2e}", f"{step.rel('loss'):.1e}", f"{vision['on']:.6g}",
                    f"{vision['off']:.6g}", f"{step.rel('vision_grad_norm'):.1e}", f"{step.rel('lm_grad_norm'):.1e}",
                    "[green]ok[/]" if ok else "[bold red]FAIL[/]")
    return out


def microbatches(draws) -> str:
    """Units the count split divides, marked p (placeholders) / r (remainder), * where mixed in."""
    return " ".join(f"{d.spec.num_tubelets}{KIND_MARK[d.kind]}{'*' if d.mixed_in else ''}" for d in draws)


def summary(judged: Judged) -> list[str]:
    lines = [f"final parameters: max |on - off| = {judged.max_param_diff:.2e}; ||on - off|| / ||off - initial|| = "
             f"{judged.param_diff:.2e}",
             f"tolerance ({judged.run.dtype}): {judged.tolerance:.2g} relative, per step"
             + (" and on the parameters" if judged.params_judged else " (the parameters are reported, not judged: vdpcp.tools.ab.judge)")]
    if judged.peak_bytes["on"] is None:
        lines.append(f"peak memory and step time: not measured ({', '.join(judged.devices)}: they are GPU figures)")
    else:
        peak, step = judged.peak_bytes, judged.step_s
        lines.append(f"busiest rank's peak allocated memory: {peak['off'] / GIB:.2f} GiB (off) -> {peak['on'] / GIB:.2f} "
                     f"GiB (on), {_change(peak['on'], peak['off'])}")
        lines.append(f"step time (slowest rank, mean of steps 2..): {step['off']:.3f} s (off) -> {step['on']:.3f} s (on), "
                     f"{_change(step['on'], step['off'])}")
    lines.append(f"ran on {judged.backend}/{','.join(judged.devices)} in {judged.seconds:.1f} s")
    verdict = "[green]pass[/]" if judged.passed else "[bold red]fail[/]"
    lines.append(f"verdict: {verdict}" + "".join(f"\n  {f}" for f in judged.failures))
    return lines


def write_json(path: Path, judged: Judged) -> None:
    run = judged.run
    steps = [{"step": s.index, "microbatches": [_draw_record(d) for d in s.draws],
              **{f"{q}_{arm}": s.values[q][arm] for q in s.values for arm in ("on", "off")},
              **{f"{q}_rel_diff": s.rel(q) for q in s.values}} for s in judged.steps]
    report.write_json(path, "ab", steps, run=asdict(run), tolerance=judged.tolerance, verdict="pass" if judged.passed else "fail",
                      failures=judged.failures, max_param_diff=judged.max_param_diff, param_diff=judged.param_diff,
                      peak_bytes=judged.peak_bytes, step_s=judged.step_s, backend=judged.backend, devices=judged.devices,
                      seconds=round(judged.seconds, 3))


def plot(path: Path, judged: Judged) -> Path:
    """Both arms' loss curves over the steps, and their relative difference against the tolerance."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a CI runner or a GPU node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [s.index for s in judged.steps]
    fig, (curves, gap) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    for arm, style in (("off", "-o"), ("on", "--x")):
        curves.plot(steps, [s.values["loss"][arm] for s in judged.steps], style, label=f"vision_dp_over_cp {arm}")
    curves.set_ylabel("loss")
    curves.legend()
    curves.set_title(table(judged).title, fontsize=8)
    floor = judged.tolerance * 1e-9  # an exact match still shows, at the bottom of the log scale
    gap.semilogy(steps, [max(s.rel("loss"), floor) for s in judged.steps], "-o", label="|on - off| / off")
    gap.axhline(judged.tolerance, color="red", linestyle=":", label=f"{judged.run.dtype} tolerance")
    gap.xaxis.set_major_locator(MaxNLocator(integer=True))
    gap.set_xlabel("step")
    gap.set_ylabel("relative difference")
    gap.legend()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    except OSError as err:
        raise UsageError(f"{path}: cannot write the plot ({err.strerror})") from None
    finally:
        plt.close(fig)
    return path


def _draw_record(draw) -> dict:
    return {"spec": draw.spec.name, "images": len(draw.spec.images), "units": draw.spec.num_tubelets,
            "kind": draw.kind, "mixed_in": draw.mixed_in}


def _change(on: float, off: float) -> str:
    return f"{100 * (on - off) / off:+.1f}%" if off else "n/a"
