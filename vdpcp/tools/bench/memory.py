"""Busiest-rank peak memory and time of encode+project (forward+backward), sharded vs unsharded.

The sharded encode has no collective before the gather, so one process can stand in for every CP rank:
it encodes each rank's shard in turn (split -> encode -> project, then a backward from a ones gradient),
measuring each alone, and the unsharded microbatch the same way. For every shard:
- peak: torch.cuda.max_memory_allocated after a reset, in total and above the step's starting point
  (weights, their grads and the microbatch's patches are resident before the step and do not shrink
  with CP; "activations" is what vision DP over CP divides);
- saved: bytes of tensors autograd saved for the backward (device-independent, so the CPU run has it too);
- time: best of --reps, CUDA events on GPU, perf_counter on CPU.
Splits: count (MCore), balanced by patches, balanced by p*(p+alpha). On CPU it runs a small tower on
downscaled images and says so; its figures are not the GPU's.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vdpcp.cli.exit_codes import Exit
from vdpcp.feature.balance import REAL_TOWER_ALPHA, SPLIT_NAMES, plan_split

GPU_TOWER = dict(patch_dim=16, hidden=1024, heads=16, layers=24, max_grid=64, lm_hidden=2688)
CPU_TOWER = dict(patch_dim=16, hidden=64, heads=2, layers=2, max_grid=64, lm_hidden=96)
MIB = 2**20


def add_arguments(parser) -> None:
    from vdpcp.cli import POSITIVE, RANKS

    parser.add_argument("--dataset", default="multi-image", help="built-in generator (default multi-image)")
    parser.add_argument("--seeds", type=POSITIVE, default=4, help="microbatches: seeds 0..N-1 (default 4)")
    parser.add_argument("--samples", type=POSITIVE, default=None, help="samples per microbatch (default: the dataset's)")
    parser.add_argument("--cp", type=RANKS, action="append", help="CP sizes (repeatable; default 2 4 8)")
    parser.add_argument("--layers", type=POSITIVE, default=None, help="tower depth (default 24 on GPU, 2 on CPU)")
    parser.add_argument("--reps", type=POSITIVE, default=2, help="timed repetitions per shard, best kept (default 2)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out", default=None, help="folder for results.json and tables.md")


def run(args) -> int:
    from vdpcp.cli import UsageError
    from vdpcp.feature.datasets import DATASETS

    if args.dataset not in DATASETS:
        raise UsageError(f"--dataset must be one of {sorted(DATASETS)}, got {args.dataset!r}")
    bench = Bench.configure(args)
    print(bench.describe(), flush=True)
    result = bench.run()
    tables = result.tables()
    print(tables)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        (out / "tables.md").write_text(bench.describe() + "\n\n" + tables + "\n")
        print(f"wrote {out / 'results.json'} and {out / 'tables.md'}")
    return Exit.PASSED


@dataclass
class Measure:
    split: str  # "unsharded" or a vdpcp.feature.balance split name
    seed: int
    cp: int
    rank: int
    images: int
    patches: int
    attention: int  # p*(p+alpha) load
    peak_mib: float  # max_memory_allocated during the step (nan on CPU)
    activation_mib: float  # peak above the step's starting allocation (nan on CPU)
    saved_bytes: int  # tensors autograd saved for backward, weights and input patches left out
    ms: float


@dataclass
class Bench:
    device: str
    dtype: str
    tower: dict
    dataset: str
    seeds: int
    samples: int | None
    downscale: int
    cps: tuple[int, ...]
    reps: int
    alpha: int = REAL_TOWER_ALPHA

    @classmethod
    def configure(cls, args) -> Bench:
        import torch

        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            from vdpcp.cli import UsageError

            raise UsageError("--device cuda: no CUDA device is visible")
        gpu = device == "cuda"
        tower = dict(GPU_TOWER if gpu else CPU_TOWER)
        if args.layers:
            tower["layers"] = args.layers
        return cls(
            device=device,
            dtype="bfloat16" if gpu else "float32",  # bf16 matmuls on 2 CPU cores would only measure slowness
            tower=tower,
            dataset=args.dataset,
            seeds=args.seeds,
            samples=args.samples if args.samples else (None if gpu else 4),
            downscale=1 if gpu else 4,
            cps=tuple(args.cp or (2, 4, 8)),
            reps=args.reps,
            alpha=3 * tower["hidden"],
        )

    def describe(self) -> str:
        import torch

        where = torch.cuda.get_device_name() if self.device == "cuda" else "CPU (small size: not the GPU's figures)"
        t = self.tower
        return (
            f"device: {where}; torch {torch.__version__}; dtype {self.dtype}\n"
            f"tower: hidden {t['hidden']}, {t['heads']} heads, {t['layers']} layers, P={t['patch_dim']}, "
            f"projector 4x{t['hidden']} -> {t['lm_hidden']}; alpha = 3 x hidden = {self.alpha}\n"
            f"microbatches: {self.dataset}, seeds 0..{self.seeds - 1}, samples {self.samples or 'default'}, "
            f"grid downscale {self.downscale}; CP {list(self.cps)}; step = encode+project forward+backward, "
            f"best of {self.reps}"
        )

    def run(self) -> BenchResult:
        import torch

        from vdpcp.feature.datasets import generate
        from vdpcp.feature.model import TowerConfig, VisionModel

        dtype = getattr(torch, self.dtype)
        specs = [
            generate(self.dataset, seed, samples=self.samples, patch_dim=self.tower["patch_dim"], downscale=self.downscale)
            for seed in range(self.seeds)
        ]
        tower = TowerConfig(**self.tower, temporal_patch_size=specs[0].temporal_patch_size)  # one T per dataset
        model = VisionModel(tower).to(device=self.device, dtype=dtype)
        result = BenchResult(self)
        for seed, spec in enumerate(specs):
            batch = spec.tensors(dtype=dtype, device=self.device)
            self._step(model, batch.patches, batch.imgs_sizes, spec.num_frames)  # warm-up; allocates the grads
            configs = [("unsharded", 1)] + [(split, cp) for cp in self.cps for split in SPLIT_NAMES]
            for split, cp in configs:
                plan = plan_split(spec, cp, "count" if split == "unsharded" else split, self.alpha)
                loads = {cost: plan.loads(cost, self.alpha) for cost in ("patches", "attention")}
                for shard in plan.shards:
                    measure = self._measure(model, split_patches(batch, shard, plan.order), shard)
                    result.rows.append(
                        Measure(split, seed, cp, shard.rank, shard.num_real_rows, loads["patches"][shard.rank],
                                loads["attention"][shard.rank], **measure)
                    )
            print(f"  seed {seed}: {len(spec.images)} images, {sum(spec.row_patches)} patches measured", flush=True)
        return result

    def _measure(self, model, patches, shard) -> dict:
        """Peak and saved bytes from one step, then the best time of ``reps`` more."""
        import torch

        gpu = self.device == "cuda"
        model.zero_grad(set_to_none=False)  # grads stay allocated: part of the step's starting point
        peak = activation = float("nan")
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        with SavedBytes(exclude=[*model.parameters(), patches]) as saved:
            self._step(model, patches, shard.imgs_sizes, shard.num_frames, saved)
        if gpu:
            peak = torch.cuda.max_memory_allocated() / MIB
            activation = peak - start / MIB
        times = [self._step(model, patches, shard.imgs_sizes, shard.num_frames) for _ in range(self.reps)]
        return dict(peak_mib=peak, activation_mib=activation, saved_bytes=saved.bytes, ms=1e3 * min(times))

    def _step(self, model, patches, imgs_sizes, num_frames, saved=None) -> float:
        """One encode+project forward and backward; seconds."""
        import torch

        gpu = self.device == "cuda"
        if gpu:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with saved.hooks() if saved is not None else contextlib.nullcontext():
            out = model.project(model.encode(patches, imgs_sizes, num_frames))
        out.backward(torch.ones_like(out))
        if not gpu:
            return time.perf_counter() - t0
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / 1e3


class SavedBytes:
    """Sums the storage bytes autograd saves for backward, each storage once, leaving out ``exclude``
    (weights and the input patches: resident anyway, whatever the shard)."""

    def __init__(self, exclude=()):
        self.bytes = 0
        self._resident = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen = set(self._resident)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._seen = set(self._resident)  # forget pointers: the storages are freed after the backward
        return False

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t


def split_patches(batch, shard, order=None):
    from vdpcp.feature.sharded import split  # the suite's own split: the benchmark encodes what ranks encode

    return split(batch, shard, order)


# --- results --------------------------------------------------------------------------------------


@dataclass
class BenchResult:
    bench: Bench
    rows: list[Measure] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"bench": asdict(self.bench), "rows": [asdict(r) for r in self.rows]}

    def unsharded(self, seed: int) -> Measure:
        return next(r for r in self.rows if r.split == "unsharded" and r.seed == seed)

    def shards(self, seed: int, cp: int, split: str) -> list[Measure]:
        return [r for r in self.rows if r.seed == seed and r.cp == cp and r.split == split]

    def tables(self) -> str:
        return "\n\n".join([self.busiest_table(), self.predictor_table()])

    def busiest_table(self) -> str:
        """Busiest rank against unsharded, mean over seeds (worst seed in brackets), per CP and split."""
        gpu = self.bench.device == "cuda"
        metric = "activation_mib" if gpu else "saved_bytes"
        head = "busiest activations / unsharded" if gpu else "busiest saved-for-backward / unsharded"
        lines = [
            f"| CP | split | ideal 1/CP | {head} | busiest / (unsharded/CP) | busiest total peak / unsharded | busiest time / unsharded |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for cp in self.bench.cps:
            for split in SPLIT_NAMES:
                act, peak, ms = [], [], []
                for seed in range(self.bench.seeds):
                    base, shards = self.unsharded(seed), self.shards(seed, cp, split)
                    act.append(max(getattr(s, metric) for s in shards) / getattr(base, metric))
                    peak.append(max(s.peak_mib for s in shards) / base.peak_mib)
                    ms.append(max(s.ms for s in shards) / base.ms)
                lines.append(
                    f"| {cp} | {split} | {1 / cp:.3f} | {_mean_worst(act)} | {_mean_worst([a * cp for a in act])} "
                    f"| {_mean_worst(peak) if gpu else 'n/a (CPU)'} | {_mean_worst(ms)} |"
                )
        return "\n".join(lines)

    def predictor_table(self) -> str:
        """Which cost predicts each shard's measured memory and time: Pearson r over all shards, and how often
        the cost's busiest rank is the measured busiest rank."""
        gpu = self.bench.device == "cuda"
        measured = (("saved-for-backward", "saved_bytes"),)
        measured += (("peak activation memory", "activation_mib"),) if gpu else ()
        measured += (("time", "ms"),)
        shards = [r for r in self.rows if r.split != "unsharded"]
        configs = [(seed, cp, split) for seed in range(self.bench.seeds) for cp in self.bench.cps for split in SPLIT_NAMES]
        lines = [
            "| measured | cost | Pearson r over shards | busiest rank named right | mean abs error, busiest / unsharded |",
            "|---|---|---:|---:|---:|",
        ]
        for label, attr in measured:
            for cost in ("patches", "attention"):
                r = _pearson([getattr(s, cost) for s in shards], [getattr(s, attr) for s in shards])
                hits, errors = 0, []
                for seed, cp, split in configs:
                    group, base = self.shards(seed, cp, split), self.unsharded(seed)
                    by_cost = max(group, key=lambda s: getattr(s, cost))
                    by_measure = max(group, key=lambda s: getattr(s, attr))
                    hits += getattr(by_cost, attr) >= 0.99 * getattr(by_measure, attr)  # ties within 1% count as right
                    predicted = getattr(by_cost, cost) / getattr(base, cost)
                    errors.append(abs(predicted - getattr(by_measure, attr) / getattr(base, attr)))
                name = "p(p+alpha)" if cost == "attention" else "patches"
                lines.append(f"| {label} | {name} | {r:.4f} | {hits}/{len(configs)} | {statistics.mean(errors):.4f} |")
        return "\n".join(lines)


def _mean_worst(values) -> str:
    return f"{statistics.mean(values):.3f} ({max(values):.3f})"


def _pearson(xs, ys) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else float("nan")


if __name__ == "__main__":  # the GPU machine has no megatron-core, which the vdpcp CLI's other commands import
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m vdpcp.tools.bench.memory", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
