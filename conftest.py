"""What this checkout's own tests need from the repository root, however pytest was started.

- This checkout's code, in-process: vdpcp's pytest11 entry point imports vdpcp before any conftest runs, so in a
  shared environment installed from another checkout (an editable install points at one folder) a bare
  ``pytest`` would test that checkout's code and say nothing. That is a usage error here, naming both folders.
- This checkout's code in every process the tests start (the rank zygote, CLI subprocesses, torchrun): the root
  first on PYTHONPATH, so vdpcp and the tests' own ``tests.*:object`` implementations import from here whatever
  the current folder is (``./run`` sets it already; tox or a bare venv may not).
- Work stealing for ``pytest -n``: xdist's default ``load`` deals tests out in turn, so every worker would run the
  matrix's CP 8 cases at once, more ranks than cores; work stealing gives each worker a contiguous half and
  rebalances only at the end. ``--dist`` other than load is left as asked.
- vdpcp's pytest plugin exactly once: the pytest11 entry point registers it where vdpcp is installed; a checkout
  that never was (PYTHONPATH only) or ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` gets it registered here, never twice
  (registering it again under another name is the error pytest raised when this file listed it in
  ``pytest_plugins``), and never against ``-p no:vdpcp``.
"""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def imported_from() -> Path:
    """The checkout the imported vdpcp package lives in."""
    import vdpcp

    return Path(vdpcp.__file__).resolve().parent.parent


def pytest_addoption(parser, pluginmanager):
    # Here, as this file is registered, not at pytest_configure: the conftests below this one import vdpcp's modules,
    # and where no editable install maps them to this checkout they would fail on the other one's first.
    if imported_from() != ROOT:
        raise pytest.UsageError(f"vdpcp is imported from {imported_from()}, not from this checkout {ROOT}, so these "
                                f"tests would test that code: run ./run pytest, or python -m pytest from {ROOT}")
    from vdpcp import pytest_plugin

    if not pluginmanager.is_registered(pytest_plugin) and not pluginmanager.is_blocked("vdpcp"):
        pluginmanager.register(pytest_plugin, "vdpcp")


def pytest_configure(config):
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if paths[0] != str(ROOT):
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *(p for p in paths if p)])


@pytest.hookimpl(optionalhook=True)  # only where pytest-xdist is installed
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)
