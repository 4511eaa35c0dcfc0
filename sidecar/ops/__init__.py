"""Layer 6, operations: how a person or a process runs the sidecar.

The CLI, the daemon's start-up and shutdown, waiting for a database,
operator commands (check, backup, import, export, ...), importing cagent's
files, the console, and the MCP stdio bridge.

Importing this package loads no module (see docs/ARCHITECTURE.md).

Owns: nothing but this docstring. Must not touch: SQL (storage's),
the status mapping (api's).
"""
