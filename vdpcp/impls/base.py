"""The protocol, where adapters written before it moved import it from: everything lives in vdpcp.protocol."""

from vdpcp.protocol import (  # noqa: F401  (re-exported)
    CHECK_GROUP_ERROR,
    GROUP_MISMATCH_TEXT,
    PROTOCOL,
    REQUIRED,
    Adapted,
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
