"""`python -m sidecar`: the `memory-sidecar` command.

Owns: nothing but the call. Must not touch: anything the CLI does (sidecar.ops.cli).
"""

import sys

from sidecar.ops.cli import main

sys.exit(main())
