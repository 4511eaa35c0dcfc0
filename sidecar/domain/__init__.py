"""Layer 4, the domain: what the sidecar does, whoever asks.

The engine is the facade the edges call; behind it the partition cache and
its freshness, the compact index's life, snapshots and sessions, turns,
expiry, export, watches, erasure, replication, and the model's tools. No
module here imports grpc or the MCP SDK.

Importing this package loads no module (see docs/ARCHITECTURE.md).

Owns: nothing but this docstring. Must not touch: grpc, the MCP SDK,
the edge and operations (the layers above).
"""
