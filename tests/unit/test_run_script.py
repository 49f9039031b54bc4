"""`./run` imports the code of the checkout it was started from, whatever else shares its environment: two
checkouts that differ, run at the same time, each test their own code (issue: shared-venv cross-talk)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The files that key the environment, in the order ./run reads them.
KEYED = ("pyproject.toml", ".python-version", "requirements/no-deps.txt", "requirements/releases.txt")


def _clone(tmp_path: Path, name: str, marker: str) -> Path:
    target = tmp_path / name
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(target)], check=True)
    cli = target / "vdpcp" / "cli" / "__init__.py"
    cli.write_text(cli.read_text().replace('"""`vdpcp` command line', f'"""`vdpcp` command line {marker}', 1))
    return target


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_two_checkouts_running_at_once_each_import_their_own_code(tmp_path):
    a, b = _clone(tmp_path, "a", "CHECKOUT-A"), _clone(tmp_path, "b", "CHECKOUT-B")
    env = {**os.environ, "VDPCP_ENV_CACHE": str(_shared_environment(tmp_path / "cache", a))}
    runs = {name: subprocess.Popen([str(root / "run"), "python", "-m", "vdpcp", "--help"], stdout=subprocess.PIPE,
                                   text=True, env=env)
            for name, root in (("A", a), ("B", b))}
    printed = {name: run.communicate(timeout=120)[0] for name, run in runs.items()}
    assert "CHECKOUT-A" in printed["A"] and "CHECKOUT-B" not in printed["A"], printed["A"]
    assert "CHECKOUT-B" in printed["B"] and "CHECKOUT-A" not in printed["B"], printed["B"]
    where = subprocess.run([str(a / "run"), "python", "-c", "import vdpcp; print(vdpcp.__file__)"],
                           capture_output=True, text=True, check=True, env=env).stdout.strip()
    assert where == str(a / "vdpcp" / "__init__.py")


def _shared_environment(cache: Path, root: Path) -> Path:
    """The one environment both clones' ./run choose (their pyproject.toml are the same), made of the interpreter
    running these tests, so nothing is built: where the suite runs outside ./run (a GPU machine with no package
    index, measured on the H200) ./run would otherwise try to build one in the test."""
    python = cache / f"venv-{_environment_key(root)}" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (python.parent.parent / ".complete").touch()
    return cache


def _declared_torch_floor() -> str:
    import tomllib

    from packaging.requirements import Requirement

    for dependency in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(dependency)
        if requirement.name == "torch":
            return next(spec.version for spec in requirement.specifier if spec.operator == ">=")
    raise AssertionError("pyproject.toml declares no torch>= floor")


def _script_copy(tmp_path: Path, pyproject: str) -> Path:
    """./run beside a pyproject.toml of our own, so its environment key and floor are ours to choose."""
    root = tmp_path / "checkout"
    root.mkdir()
    shutil.copy(REPO / "run", root / "run")
    shutil.copy(REPO / ".python-version", root / ".python-version")
    (root / "requirements").mkdir()
    for name in KEYED[2:]:
        shutil.copy(REPO / name, root / name)
    (root / "pyproject.toml").write_text(pyproject)
    return root


def _environment_key(root: Path) -> str:
    import hashlib

    keyed = b"".join((root / name).read_bytes() for name in KEYED)
    return hashlib.sha256(keyed).hexdigest()[:12]


def test_vdpcp_torch_oldest_is_an_environment_of_its_own_with_the_declared_floor(tmp_path):
    """Nothing is built: the environment the key names is there already (marked complete), so ./run only
    chooses it; the oldest-torch job tests whatever floor pyproject.toml declares, never a copy of it."""
    root = _script_copy(tmp_path, (REPO / "pyproject.toml").read_text())
    cache, key, floor = tmp_path / "cache", _environment_key(root), _declared_torch_floor()
    for name in (f"venv-{key}", f"venv-{key}-torch{floor}"):
        (cache / name).mkdir(parents=True)
        (cache / name / ".complete").touch()

    def chosen(**env) -> str:
        base = {k: v for k, v in os.environ.items() if k != "VDPCP_TORCH"}  # this very job may run under it
        run = subprocess.run([str(root / "run"), "sh", "-c", "echo $VIRTUAL_ENV"], capture_output=True, text=True,
                             env={**base, "VDPCP_ENV_CACHE": str(cache), **env}, check=True)
        return run.stdout.strip()

    assert chosen() == str(cache / f"venv-{key}")
    assert chosen(VDPCP_TORCH="oldest") == str(cache / f"venv-{key}-torch{floor}")


def test_vdpcp_torch_oldest_without_a_declared_floor_is_one_clear_error(tmp_path):
    root = _script_copy(tmp_path, '[project]\nname = "x"\ndependencies = ["torch"]\n')
    run = subprocess.run([str(root / "run"), "true"], capture_output=True, text=True,
                         env={**os.environ, "VDPCP_ENV_CACHE": str(tmp_path / "cache"), "VDPCP_TORCH": "oldest"})
    assert run.returncode == 2
    assert run.stderr.strip() == 'vdpcp: VDPCP_TORCH=oldest, but pyproject.toml declares no "torch>=X" dependency'
