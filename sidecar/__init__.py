"""memory-sidecar: a gRPC daemon that owns an AI agent's long-term memory.

One package per layer, bottom up: core, storage, retrieval, config, domain,
api (the gRPC and MCP edge) and ops (CLI, admin, start-up); a module imports
only its own package or a lower one. docs/ARCHITECTURE.md holds the tree
(tests/test_architecture.py checks it against the files and their imports)
and the paths of a write and of a turn. _proto holds the generated stubs.

Owns: __version__, and the BLAS thread default below; importing the package
loads no module. Must not touch: anything of the layers (a module here would
sit above them all).
"""

import os

# One BLAS thread unless the operator chose otherwise (OPENBLAS_NUM_THREADS
# or OMP_NUM_THREADS), set before any module
# here imports numpy (OpenBLAS reads it once, when loaded). Its own threads
# spin for a core the daemon's threads share: on two cores the local encoder
# took ~10 times the CPU for a short text, and 5 to 25 times as long.
# deploy/Dockerfile sets it too; this covers a daemon started anywhere else.
# OpenBLAS reads OPENBLAS_NUM_THREADS before OMP_NUM_THREADS: an operator's
# OMP_NUM_THREADS must not be overridden by this default.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"

__all__ = ["__version__"]
