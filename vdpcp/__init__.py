"""vdpcp: a distributed correctness suite for vision DP over CP.

What a user's implementation and tests import comes from here; every other module is vdpcp's own and may change.

    from vdpcp import Implementation, check_group          # the contract a subject implements
    from vdpcp import assert_case, params, expand          # the matrix in your pytest or unittest suite
    from vdpcp import capture_on_failure                   # a training step's failing microbatch, saved for replay

Names load on first use, so ``import vdpcp`` (and ``vdpcp --help``) imports no torch.
"""

import importlib

from vdpcp import _deprecated
from vdpcp.third_party import silence_import_notices

_deprecated.install()  # the paths modules had before they were grouped by job, for one release

# Here rather than at each entry point: the CLI, pytest (through vdpcp's plugin), the rank zygote and the
# ranks it forks all import vdpcp before anything can import megatron.
silence_import_notices()

# name -> the module that defines it
_PUBLIC = {
    **dict.fromkeys(("Implementation", "VisionDPConfig", "KnownLimit", "Ownership", "MediaAxes", "Balance",
                     "MismatchError", "GroupMismatchError", "check_group", "CHECK_GROUP_ERROR", "GROUP_MISMATCH_TEXT",
                     "MAIN_OUTPUT", "outputs_of"), "vdpcp.contract.protocol"),
    "Sizing": "vdpcp.contract.sizing",
    **dict.fromkeys(("ImplError", "resolve", "available", "unavailable"), "vdpcp.impls.registry"),
    "BridgeEncoder": "vdpcp.impls.bridge",
    "BridgeQwen3VL": "vdpcp.impls.bridge_qwen3_vl",
    **dict.fromkeys(("assert_case", "params", "param", "cases", "expand", "KnownUpstreamLimit"), "vdpcp.testing"),
    "capture_on_failure": "vdpcp.tools.capture",  # not `capture`: that is the submodule's name
    **dict.fromkeys(("run_ranks", "RankContext", "RankFailure"), "vdpcp.harness"),
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'vdpcp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
