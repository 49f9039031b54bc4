"""May the rank zygote preload these modules? ``python -m vdpcp.harness.forkcheck [--then CODE] [--fork] MODULE...``

The zygote forks every worker, so it refuses a preload that leaves a second OS thread: a child gets a copy
of the memory, locks held by that thread included, but not the thread. Whether a given thread matters is a
measurement, not a rule, so this, in a fresh process with the zygote's one-thread settings:

1. imports the modules in order (then runs ``--then CODE``, e.g. ``torch.cuda.is_available()``) and, for every
   OS thread that appears, reports its name, the module-level statement that was running when it appeared
   (sys.monitoring line events on each module's own code: cheap, and exact to the statement) and the chain
   of imports that led there;
2. with ``--fork``, forks children the way the zygote does and has each one use what a rank would: a tensor
   op on ``--device`` (bf16 matmul, an arange sum read back), two sibling children in a gloo process group
   (all_gather and all_reduce of tensors on that device), and on CUDA a one-rank NCCL group. A child that
   fails or hangs (``--child-timeout``) is reported with its error.

Prints one JSON object. Knows nothing of what the modules are for.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # as the zygote's
TOOL = "vdpcp-forkcheck"


def thread_names() -> dict[int, str]:
    """tid -> OS name, for this process's threads other than the main one."""
    names = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():
            try:
                with open(f"/proc/self/task/{tid}/comm") as comm:
                    names[int(tid)] = comm.read().strip()
            except FileNotFoundError:
                pass
    return names


class ThreadWatch:
    """While active: every OS thread that appears during a module body's statement, with where it appeared."""

    def __init__(self):
        self.appeared: list[dict] = []
        self._known = set(thread_names())
        self._count = len(self._known) + 1
        self._last = ("(before any import)", 0, "")
        self._imports: tuple[str, ...] = ()
        self._exec_module = None

    def __enter__(self):
        import _frozen_importlib_external as external  # the loaders' base class that every .py import goes through

        monitoring = sys.monitoring
        self._tool = next(i for i in (monitoring.PROFILER_ID, 3, 4) if monitoring.get_tool(i) is None)
        monitoring.use_tool_id(self._tool, TOOL)
        monitoring.register_callback(self._tool, monitoring.events.LINE, self._line)
        watch, original = self, external._LoaderBasics.exec_module

        def exec_module(loader, module):
            code = loader.get_code(module.__name__)
            if code is None:
                return original(loader, module)
            monitoring.set_local_events(watch._tool, code, monitoring.events.LINE)  # this body only, not its functions
            outer, watch._imports = watch._imports, (*watch._imports, module.__name__)
            try:
                exec(code, module.__dict__)
            finally:
                watch._imports = outer

        self._exec_module = (external._LoaderBasics, original)
        external._LoaderBasics.exec_module = exec_module
        return self

    def __exit__(self, *_):
        owner, original = self._exec_module
        owner.exec_module = original
        self.check()
        names = thread_names()  # as they are now: a thread may name itself a moment after it starts
        for appeared in self.appeared:
            appeared["threads"] = [names.get(tid, "(ended)") for tid in appeared.pop("tids")]
        sys.monitoring.register_callback(self._tool, sys.monitoring.events.LINE, None)
        sys.monitoring.free_tool_id(self._tool)

    def check(self, at: str = "") -> None:
        """Record threads that appeared since the last statement seen; ``at`` names what ran, if not a statement."""
        count = os.stat("/proc/self/task").st_nlink - 2  # one stat, not a listing: this runs at every statement
        if count == self._count:
            return
        self._count = count
        names = thread_names()
        new = {tid: name for tid, name in names.items() if tid not in self._known}
        self._known = set(names)
        if new:
            file, line, imports = self._last
            self.appeared.append({"tids": sorted(new), "while": at or f"{file}:{line}",
                                  "statement": at or _source_line(file, line), "imports": list(imports)})

    def _line(self, code, line):
        self.check()
        self._last = (code.co_filename, line, self._imports)


def _source_line(file: str, line: int) -> str:
    import linecache

    return linecache.getline(file, line).strip()


def _fork(work) -> tuple[int, int, float]:
    """Fork a child that runs ``work()`` and writes its result (or error) as JSON to a pipe; (pid, pipe, start)."""
    read, write = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        os.close(read)
        import ctypes

        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: a parent killed at its timeout takes this along
        try:
            result = {"ok": True, **(work() or {})}
        except BaseException as err:  # noqa: BLE001 - the child reports every failure
            result = {"ok": False, "error": traceback.format_exception_only(err)[-1].strip()}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    return pid, read, start


