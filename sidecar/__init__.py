"""memory-sidecar: a gRPC daemon that owns an AI agent's long-term memory.

One flat package in layers, bottom up; a module imports only its own layer or
lower ones. docs/ARCHITECTURE.md holds the table (tests/test_architecture.py
checks it against the imports) and the paths of a write and of a turn.

- foundation: the vocabulary (memory), errors, clock, limits, tokens, metrics,
  and the small caches (_caches).
- storage: the only code on Peewee/SQL: store, over its backends (_backend,
  _sqlite, _postgres, _statements), and the change feed (changes).
- retrieval: keywords, llm, embedding, semantic, scanner, blocks, ranking and
  compact: functions and structures over entries, no sessions, no gRPC.
- configuration: config, read once and passed in.
- domain: engine, a thin orchestrator over partitions, indexer, snapshots,
  sessions, queries and turns. No grpc.
- edge: server, service, interceptors, access, paging, tracing.
- operations: cli, daemon, admin, cagent, console.

Owns: __version__, and the BLAS thread default below; importing the package
loads no module.
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
