"""Entries' embeddings as stored: read per partition, found missing, and
stored apart from any write (the backfill).

Reached as `store.vectors`. A vector written with its entry is stored by
that write (Store.add, Store.update), in its transaction; encoding text is
sidecar.retrieval.embedding's and holding vectors in memory sidecar.retrieval.semantic's, which
this module never imports (nor the engine, service, server, ranking or
compact). One of the storage modules, the only code that touches Peewee
(see sidecar.storage.store).

Like the store's, every method opens a pooled connection for its own
duration.

Owns: Vector (an embedding as stored: its model and bytes) and VectorStore
(a partition's vectors read, the entries without one, the backfill's
writes). Must not touch: encoding or the vectors held in memory
(sidecar.retrieval), the write that stores an entry's vector with it
(sidecar.storage.store).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sidecar.core.memory import Tier
from sidecar.storage._tables import Tables


class Vector(NamedTuple):
    """An entry's embedding as stored: the encoder's name and its float16
    components (sidecar.retrieval.embedding)."""

    model: str
    data: bytes


class VectorStore:
    """The vectors of one store's entries, per encoder (`model`)."""

    def __init__(self, tables: Tables) -> None:
        self._backend = tables.backend
        self._db = tables.db
        self._guard = tables.backend.guard

    def of(self, tier: Tier, owner: str, model: str) -> tuple[list[int], list[bytes]]:
        """The seqs (ascending) of the partition's entries that have a
        current vector of this model, and those vectors, from one snapshot."""
        seqs: list[int] = []
        data: list[bytes] = []
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            for rows in self._backend.vectors(owner, tier.value, model):
                for seq, vector in rows:
                    seqs.append(int(seq))
                    data.append(bytes(vector))
        return seqs, data

    def unembedded(
        self,
        model: str,
        after: int,
        limit: int,
        *,
        below: int | None = None,
        size: int | None = None,
    ) -> list[tuple[int, str, str]]:
        """(seq, content, digest) of up to `limit` entries after seq `after`
        that lack a vector of this model for their current content; with
        `below`, only of tiers of fewer entries than that; with `size`, a
        vector of another size in bytes counts as none."""
        with self._guard(), self._db.connection_context():
            rows = self._backend.unembedded(model, after, limit, below, size)
        return [(int(seq), str(content), str(digest)) for seq, content, digest in rows]

    def put(self, model: str, vectors: Sequence[tuple[int, str, bytes]]) -> None:
        """Store (seq, digest, vector) rows computed apart from any write;
        a row whose entry is gone or now says something else is skipped."""
        if not vectors:
            return
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            for seq, digest, data in vectors:
                self._backend.put_vector_if_current(seq, model, digest, data)
