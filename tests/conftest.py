"""Rank workers start with the case modules and the built-in implementations' imports (MCore) preloaded."""

from vdpcp.impls import BUILT_INS
from vdpcp.runner import preload_case_modules


def pytest_configure(config):
    preload_case_modules(BUILT_INS)  # the plugin's session settings scope it: restored at pytest_unconfigure
