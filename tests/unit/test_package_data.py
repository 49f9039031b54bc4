"""An installed vdpcp runs the checkout's matrix: what it reads at run time (dataset fixtures, saved regressions)
is package data, so a wheel installed anywhere lists exactly the checkout's cases."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from vdpcp import cli
from vdpcp.matrix import scenarios

REPO = Path(__file__).resolve().parents[2]
SELECTION = ["check", "--list", "--impl", "reference", "mcore"]


def build_wheel(into: Path) -> Path:
    """vdpcp's wheel, built from a copy of this checkout's sources (a build in place would write into the checkout)."""
    source = into / "source"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "vdpcp", source / "vdpcp", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(into),
                    str(source)], check=True, capture_output=True, text=True, timeout=300)
    [wheel] = into.glob("vdpcp-*.whl")
    return wheel


def test_the_wheel_carries_every_file_the_matrix_reads_and_lists_the_checkouts_cases(tmp_path, capsys):
    wheel = build_wheel(tmp_path)
    carried = set(zipfile.ZipFile(wheel).namelist())
    read = {f"vdpcp/fixtures/{path.relative_to(scenarios.FIXTURES).as_posix()}"
            for path, _ in scenarios.fixture_specs()}
    assert read and read <= carried, f"not in the wheel: {sorted(read - carried)}"

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy alone, not this checkout
    where = subprocess.run([sys.executable, "-c", "import vdpcp, json; print(json.dumps(vdpcp.__file__))"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, timeout=120, check=True)
    assert Path(json.loads(where.stdout)).is_relative_to(site)
    installed = subprocess.run([sys.executable, "-m", "vdpcp", *SELECTION], cwd=elsewhere, env=env,
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr

    assert cli.main(SELECTION) == 0
    assert installed.stdout.split() == capsys.readouterr().out.split()
