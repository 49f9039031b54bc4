import sys

from vdpcp.cli import main

sys.exit(main())
