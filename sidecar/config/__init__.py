"""Layer 3, configuration: read once, validated, immutable, passed in.

The settings (file, then environment, then flags) and the rule each key's
value must follow. It sits above what it validates (the store's tier policy,
whether a named encoder can run) and below everything that reads it.

Importing this package loads no module (see docs/ARCHITECTURE.md).

Owns: nothing but this docstring. Must not touch: the domain, the
edge, operations (the layers above).
"""
