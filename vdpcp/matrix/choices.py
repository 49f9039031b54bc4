"""A case's choices by name, imported by the case and by the command line: a leaf without torch, so that
`vdpcp --help` can offer them without importing it."""

DTYPES = ("float64", "float32", "bfloat16")  # the dtypes a case runs in (vdpcp.oracle.TORCH_DTYPES: as torch's)
LOSSES = ("rank", "zigzag")  # how a case's text stream is split over the CP ranks (vdpcp.feature.loss)
