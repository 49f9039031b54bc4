"""Distributed cases start their rank workers with MCore already imported (see vdpcp.runner.RANK_PRELOAD)."""

from vdpcp.runner import preload_case_modules


def pytest_configure(config):
    preload_case_modules()
