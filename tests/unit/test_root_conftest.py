"""The root conftest.py: the plugin registered exactly once, however pytest was started; this checkout first for
every process the tests start; another checkout's vdpcp a usage error instead of a silent test of its code."""

import os
import subprocess
import sys
from pathlib import Path

import vdpcp
from vdpcp import pytest_plugin

ROOT = Path(__file__).resolve().parents[2]
THIS = f"{Path(__file__).relative_to(ROOT)}::test_the_plugin_is_registered_once_and_the_root_conftest_is_loaded"


def test_the_plugin_is_registered_once_and_the_root_conftest_is_loaded(request):
    manager = request.config.pluginmanager
    assert [p for _, p in manager.list_name_plugin() if p is pytest_plugin] == [pytest_plugin]
    assert any(getattr(p, "__file__", None) == str(ROOT / "conftest.py") for p in manager.get_plugins())
    assert request.getfixturevalue("run_ranks") is not None  # the plugin's fixture is there


def test_pytest_n_schedules_by_work_stealing_unless_another_dist_is_asked_for(request):
    from xdist.scheduler import WorkStealingScheduling

    (root,) = [p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == str(ROOT / "conftest.py")]

    class Asked:  # what xdist's controller reads of its config to build a scheduler
        def __init__(self, dist):
            self.option = type("Options", (), {"dist": dist, "tx": ["2*popen"]})()  # as -n 2 sets it

        def getoption(self, name):
            return getattr(self.option, name)

        getvalue = getoption

    assert isinstance(root.pytest_xdist_make_scheduler(Asked("load"), None), WorkStealingScheduling)
    assert root.pytest_xdist_make_scheduler(Asked("loadfile"), None) is None  # xdist's own, as asked


def test_this_checkout_is_what_runs_here_and_first_for_subprocesses():
    assert Path(vdpcp.__file__).resolve().parent.parent == ROOT
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def _pytest(cwd, *args, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VDPCP_"))} | env
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=cwd,
                          env=environment, capture_output=True, text=True, timeout=120)


def test_a_checkout_never_installed_gets_the_plugin_from_the_root_conftest(tmp_path):
    ran = _pytest(tmp_path, str(ROOT / THIS), PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    assert ran.returncode == 0 and "1 passed" in ran.stdout, ran.stdout + ran.stderr


def test_another_checkouts_vdpcp_is_a_usage_error_naming_both(tmp_path):
    """An environment installed from another checkout: its pytest11 entry point imports that vdpcp before any
    conftest runs. Made here (a dist-info beside the other package), so the test means the same wherever it runs: on
    a GPU machine where vdpcp was never installed, pytest's own import of the root conftest put this checkout first
    and the other vdpcp was never imported (1 passed, measured on the H200)."""
    other = tmp_path / "other"
    (other / "vdpcp").mkdir(parents=True)
    (other / "vdpcp" / "__init__.py").write_text("")
    (other / "vdpcp" / "pytest_plugin.py").write_text("")
    installed = other / "vdpcp-0.0.1.dist-info"
    installed.mkdir()
    (installed / "METADATA").write_text("Metadata-Version: 2.1\nName: vdpcp\nVersion: 0.0.1\n")
    (installed / "entry_points.txt").write_text("[pytest11]\nvdpcp = vdpcp.pytest_plugin\n")
    ran = _pytest(tmp_path, str(ROOT / THIS), PYTHONPATH=str(other))
    assert ran.returncode == 4, ran.stdout + ran.stderr  # pytest's usage error
    assert f"vdpcp is imported from {other}, not from this checkout {ROOT}" in ran.stdout + ran.stderr
