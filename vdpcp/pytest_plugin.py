"""vdpcp's pytest plugin: harness options, the ``run_ranks`` fixture, and the pools' shutdown.

Options: ``--backend {auto,nccl,gloo}`` (default: $VDPCP_BACKEND, else auto) and
``--vdpcp-timeout SECONDS`` per case (default: $VDPCP_TIMEOUT, else 120). The ini setting
``vdpcp_preload`` (default: $VDPCP_PRELOAD, comma-separated) names modules the rank zygote imports once
so that every rank starts with them. A test body runs on every rank; the test names it and a world size::

    def all_ranks_agree(ctx, value): ...          # module level, takes the RankContext first

    def test_agree(run_ranks):                    # or: from vdpcp.harness import run_ranks
        assert run_ranks(all_ranks_agree, 4, 1.5) == [True] * 4

Tests that use the fixture are marked ``distributed`` (``-m "not distributed"`` leaves them out).
Forcing ``--backend nccl`` where there is no GPU per rank skips the case instead of failing it.
"""

import pytest

from vdpcp import harness
from vdpcp.harness.config import BACKENDS


def pytest_addoption(parser):
    group = parser.getgroup("vdpcp", "vdpcp rank harness")
    group.addoption("--backend", choices=BACKENDS, default=None,
                    help="process-group backend for distributed cases (default: $VDPCP_BACKEND or auto: "
                         "nccl with a GPU per rank, else gloo)")
    group.addoption("--vdpcp-timeout", type=float, default=None, metavar="SECONDS",
                    help="seconds before a distributed case counts as hung (default: $VDPCP_TIMEOUT or 120)")
    parser.addini("vdpcp_preload", type="args", default=[],
                  help="modules imported once in the rank zygote, so every rank starts with them")


def pytest_configure(config):
    harness.configure(backend=config.getoption("backend"), timeout=config.getoption("vdpcp_timeout"),
                      preload=config.getini("vdpcp_preload") or None)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if "run_ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.distributed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except harness.BackendUnavailable as err:
        pytest.skip(str(err))


def pytest_sessionfinish(session):
    harness.shutdown()


@pytest.fixture
def run_ranks():
    """vdpcp.harness.run_ranks, for tests that would rather not import it."""
    return harness.run_ranks
