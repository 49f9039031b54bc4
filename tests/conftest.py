"""Rank workers start with the case modules and the imports of the built-ins (MCore) and of the Qwen2.5-VL
adapter tested in tests/impls (transformers) preloaded: one import per pool, not one per rank."""

from vdpcp.impls import BUILT_INS
from vdpcp.runner import preload_case_modules


def pytest_configure(config):
    # The plugin's session settings scope it: restored at pytest_unconfigure.
    preload_case_modules((*BUILT_INS, "qwen2_5_vl"))
