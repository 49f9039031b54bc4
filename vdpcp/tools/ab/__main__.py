"""`python -m vdpcp.tools.ab ARGS` runs `vdpcp ab ARGS` (for a GPU machine where vdpcp is not installed)."""

import sys

from vdpcp.cli import main

sys.exit(main(["ab", *sys.argv[1:]]))
