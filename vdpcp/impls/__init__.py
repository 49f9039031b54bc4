"""The shipped subjects (one module each) and their registry (registry.py): ``resolve("reference")`` or
``resolve("my_vlm.vision_dp:impl")``; needs.py says which packages each shipped subject takes."""

import warnings

from vdpcp.contract import protocol as _protocol
from vdpcp.impls.needs import unavailable
from vdpcp.impls.registry import BUILT_INS, CURRENT, FIXTURES, GROUP, SHIPPED, ImplError, available, defaults, resolve

__all__ = ["BUILT_INS", "CURRENT", "FIXTURES", "GROUP", "SHIPPED", "ImplError", "available", "defaults", "resolve",
           "unavailable"]

# The contract's names, once re-exported here: for one release, with a DeprecationWarning.
_CONTRACT = ("CHECK_GROUP_ERROR", "GROUP_MISMATCH_TEXT", "Balance", "GroupMismatchError", "Implementation", "KnownLimit",
             "MediaAxes", "MismatchError", "Ownership", "VisionDPConfig", "check_group")


def __getattr__(name: str):
    if name not in _CONTRACT:
        raise AttributeError(f"module 'vdpcp.impls' has no attribute {name!r}")
    warnings.warn(f"vdpcp.impls.{name} moved: import it from vdpcp; the old path goes in the next release",
                  DeprecationWarning, stacklevel=2)
    return getattr(_protocol, name)
