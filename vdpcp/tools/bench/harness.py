"""Per-case cost of a trivial all_gather case: vdpcp's warm workers vs MultiProcessTestCase.

(a) vdpcp: run_ranks on the warm pool, timed over many cases after a warm-up; the pool's one-off
start-up (zygote import, forks, first process group) is reported apart. (b) torch's
MultiProcessTestCase, which spawns fresh rank processes for every test: a few tests run through
unittest in a subprocess, each timed from startTest to stopTest (the parent's own start-up is left
out, in its favour). Both on gloo, on CPU. torch's test internals need the ``expecttest`` package,
which vdpcp does not depend on; without it (b) is left out, saying so.
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from vdpcp.cli.exit_codes import Exit


def add_arguments(parser) -> None:
    from vdpcp.cli import POSITIVE, RANKS

    parser.add_argument("--cases", type=POSITIVE, default=200, help="warm cases to time (default 200)")
    parser.add_argument("--spawn-tests", type=POSITIVE, default=4,
                        help="MultiProcessTestCase tests to time (default 4; about 6 s each here)")
    parser.add_argument("--world-size", type=RANKS, default=2, help="ranks per case (default 2)")


def run(args) -> int:
    print(f"trivial all_gather case, {args.world_size} ranks, gloo on CPU", flush=True)
    startup_s, warm_s = time_warm_workers(args.world_size, args.cases)
    print(f"  vdpcp warm workers: {args.cases} cases timed", flush=True)
    rows = [("vdpcp warm workers (per case)", f"{warm_s * 1e3:.2f} ms"),
            ("vdpcp pool start-up (once per process)", f"{startup_s:.2f} s")]
    if importlib.util.find_spec("expecttest") is None:
        print("  MultiProcessTestCase left out: torch's test internals need `pip install expecttest`")
    else:
        spawn_s = time_multiprocess_test_case(args.world_size, args.spawn_tests)
        print(f"  MultiProcessTestCase: {len(spawn_s)} tests timed", flush=True)
        per_spawn = sum(spawn_s) / len(spawn_s)
        rows += [("MultiProcessTestCase, spawn per test (per case)", f"{per_spawn:.2f} s"),
                 ("ratio, per case", f"{per_spawn / warm_s:,.0f}x cheaper")]
    _print_table(rows)
    return Exit.PASSED


def gather_ranks(ctx):
    import torch
    import torch.distributed as dist

    gathered = [torch.zeros(1) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, torch.tensor([float(ctx.rank)]), group=ctx.group)
    return [int(t) for t in gathered]


def time_warm_workers(world_size: int, cases: int) -> tuple[float, float]:
    """(one-off pool start-up in s, mean seconds per case once warm)."""
    from vdpcp.harness import run_ranks, shutdown

    expected = [list(range(world_size))] * world_size
    try:
        start = time.perf_counter()
        assert run_ranks(gather_ranks, world_size, backend="gloo") == expected
        startup = time.perf_counter() - start
        for _ in range(5):
            run_ranks(gather_ranks, world_size, backend="gloo")
        start = time.perf_counter()
        for _ in range(cases):
            run_ranks(gather_ranks, world_size, backend="gloo")
        return startup, (time.perf_counter() - start) / cases
    finally:
        shutdown()


# A stock MultiProcessTestCase suite: N identical all_gather tests, each timed by the runner's result.
_SPAWN_SUITE = textwrap.dedent('''
    import json, os, time, unittest
    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    class AllGather(MultiProcessTestCase):
        @property
        def world_size(self):
            return int(os.environ["BENCH_WORLD_SIZE"])

        def setUp(self):
            super().setUp()
            self._spawn_processes()

        def gather(self):
            dist.init_process_group("gloo", init_method=f"file://{self.file_name}",
                                    rank=self.rank, world_size=self.world_size)
            out = [torch.zeros(1) for _ in range(self.world_size)]
            dist.all_gather(out, torch.tensor([float(self.rank)]))
            assert [int(t) for t in out] == list(range(self.world_size))

    for i in range(int(os.environ["BENCH_TESTS"])):
        setattr(AllGather, f"test_all_gather_{i}", AllGather.gather)

    seconds_per_test = []

    class Timed(unittest.TextTestResult):
        def startTest(self, test):
            self.test_started = time.perf_counter()
            super().startTest(test)

        def stopTest(self, test):
            super().stopTest(test)
            seconds_per_test.append(time.perf_counter() - self.test_started)

    if __name__ == "__main__":
        suite = unittest.defaultTestLoader.loadTestsFromTestCase(AllGather)
        result = unittest.TextTestRunner(resultclass=Timed, verbosity=0).run(suite)
        print(json.dumps({"ok": result.wasSuccessful(), "seconds_per_test": seconds_per_test}))
''')


def time_multiprocess_test_case(world_size: int, tests: int) -> list[float]:
    """Seconds each MultiProcessTestCase test took, start of setUp to end of tearDown."""
    with tempfile.TemporaryDirectory(prefix="vdpcp-bench-") as directory:
        script = Path(directory) / "spawn_suite.py"
        script.write_text(_SPAWN_SUITE)
        env = dict(os.environ, BENCH_WORLD_SIZE=str(world_size), BENCH_TESTS=str(tests))
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, cwd=directory)
    report = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    if not report or not report["ok"]:
        raise RuntimeError(f"the MultiProcessTestCase suite failed:\n{done.stdout}\n{done.stderr}")
    return report["seconds_per_test"]


def _print_table(rows: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="vdpcp bench harness")
    table.add_column("what")
    table.add_column("cost", justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
