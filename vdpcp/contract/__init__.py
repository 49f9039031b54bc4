"""The contract: what an implementation of vision DP over CP meets to be held to vdpcp's matrix.

protocol.py is the contract itself (``Implementation``, its declarations and ``check_group``), sizing.py what a
subject's tower costs a case (``Sizing``, reached as ``impl.sizing``); the adapters users
subclass for a Megatron-style encoder live with the shipped subjects (vdpcp.impls.bridge). Import these names from
``vdpcp``.
"""

from vdpcp.contract.protocol import (
    CHECK_GROUP_ERROR,
    GROUP_MISMATCH_TEXT,
    MAIN_OUTPUT,
    Balance,
    GroupMismatchError,
    Implementation,
    KnownLimit,
    MediaAxes,
    MismatchError,
    Ownership,
    VisionDPConfig,
    check_group,
    outputs_of,
)
from vdpcp.contract.sizing import Sizing

__all__ = ["CHECK_GROUP_ERROR", "GROUP_MISMATCH_TEXT", "MAIN_OUTPUT", "Balance", "GroupMismatchError", "Implementation",
           "KnownLimit", "MediaAxes", "MismatchError", "Ownership", "Sizing", "VisionDPConfig", "check_group", "outputs_of"]
