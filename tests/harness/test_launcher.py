"""Under torchrun, run_ranks runs each case in-process on every rank of the job (see launcher.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

from vdpcp.harness import launcher

REPO = Path(__file__).resolve().parents[2]


def test_torchrun_runs_the_same_cases_on_every_rank():
    env = {name: value for name, value in os.environ.items() if name not in launcher.LAUNCHER_ENV}
    env.pop("VDPCP_HARNESS_WORKER", None)
    cases = Path(__file__).with_name("launched_cases.py").relative_to(REPO)
    job = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pytest", "-q", "-p", "no:xdist", "--backend", "gloo", str(cases)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    assert re.findall(r"(\d+) passed", output) == ["3", "3"], output
