"""Layer 5, the API edge: gRPC and MCP.

Servers and their listeners, the gRPC service (validate, call the engine,
render), the streaming RPCs, interceptors (auth, metrics, the one mapping of
errors to status codes), tokens and their reloading, paging, tracing, and
the MCP surface and its HTTP listener.

Importing this package loads no module (see docs/ARCHITECTURE.md).

Owns: nothing but this docstring. Must not touch: operations (the
layer above), SQL (storage's).
"""
