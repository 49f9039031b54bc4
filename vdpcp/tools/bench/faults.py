"""What a faulted case costs over a passing one: the zygote's preload on or off, sound workers kept or re-forked.

A case body imports what vdpcp's cases import (vdpcp's runner and the shipped implementations' preloads:
megatron-core, transformers' Qwen2.5-VL tower), then all_gathers one tensor on the rank's device. It passes;
or raises on every rank before its collective (as a subject importing a name the installed torch lacks
did, on every rank of every case); or raises on rank 1 only, so the others wait in the all_gather until the
fault grace ends and are taken as hung. Each configuration gets a pool of its own:

- preload ``none``: the zygote imports torch only, so a fresh worker pays the imports again inside its next
  case; ``case`` preloads the imports into the zygote (on a GPU machine
  only with ``--tolerate-threads``, see vdpcp.harness.forkcheck);
- reuse ``off`` re-forks the workers after every fault; ``on``
  keeps them when every rank returned and the process groups check sound (vdpcp/harness/soundness.py).

A fault's cost is measured where it is paid: the faulted case plus the passing case after it (which forks the
workers and imports what the fault cost them), less two passing cases. The target: at most 1 s.
"""

import contextlib
import importlib
import json
import os
import pickle
import statistics
import time

from vdpcp.cli.exit_codes import Exit

CONFIGS = ("none/off", "none/on", "case/off", "case/on")
TARGET_S = 1.0


def add_arguments(parser) -> None:
    from vdpcp.cli import POSITIVE, number

    parser.add_argument("--world-size", type=number(int, 2, note="the one-rank fault is on rank 1"), default=2,
                        help="ranks per case (default 2)")
    parser.add_argument("--passes", type=POSITIVE, default=5, help="passing cases timed per configuration (default 5)")
    parser.add_argument("--repeats", type=POSITIVE, default=2, help="faulted cases of each kind per configuration (default 2)")
    parser.add_argument("--config", action="append", choices=CONFIGS, default=None, metavar="PRELOAD/REUSE",
                        help=f"a configuration to measure, repeatable ({', '.join(CONFIGS)}; default all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where each rank's tensors live (VDPCP_DEVICE; default: as set, else cpu)")
    parser.add_argument("--tolerate-threads", default="", metavar="PREFIX,...",
                        help="OS thread-name prefixes the zygote accepts after a `case` preload (e.g. cuda on a GPU machine)")
    parser.add_argument("--grace", type=number(float, 0), default=None,
                        help="seconds the other ranks get once one raised (default: the harness's, 3 s)")
    parser.add_argument("--modules", default=None, metavar="MODULE,...",
                        help="what the case body imports (default: what vdpcp's cases import)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from vdpcp.harness.pool import FAULT_GRACE_S

    modules = tuple(filter(None, args.modules.split(","))) if args.modules is not None else case_modules()
    grace = FAULT_GRACE_S if args.grace is None else args.grace
    tolerate = tuple(filter(None, args.tolerate_threads.split(",")))
    device = args.device or os.environ.get("VDPCP_DEVICE", "cpu")
    print(f"{args.world_size} ranks, gloo, tensors on {device}; the case imports {', '.join(modules) or 'nothing'}; "
          f"grace {grace:g} s when one rank raised", flush=True)
    rows = []
    with _device(device):
        for config in args.config or CONFIGS:
            rows.append(measure(config, modules, args.world_size, args.passes, args.repeats, grace, tolerate))
            print("  " + _line(rows[-1]), flush=True)  # as each ends, and the JSON too: a killed run keeps what it measured
            if args.json:
                with open(args.json, "w") as out:
                    json.dump({"world_size": args.world_size, "device": device, "grace_s": grace, "modules": modules,
                               "rows": rows}, out, indent=2)
    _print_table(rows, grace)
    return Exit.PASSED


def case_modules() -> tuple[str, ...]:
    """What a vdpcp case imports on its ranks: exactly what runner.preload_case_modules would preload."""
    from vdpcp.impls import BUILT_INS
    from vdpcp.matrix.runner import case_preload

    return case_preload((*BUILT_INS, "qwen2_5_vl"))


def case_body(ctx, modules: tuple[str, ...], fault: str | None):
    import torch
    import torch.distributed as dist

    for name in modules:
        importlib.import_module(name)
    if fault == "every":
        raise ImportError("cannot import name 'all_gather_single' (raised on every rank, before any collective)")
    if fault == "one" and ctx.rank == 1:
        raise ValueError("rank 1 raised; the others wait in the all_gather")
    mine = torch.tensor([float(ctx.rank)], device=ctx.device)
    gathered = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine, group=ctx.group)
    return [t.item() for t in gathered]


