"""Layer 0, the core: the vocabulary every layer speaks.

The entries and their scopes and tiers (memory), the one exception root and its
typed leaves (errors), the injected clock, request limits, token counting,
every metric, and two small thread-safe caches. Nothing here imports another
layer, a database driver, grpc or the MCP SDK.

Importing this package loads no module (see docs/ARCHITECTURE.md).

Owns: nothing but this docstring. Must not touch: any other layer.
"""
