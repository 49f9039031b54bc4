"""`./run` imports the code of the checkout it was started from, whatever else shares its environment: two
checkouts that differ, run at the same time, each test their own code (issue: shared-venv cross-talk)."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _clone(tmp_path: Path, name: str, marker: str) -> Path:
    target = tmp_path / name
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(target)], check=True)
    cli = target / "vdpcp" / "cli" / "__init__.py"
    cli.write_text(cli.read_text().replace('"""`vdpcp` command line', f'"""`vdpcp` command line {marker}', 1))
    return target


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_two_checkouts_running_at_once_each_import_their_own_code(tmp_path):
    a, b = _clone(tmp_path, "a", "CHECKOUT-A"), _clone(tmp_path, "b", "CHECKOUT-B")
    runs = {name: subprocess.Popen([str(root / "run"), "vdpcp", "--help"], stdout=subprocess.PIPE, text=True)
            for name, root in (("A", a), ("B", b))}
    printed = {name: run.communicate(timeout=120)[0] for name, run in runs.items()}
    assert "CHECKOUT-A" in printed["A"] and "CHECKOUT-B" not in printed["A"], printed["A"]
    assert "CHECKOUT-B" in printed["B"] and "CHECKOUT-A" not in printed["B"], printed["B"]
    where = subprocess.run([str(a / "run"), "python", "-c", "import vdpcp; print(vdpcp.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where == str(a / "vdpcp" / "__init__.py")
