"""The handle the storage modules share: one database's tables, and the
row-level steps every write takes inside its transaction.

Store builds one Tables in __init__ and hands it to IndexStore and
VectorStore; sidecar.storage.archive reaches it as `store.tables`. Private to the
storage modules (store, index, vectors, expiry, events, erasure, archive),
the only code that touches Peewee: nothing above them may use it.

Owns: Tables (the models bound to one database, the prepared statements,
the steps a write takes on rows: insert, find by id or match, advance,
log), and the row-to-Memory mapping (to_memory, usage_of). Must not touch:
transactions or locks (each caller opens its own, and calls inside it),
the budget and the writes' other checks (sidecar.storage.store,
sidecar.storage.writes), anything above the storage layer.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from peewee import fn

from sidecar.core.clock import Clock, from_micros, system_clock, to_micros
from sidecar.core.errors import AmbiguousMatch, MatchNotFound, NotFound
from sidecar.core.memory import Memory, Scope, Tier, Usage, rendered_chars
from sidecar.storage import _sqlite
from sidecar.storage._backend import ROWS_PER_INSERT, Backend, PartitionState
from sidecar.storage._statements import KEEP_EXPIRED, Record, Statements, Template, unexpired
from sidecar.storage.schema import _bind, _Key, _Row
from sidecar.storage.writes import NewEntry

# Seqs per `IN (...)` list (SQLite allows 32,766 parameters; PostgreSQL 65,535).
_SEQ_BATCH = 500


class Tables:
    """One store's backend (its connection pool, transactions and error
    guard), its Peewee database, the models bound to it and the hot paths'
    statements on them.

    The methods open nothing: call them inside a connection, and those that
    write inside the transaction that locked the partition's state row.
    """

    def __init__(self, backend: Backend, clock: Clock = system_clock) -> None:
        self.backend = backend
        self.clock = clock
        self.db = backend.db
        self.rows = _bind(_Row, self.db, "memories")
        self.keys = _bind(_Key, self.db, "idempotency_keys")
        self.sql = Statements(self.rows)

    def now(self) -> int:
        """The injected clock's time in microseconds: what has expired by now
        is never read back."""
        return to_micros(self.clock())

    def rows_of(self, template: Template, **values: object) -> list[Record]:
        cursor = self.db.execute_sql(template.sql, template.params(**values))
        return [Record(*row) for row in cursor.fetchall()]

    def taken(self, memory_id: str) -> bool:
        """Whether an entry (expired or not) has this id: ids are unique
        store-wide. A pre-rendered statement: a restore or an import asks
        once per entry, and building the query through Peewee each time
        took most of their time."""
        template = self.sql.taken
        cursor = self.db.execute_sql(template.sql, template.params(id=memory_id))
        return cursor.fetchone() is not None

    def taken_of(self, memory_ids: Sequence[str]) -> set[str]:
        """Which of these ids an entry (expired or not) has: `taken` for a
        batch, in one statement per ROWS_PER_INSERT ids."""
        Row = self.rows  # noqa: N806 - a bound model class
        found: set[str] = set()
        for start in range(0, len(memory_ids), ROWS_PER_INSERT):
            batch = list(memory_ids[start : start + ROWS_PER_INSERT])
            sql, params = Row.select(Row.memory_id).where(Row.memory_id.in_(batch)).sql()
            found.update(row[0] for row in self.db.execute_sql(sql, params).fetchall())
        return found

    def insert_many(self, rows: Sequence[Record]) -> None:
        """Insert these rows (their seq is ignored: the store draws it), a
        multi-row INSERT per ROWS_PER_INSERT rows: a bulk write's round trips
        are per batch, not per row (on PostgreSQL they were most of a
        restore's time)."""
        insert = self.sql.insert
        for start in range(0, len(rows), ROWS_PER_INSERT):
            batch = rows[start : start + ROWS_PER_INSERT]
            params = [
                value
                for row in batch
                for value in insert.params(
                    memory_id=row.memory_id,
                    tier=row.tier,
                    owner=row.owner,
                    content=row.content,
                    content_chars=len(row.content),
                    content_sha256=_sqlite.content_digest(row.content),
                    category=row.category,
                    confidence=float(row.confidence),
                    created_at=row.created_at,
                    updated_at=row.updated_at,
                    expires_at=row.expires_at,
                    # A restored row's writer is unknown (schema 10).
                    written_for_user_id=None,
                    written_in_session=None,
                )
            ]
            self.db.execute_sql(self.sql.insert_rows(len(batch)), params)

    def records_by_seq(
        self, owner: str, tier: Tier, seqs: Sequence[int], now: int = KEEP_EXPIRED
    ) -> list[Record]:
        """The partition's rows with these seqs (those that exist and have
        not expired by `now`), read `_SEQ_BATCH` at a time."""
        records: list[Record] = []
        for start in range(0, len(seqs), _SEQ_BATCH):
            batch = seqs[start : start + _SEQ_BATCH]
            sql, params = self.sql.by_seqs(owner, tier.value, batch, now)
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

    def logged(
        self, owner: str, tier: Tier, generation: int, kind: str, memory_id: str, at: int
    ) -> None:
        """Append the write's event for WatchMemories (kind: add, update,
        delete, expire, erase). Inside the write's transaction, after advance."""
        self.backend.append_event(generation, owner, tier.value, kind, memory_id, at)

    def logged_many(
        self, owner: str, tier: Tier, generation: int, kind: str, ids: Sequence[str], at: int
    ) -> None:
        """`logged` for many entries of one bulk write."""
        self.backend.append_events(generation, owner, tier.value, kind, ids, at)

    def identical(self, owner: str, tier: Tier, content: str, now: int) -> Record | None:
        """The first entry of this owner and tier with exactly this content,
        not expired by `now`."""
        rows = self.rows_of(
            self.sql.identical,
            owner=owner,
            tier=tier.value,
            digest=_sqlite.content_digest(content),
            content=content,
            now=now,
        )
        return rows[0] if rows else None

    def edited(
        self, scope: Scope, memory_id: str, match: str = "", tier: Tier = Tier.MEMORY
    ) -> tuple[Record, PartitionState]:
        """The entry of this scope an update or delete names, by its id or
        by `match` (in `tier`), and its partition's state row, locked. Call
        inside write_transaction."""
        if match:
            return self._matched(scope.owner(tier), tier, match)
        # The id does not say which partition holds it: find it, lock its
        # partition, and read it again, since another writer may have
        # changed or removed it in between.
        row = self._by_id(scope, memory_id)
        state = self.backend.lock_partition(row.owner, row.tier)
        locked = self._by_id(scope, memory_id)
        if (locked.owner, locked.tier) != (row.owner, row.tier):  # pragma: no cover - ids are fixed
            raise NotFound(f"no memory with id {memory_id!r} in this scope")
        return locked, state

    def _by_id(self, scope: Scope, memory_id: str) -> Record:
        rows = self.rows_of(self.sql.by_id, id=memory_id)
        row = rows[0] if rows else None
        if row is None or row.owner != scope.owner(Tier(row.tier)):
            # The same answer whether the id does not exist or belongs to
            # another scope: a request never learns about other scopes.
            raise NotFound(
                f"no memory with id {memory_id!r} in this scope",
                metadata={"id": memory_id},
            )
        return row

    def _matched(self, owner: str, tier: Tier, match: str) -> tuple[Record, PartitionState]:
        """The one entry of the partition whose content holds `match` (a
        literal, case-sensitive substring), and its state row, locked.

        The state row is locked first and the rows searched after: writers
        of the partition serialise on that lock, and the search (a statement
        of its own, so on PostgreSQL a snapshot taken after the lock) sees
        what the writer before left behind. Two edits by the same text can
        never both act on the entry as it was before either.
        """
        state = self.backend.lock_partition(owner, tier.value)
        return self.holding(owner, tier, match), state

    def holding(self, owner: str, tier: Tier, match: str) -> Record:
        """The one unexpired entry of the partition whose content holds
        `match`; MATCH_NOT_FOUND or AMBIGUOUS_MATCH otherwise."""
        Row = self.rows  # noqa: N806 - a bound model class
        position = getattr(fn, self.backend.position_function)(Row.content, match)
        query = (
            Row.select(*[getattr(Row, name) for name in Record._fields])
            .where((Row.owner == owner) & (Row.tier == tier.value) & (position > 0))
            # An expired entry is never named by its text (the write sweeps it).
            .where(unexpired(Row, self.now()))
            .order_by(Row.seq)
            # Enough to name the candidates and say whether there are more.
            .limit(AmbiguousMatch.SHOWN + 1)
        )
        sql, params = query.sql()
        found = [Record(*row) for row in self.db.execute_sql(sql, params).fetchall()]
        if not found:
            raise MatchNotFound(
                f"no entry of the {tier.label} tier in this scope contains "
                f"{match[: AmbiguousMatch.PREVIEW_CHARS]!r}; text is matched case-sensitively, "
                "exactly as written",
                metadata={"field": "match", "tier": tier.value},
            )
        if len(found) > 1:
            candidates = [(row.memory_id, row.content) for row in found]
            categories = [row.category for row in found]
            raise AmbiguousMatch(
                tier=tier.value, match=match, candidates=candidates, categories=categories
            )
        return found[0]

    def insert_new(self, entry: NewEntry, owner: str, now: int, expires_at: int | None) -> Record:
        """An added entry's row, inserted with a new id, as written for
        the entry's scope and session."""
        return self.insert(
            str(uuid.uuid4()),
            owner,
            entry.tier,
            entry.content,
            entry.category,
            entry.confidence,
            now,
            expires_at=expires_at,
            written=entry.scope,
            session_id=entry.session_id,
        )

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
        expires_at: int | None = None,
        written: Scope | None = None,
        session_id: str = "",
    ) -> Record:
        """Insert a row: `written` is the scope that wrote it and
        `session_id` its session ("": none named), kept for ForgetUser and a
        for_user export, never shown to the model; None: unknown."""
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
            expires_at,
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
                expires_at=row.expires_at,
                written_for_user_id=None if written is None else written.user_id,
                written_in_session=session_id or None,
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
        expires_at=None if row.expires_at is None else from_micros(row.expires_at),
    )


def scope_clause(rows: type[_Row], scope: Scope, tiers: Iterable[Tier]) -> Any:
    """Rows of any of the scope's tiers, each of the scope's owner of that tier."""
    clause: Any = None
    for tier in tiers:
        part = (rows.tier == tier.value) & (rows.owner == scope.owner(tier))
        clause = part if clause is None else (clause | part)
    return clause