def measure(config: str, modules, world_size: int, passes: int, repeats: int, grace: float, tolerate) -> dict:
    """One configuration's figures, in a pool of its own; an error (e.g. the zygote refusing) is a row too."""
    from vdpcp.harness.outcome import OK
    from vdpcp.harness.pool import WorkerPool

    preload, reuse = config.split("/")
    row = {"config": config, "preload": preload, "reuse": reuse}
    pool = WorkerPool()
    options = dict(preload=modules if preload == "case" else (), reuse_after_raise=reuse == "on",
                   tolerate_threads=tolerate if preload == "case" else (), fault_grace=grace)

    def timed(fault):
        start = time.perf_counter()
        outcomes = pool.run(pickle.dumps((case_body, (modules, fault), {})), world_size, "gloo", 600.0, **options)
        seconds = time.perf_counter() - start
        if fault is None and any(o.kind != OK for o in outcomes):
            raise RuntimeError("a passing case did not pass: " + "; ".join(f"rank {o.rank} {o.summary}" for o in outcomes))
        return seconds

    try:
        row["first_case_s"] = timed(None)  # the pool's start-up, forks, imports and first group
        pass_s = statistics.median(timed(None) for _ in range(passes))
        row["pass_s"] = pass_s
        for fault in ("every", "one"):
            extra, what = [], set()
            for _ in range(repeats):
                faulted = timed(fault)
                what.add(pool.recovery.split(":")[0])  # kept / re-forked
                extra.append(faulted + timed(None) - 2 * pass_s)
            row[fault] = {"extra_s": statistics.median(extra), "max_extra_s": max(extra), "workers": "/".join(sorted(what))}
    except Exception as err:  # noqa: BLE001 - a configuration that cannot run says why, and the others still run
        row["error"] = str(err).splitlines()[0][:300]
    finally:
        pool.shutdown()
    return row


@contextlib.contextmanager
def _device(device: str):
    """VDPCP_DEVICE for the ranks (they read the caller's environment at every case), then as it was."""
    saved = os.environ.get("VDPCP_DEVICE")
    os.environ["VDPCP_DEVICE"] = device
    try:
        yield
    finally:
        if saved is None:
            del os.environ["VDPCP_DEVICE"]
        else:
            os.environ["VDPCP_DEVICE"] = saved


def _fault_cell(row: dict, fault: str) -> str:
    cell = row.get(fault)
    if cell is None:
        return "-"
    return f"+{cell['extra_s']:.2f} s, {cell['workers']}"


def _line(row: dict) -> str:
    if "error" in row and "pass_s" not in row:
        return f"preload {row['preload']}, reuse {row['reuse']}: error: {row['error']}"
    faults = "".join(f", {label} +{row[fault]['extra_s']:.2f} s (max +{row[fault]['max_extra_s']:.2f}, {row[fault]['workers']})"
                     for fault, label in (("every", "every rank raises"), ("one", "one rank raises")) if fault in row)
    return (f"preload {row['preload']}, reuse {row['reuse']}: first case {row['first_case_s']:.2f} s, "
            f"pass {row['pass_s']:.3f} s{faults}" + (f"; error: {row['error']}" if "error" in row else ""))


def _print_table(rows: list[dict], grace: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"vdpcp bench faults: what a faulted case adds to a passing one (target: at most +{TARGET_S:g} s)")
    for column in ("preload", "reuse", "first case", "pass", "every rank raises", f"one raises (grace {grace:g} s)", "target"):
        table.add_column(column)
    for row in rows:
        if "pass_s" not in row:
            table.add_row(row["preload"], row["reuse"], "error", row.get("error", ""), "", "", "")
            continue
        met = "; ".join(f"{fault}: {'met' if row[fault]['extra_s'] <= TARGET_S else 'over'}"
                        for fault in ("every", "one") if fault in row)
        table.add_row(row["preload"], row["reuse"], f"{row['first_case_s']:.2f} s", f"{row['pass_s']:.3f} s",
                      _fault_cell(row, "every"), _fault_cell(row, "one"), met)
    Console().print(table)
