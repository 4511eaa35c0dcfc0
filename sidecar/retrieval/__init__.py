"""Layer 2, retrieval: functions and structures over entries.

Keyword terms, BM25 ranking and its pruning, a tier held in full or
compactly (and the compact index's persisted form), semantic vectors, near
duplicates, the content scanner and block rendering. It reads the store only
where it must (a compact tier fetches the entries it returns) and knows
nothing of sessions, snapshots or gRPC.

Importing this package loads no module (see docs/ARCHITECTURE.md).

Owns: nothing but this docstring. Must not touch: sessions,
snapshots, configuration, gRPC (the layers above).
"""
