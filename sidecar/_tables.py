"""The handle the storage modules share: one database's tables, and the
row-level steps every write takes inside its transaction.

Store builds one Tables in __init__ and hands it to IndexStore and
VectorStore; sidecar.archive reaches it as `store.tables`. Private to the
storage modules (store, schema, index_store, vector_store, archive), the
only code that touches Peewee: nothing above them may use it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar import _sqlite
from sidecar._backend import Backend, PartitionState
from sidecar._statements import Record, Statements, Template
from sidecar.clock import from_micros
from sidecar.memory import Memory, Tier, Usage, rendered_chars
from sidecar.schema import _bind, _Key, _Row

# Seqs per `IN (...)` list (SQLite allows 32,766 parameters; PostgreSQL 65,535).
_SEQ_BATCH = 500


class Tables:
    """One store's backend (its connection pool, transactions and error
    guard), its Peewee database, the models bound to it and the hot paths'
    statements on them.

    The methods open nothing: call them inside a connection, and those that
    write inside the transaction that locked the partition's state row.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.db = backend.db
        self.rows = _bind(_Row, self.db, "memories")
        self.keys = _bind(_Key, self.db, "idempotency_keys")
        self.sql = Statements(self.rows)

    def rows_of(self, template: Template, **values: object) -> list[Record]:
        cursor = self.db.execute_sql(template.sql, template.params(**values))
        return [Record(*row) for row in cursor.fetchall()]

    def records_by_seq(self, owner: str, tier: Tier, seqs: Sequence[int]) -> list[Record]:
        """The partition's rows with these seqs (those that exist), read
        `_SEQ_BATCH` at a time."""
        records: list[Record] = []
        for start in range(0, len(seqs), _SEQ_BATCH):
            sql, params = self.sql.by_seqs(owner, tier.value, seqs[start : start + _SEQ_BATCH])
            records.extend(Record(*row) for row in self.db.execute_sql(sql, params).fetchall())
        return records

    def advance(
        self, owner: str, tier: Tier, after: PartitionState, seqs: Sequence[int] = ()
    ) -> int:
        """Store the partition's new state; return its generation. (A trigger
        logs the entries the write changed, if the partition's changes are
        logged.) A bulk write (no seqs) drops the partition's compact index:
        indexing its rows again is cheaper than replaying the log."""
        generation = self.backend.advance(owner, tier.value, after.content_chars, after.entry_count)
        if after.indexed and not seqs:
            self.backend.drop_index(owner, tier.value)
        return generation

    def identical(self, owner: str, tier: Tier, content: str) -> Record | None:
        """The first entry of this owner and tier with exactly this content."""
        rows = self.rows_of(
            self.sql.identical,
            owner=owner,
            tier=tier.value,
            digest=_sqlite.content_digest(content),
            content=content,
        )
        return rows[0] if rows else None

    def insert(
        self,
        memory_id: str,
        owner: str,
        tier: Tier,
        content: str,
        category: str,
        confidence: float,
        created_at: int,
        updated_at: int | None = None,
    ) -> Record:
        row = Record(
            0,
            memory_id,
            tier.value,
            owner,
            content,
            len(content),
            category,
            float(confidence),
            created_at,
            created_at if updated_at is None else updated_at,
        )
        cursor = self.db.execute_sql(
            self.sql.insert.sql,
            self.sql.insert.params(
                memory_id=row.memory_id,
                tier=row.tier,
                owner=row.owner,
                content=row.content,
                content_chars=row.content_chars,
                content_sha256=_sqlite.content_digest(content),
                category=row.category,
                confidence=row.confidence,
                created_at=row.created_at,
                updated_at=row.updated_at,
            ),
        )
        return row._replace(seq=self.backend.inserted_seq(cursor))


def usage_of(state: PartitionState) -> Usage:
    return Usage(rendered_chars(state.content_chars, state.entry_count), state.entry_count)


def to_memory(row: _Row | Record) -> Memory:
    return Memory(
        id=row.memory_id,
        tier=Tier(row.tier),
        content=row.content,
        category=row.category,
        confidence=row.confidence,
        created_at=from_micros(row.created_at),
        updated_at=from_micros(row.updated_at),
        seq=row.seq,
    )