def _await(pid: int, read: int, start: float, timeout: float) -> dict:
    """What the child of ``_fork`` reported, or why it reported nothing; it is reaped either way."""
    import select

    chunks, closed = [], False
    while not closed and time.monotonic() - start < timeout:
        if select.select([read], [], [], 0.1)[0]:
            chunk = os.read(read, 1 << 16)
            chunks.append(chunk)
            closed = not chunk
    os.close(read)
    if not closed:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)  # prompt: it has closed its pipe by exiting, or was killed
    seconds = round(time.monotonic() - start, 3)
    if not closed:
        return {"ok": False, "error": f"hung: no answer within {timeout:g} s", "seconds": seconds}
    try:
        return {**json.loads(b"".join(chunks)), "seconds": seconds}
    except ValueError:
        return {"ok": False, "error": f"died: exit status {os.waitstatus_to_exitcode(status)}", "seconds": seconds}


def tensor_op(device: str) -> dict:
    import torch

    x = torch.arange(1024, dtype=torch.float32, device=device)
    total = (x * 2).sum().item()
    a = torch.full((64, 64), 0.5, dtype=torch.bfloat16, device=device)
    product = (a @ a).float().mean().item()  # 64 * 0.25 = 16, exact in bf16
    if total != 1023 * 1024 or product != 16.0:
        raise AssertionError(f"wrong results on {device}: sum {total}, matmul mean {product}")
    return {"bad_fork": bool(getattr(torch.cuda, "_is_in_bad_fork", lambda: False)())}


def gloo_pair(device: str, timeout: float) -> dict:
    """Two sibling children in one gloo group, with collectives of tensors on ``device``."""
    with tempfile.TemporaryDirectory(prefix="vdpcp-forkcheck-") as directory:
        store = os.path.join(directory, "store")

        def rank(r):
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=r, world_size=2)
            try:
                mine = torch.tensor([r + 1.0], device=device)
                gathered = [torch.zeros_like(mine) for _ in range(2)]
                dist.all_gather(gathered, mine)
                dist.all_reduce(mine)
                values = [t.item() for t in gathered], mine.item()
            finally:
                dist.destroy_process_group()
            if values != ([1.0, 2.0], 3.0):
                raise AssertionError(f"rank {r} got {values}, expected ([1.0, 2.0], 3.0)")

        children = [_fork(lambda r=r: rank(r)) for r in range(2)]
        results = [_await(*child, timeout) for child in children]
    failed = [f"rank {r}: {result['error']}" for r, result in enumerate(results) if not result["ok"]]
    return {"ok": not failed, "seconds": max(result["seconds"] for result in results),
            **({"error": "; ".join(failed)} if failed else {})}


def nccl_one_rank() -> dict:
    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="vdpcp-forkcheck-") as directory:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(directory, "store"), 1), rank=0, world_size=1)
        try:
            x = torch.ones(4, device="cuda")
            dist.all_reduce(x)
            total = x.sum().item()
        finally:
            dist.destroy_process_group()
    if total != 4.0:
        raise AssertionError(f"all_reduce over one rank gave {total}, expected 4.0")
    return {}


def fork_checks(device: str, repeats: int, timeout: float) -> dict:
    """Each check in fresh children of this process, one after another; this process itself touches no device."""
    import warnings

    warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning)  # the point
    checks = {f"tensor op #{i + 1}": _await(*_fork(lambda: tensor_op(device)), timeout) for i in range(repeats)}
    checks["gloo pair"] = gloo_pair(device, timeout)
    if device.startswith("cuda"):
        checks["nccl, one rank"] = _await(*_fork(nccl_one_rank), timeout)
    return checks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vdpcp.harness.forkcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="modules to import, in order, after torch")
    parser.add_argument("--then", default="", help="Python code to run after the imports (torch is in scope)")
    parser.add_argument("--fork", action="store_true", help="then fork children and have them use the device")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--repeats", type=int, default=3, help="children running the tensor op (default 3)")
    parser.add_argument("--child-timeout", type=float, default=60.0, help="seconds a child may take (default 60)")
    args = parser.parse_args(argv)
    os.environ.update(ONE_THREAD)

    start = time.monotonic()
    report: dict = {"modules": args.modules, "then": args.then, "threads_before": sorted(thread_names().values()),
                    "env": {k: os.environ[k] for k in ("PYTORCH_NVML_BASED_CUDA_CHECK", "CUDA_VISIBLE_DEVICES") if k in os.environ}}
    with ThreadWatch() as watch:
        import torch

        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        for name in args.modules:
            __import__(name)
        watch.check()
        if args.then:
            try:
                exec(args.then, {"torch": torch})
            except Exception as err:  # noqa: BLE001 - e.g. a CUDA call where there is no GPU: reported, not fatal
                report["then_error"] = traceback.format_exception_only(err)[-1].strip()
            watch.check(at=f"--then {args.then}")
    report.update(import_seconds=round(time.monotonic() - start, 2), appeared=watch.appeared,
                  threads_after=sorted(thread_names().values()), cuda_initialized=torch.cuda.is_initialized())
    if args.fork:
        report["children"] = fork_checks(args.device, args.repeats, args.child_timeout)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
