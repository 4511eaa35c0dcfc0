"""Everything SQLite-specific, in one place: connection set-up, schema DDL,
online backups, and which driver errors mean what.

The sibling for PostgreSQL is sidecar.storage._postgres; both implement
sidecar.storage._backend.Backend.

Owns: SQLite's pool and pragmas, BEGIN IMMEDIATE, migrations 1-9 (the last is the
store's SCHEMA_VERSION), online backup, starting the data_version poller
(sidecar.storage._sqlite_poller) and writing and pruning the session events it reads, and
content_digest (which the store uses for both backends). Must not touch:
PostgreSQL, caches, the engine, gRPC, os.environ. Migration 2 reads the wall
clock itself (system_clock), not an injected one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peewee
from playhouse.pool import PooledSqliteDatabase

from sidecar.core.clock import parse_timestamp, system_clock, to_micros
from sidecar.core.errors import (
    DatabaseBusy,
    DatabaseIOError,
    DatabaseReadOnly,
    DataLoss,
    SidecarError,
    StorageFull,
    StoreError,
)
from sidecar.storage import _backend
from sidecar.storage._backend import (
    AUDIT_TABLE,
    CHANGES_TABLE,
    CONTENT_INDEX,
    EVENT_HORIZON_TABLE,
    EVENTS_TABLE,
    INDEX_TABLE,
    KEY_BYTES,
    KEYS_TABLE,
    PAGE_TOKEN_KEY,
    PROVENANCE_INDEX,
    SCHEMA_TABLE,
    SESSION_EVENTS_TABLE,
    STATE_TABLE,
    VECTORS_TABLE,
    Backend,
    FeedSettings,
)
from sidecar.storage._sqlite_poller import DataVersionPoller
from sidecar.storage.changes import ChangeFeed, OnChange, OnSession
from sidecar.storage.checkpoint import PRAGMAS as CHECKPOINT_PRAGMAS
from sidecar.storage.checkpoint import Checkpointer

SYNCHRONOUS = ("normal", "full")


def open_database(
    path: str,
    *,
    synchronous: str = "normal",
    busy_timeout_ms: int = 5000,
    max_connections: int = 64,
) -> PooledSqliteDatabase:
    """A pool of connections, each set up the same way when it opens.

    - WAL lets readers run while one writer writes.
    - synchronous=NORMAL in WAL mode survives a process crash; FULL also
      survives power loss, at the cost of an fsync per commit.
    - busy_timeout makes a writer wait for the write lock instead of failing
      at once with "database is locked".
    - A writer checkpoints the WAL only past a large backstop: the store's
      Checkpointer does it in the background (sidecar.storage.checkpoint).
    - Connections move between the server's worker threads through the pool,
      so sqlite3's same-thread check is off; the pool hands a connection to
      one thread at a time.
    """
    if synchronous not in SYNCHRONOUS:
        raise ValueError(f"synchronous must be one of {SYNCHRONOUS}, got {synchronous!r}")
    return PooledSqliteDatabase(
        path,
        pragmas=[
            ("journal_mode", "wal"),
            ("synchronous", synchronous),
            ("busy_timeout", busy_timeout_ms),
            ("foreign_keys", 1),
            *CHECKPOINT_PRAGMAS,
        ],
        max_connections=max_connections,
        # Wait for a free pooled connection rather than failing at once.
        timeout=max(busy_timeout_ms / 1000, 1),
        check_same_thread=False,
    )


def write_transaction(db: PooledSqliteDatabase) -> Any:
    """A read-then-write transaction.

    BEGIN IMMEDIATE takes the write lock up front: two writers that both read
    the budget and then insert would otherwise deadlock on the upgrade (one
    gets SQLITE_BUSY at once, busy_timeout notwithstanding) or, worse, both
    pass the check. With it, the second waits until the first commits and
    then reads the budget the first left behind.
    """
    return db.atomic("IMMEDIATE")


def backup(
    db: PooledSqliteDatabase, destination: str, progress: Callable[[int, int], None]
) -> None:
    """Copy the database with SQLite's online backup API.

    Consistent even while the daemon writes: the copy restarts if the source
    changes mid-way. Copies 256 pages a step and reports (done, total) pages.
    """
    target = sqlite3.connect(destination)
    try:
        db.connection().backup(
            target, pages=256, progress=lambda _status, left, total: progress(total - left, total)
        )
    finally:
        target.close()


# --- schema ---------------------------------------------------------------


def _v1_tierless(db: PooledSqliteDatabase) -> None:
    """Schema 1: one flat table of agent notes, modelled on cagent's."""
    db.execute_sql(f"CREATE TABLE {SCHEMA_TABLE} (version INTEGER NOT NULL)")
    db.execute_sql(f"INSERT INTO {SCHEMA_TABLE} (version) VALUES (0)")
    db.execute_sql(
        "CREATE TABLE memories ("
        " id TEXT PRIMARY KEY,"
        " agent_id TEXT NOT NULL DEFAULT '',"
        " created_at TEXT NOT NULL,"
        " memory TEXT NOT NULL,"
        " category TEXT NOT NULL DEFAULT '')"
    )
    db.execute_sql("CREATE INDEX idx_memories_agent ON memories (agent_id)")


def _v2_tiers(db: PooledSqliteDatabase) -> None:
    """Schema 2: tiers, owners, confidence, update times, insertion order.

    Every schema-1 row becomes an agent note of its agent_id, keeping its id,
    creation time and category (seed 003: existing rows default to 'memory').
    Rows are copied as they are, even ones today's rules would refuse (empty
    text, duplicates, a tier over budget): a migration never loses data.
    """
    db.execute_sql(
        "CREATE TABLE memories_v2 ("
        " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
        " id TEXT NOT NULL UNIQUE,"
        " tier TEXT NOT NULL DEFAULT 'memory' CHECK (tier IN ('memory', 'user')),"
        " owner TEXT NOT NULL,"
        " content TEXT NOT NULL,"
        " content_chars INTEGER NOT NULL,"
        " content_sha256 TEXT NOT NULL,"
        " category TEXT NOT NULL DEFAULT '',"
        " confidence REAL NOT NULL DEFAULT 1.0"
        "  CHECK (confidence >= 0.0 AND confidence <= 1.0),"
        " created_at INTEGER NOT NULL,"
        " updated_at INTEGER NOT NULL)"
    )
    now = to_micros(system_clock())
    rows = db.execute_sql(
        "SELECT id, agent_id, created_at, memory, category FROM memories ORDER BY rowid"
    ).fetchall()
    for memory_id, agent_id, created_text, content, category in rows:
        parsed = parse_timestamp(created_text)
        created = to_micros(parsed) if parsed else now
        db.execute_sql(
            "INSERT INTO memories_v2 (id, tier, owner, content, content_chars,"
            " content_sha256, category, confidence, created_at, updated_at)"
            " VALUES (?, 'memory', ?, ?, ?, ?, ?, 1.0, ?, ?)",
            (
                memory_id,
                agent_id or "",
                content or "",
                len(content or ""),
                content_digest(content or ""),
                category or "",
                created,
                created,
            ),
        )
    db.execute_sql("DROP TABLE memories")
    db.execute_sql("ALTER TABLE memories_v2 RENAME TO memories")
    db.execute_sql("CREATE INDEX idx_memories_scope ON memories (owner, tier, seq)")
    db.execute_sql("CREATE INDEX idx_memories_content ON memories (owner, tier, content_sha256)")


def _v3_idempotency(db: PooledSqliteDatabase) -> None:
    """Schema 3: idempotency keys of AddMemory, remembered for a while."""
    db.execute_sql(
        "CREATE TABLE idempotency_keys ("
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " key TEXT NOT NULL,"
        " memory_id TEXT NOT NULL,"
        " content_sha256 TEXT NOT NULL,"
        " created_at INTEGER NOT NULL,"
        " PRIMARY KEY (owner, tier, key))"
    )
    db.execute_sql("CREATE INDEX idx_idempotency_created ON idempotency_keys (created_at)")


def _v4_tier_state(db: PooledSqliteDatabase) -> None:
    """Schema 4: a state row per partition (owner and tier), kept by every write.

    Budget checks read it instead of summing the partition, and its
    generation tells other processes which partitions changed. The content
    index gains seq.
    """
    db.execute_sql(
        f"CREATE TABLE {STATE_TABLE} ("
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " content_chars INTEGER NOT NULL,"
        " entry_count INTEGER NOT NULL,"
        " generation INTEGER NOT NULL,"
        " PRIMARY KEY (owner, tier))"
    )
    db.execute_sql(f"CREATE INDEX idx_{STATE_TABLE}_generation ON {STATE_TABLE} (generation)")
    db.execute_sql(
        f"INSERT INTO {STATE_TABLE} (owner, tier, content_chars, entry_count, generation)"
        " SELECT owner, tier, SUM(content_chars), COUNT(*), 0 FROM memories GROUP BY owner, tier"
    )
    db.execute_sql("DROP INDEX idx_memories_content")
    db.execute_sql(f"CREATE INDEX idx_memories_content ON memories {CONTENT_INDEX}")


def _v5_compact_index(db: PooledSqliteDatabase) -> None:
    """Schema 5: large partitions' compact indexes, persisted, and the seqs
    each write changes once a partition has one (sidecar.retrieval.compact)."""
    db.execute_sql(f"ALTER TABLE {STATE_TABLE} ADD COLUMN indexed INTEGER NOT NULL DEFAULT 0")
    db.execute_sql(
        f"CREATE TABLE {INDEX_TABLE} ("
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " generation INTEGER NOT NULL,"
        " part INTEGER NOT NULL,"
        " data BLOB NOT NULL,"
        " PRIMARY KEY (owner, tier, generation, part))"
    )
    db.execute_sql(
        f"CREATE TABLE {CHANGES_TABLE} ("
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " generation INTEGER NOT NULL,"
        " seq INTEGER NOT NULL)"
    )
    db.execute_sql(f"CREATE INDEX idx_{CHANGES_TABLE} ON {CHANGES_TABLE} (owner, tier, generation)")
    # Every change of an entry of a logged partition, whoever makes it (an
    # older release still serving, a statement typed by hand), is logged.
    for event, row in (("INSERT", "NEW"), ("UPDATE", "NEW"), ("DELETE", "OLD")):
        db.execute_sql(
            f"CREATE TRIGGER memories_log_{event.lower()} AFTER {event} ON memories BEGIN"
            f" INSERT INTO {CHANGES_TABLE} (owner, tier, generation, seq)"
            f" SELECT {row}.owner, {row}.tier, generation, {row}.seq FROM {STATE_TABLE}"
            f" WHERE owner = {row}.owner AND tier = {row}.tier AND indexed <> 0;"
            " END"
        )


def _v6_vectors(db: PooledSqliteDatabase) -> None:
    """Schema 6: entries' embeddings for semantic retrieval (sidecar.retrieval.embedding)."""
    db.execute_sql(
        f"CREATE TABLE {VECTORS_TABLE} ("
        " seq INTEGER PRIMARY KEY REFERENCES memories (seq) ON DELETE CASCADE,"
        " model TEXT NOT NULL,"
        " content_sha256 TEXT NOT NULL,"
        " vector BLOB NOT NULL)"
    )


def _v7_lifecycle(db: PooledSqliteDatabase) -> None:
    """Schema 7: entries' expiry, the event log WatchMemories reads, the
    erasure audit log, and each partition's last erasure (tier_state.erased:
    the generation of the erasure, 0 for none), which the change feed
    delivers so every replica drops what showed the erased content."""
    db.execute_sql("ALTER TABLE memories ADD COLUMN expires_at INTEGER")
    # Both partial (only rows that expire): the sweep finds the earliest
    # expired rows anywhere; a write finds its own partition's.
    db.execute_sql(
        "CREATE INDEX idx_memories_expiry ON memories (expires_at) WHERE expires_at IS NOT NULL"
    )
    db.execute_sql(
        "CREATE INDEX idx_memories_partition_expiry ON memories (owner, tier, expires_at)"
        " WHERE expires_at IS NOT NULL"
    )
    db.execute_sql(f"ALTER TABLE {STATE_TABLE} ADD COLUMN erased INTEGER NOT NULL DEFAULT 0")
    db.execute_sql(
        f"CREATE TABLE {EVENTS_TABLE} ("
        " generation INTEGER NOT NULL,"
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " kind TEXT NOT NULL,"
        " memory_id TEXT NOT NULL DEFAULT '',"
        " at INTEGER NOT NULL)"
    )
    db.execute_sql(
        f"CREATE INDEX idx_{EVENTS_TABLE}_scope ON {EVENTS_TABLE} (owner, tier, generation)"
    )
    db.execute_sql(f"CREATE INDEX idx_{EVENTS_TABLE}_at ON {EVENTS_TABLE} (at)")
    db.execute_sql(f"CREATE TABLE {EVENT_HORIZON_TABLE} (generation INTEGER NOT NULL)")
    db.execute_sql(f"INSERT INTO {EVENT_HORIZON_TABLE} (generation) VALUES (0)")
    db.execute_sql(
        f"CREATE TABLE {AUDIT_TABLE} ("
        " id INTEGER PRIMARY KEY AUTOINCREMENT,"
        " at INTEGER NOT NULL,"
        " actor TEXT NOT NULL,"
        " action TEXT NOT NULL,"
        " target TEXT NOT NULL,"
        " counts TEXT NOT NULL,"
        " generation INTEGER NOT NULL)"
    )


def _v8_keys(db: PooledSqliteDatabase) -> None:
    """Schema 8: the database's own random keys, made here once (under the
    migration's lock), so every daemon on the database reads the same."""
    db.execute_sql(f"CREATE TABLE {KEYS_TABLE} (name TEXT PRIMARY KEY, secret BLOB NOT NULL)")
    db.execute_sql(
        f"INSERT INTO {KEYS_TABLE} (name, secret) VALUES (?, ?)",
        (PAGE_TOKEN_KEY, os.urandom(KEY_BYTES)),
    )


def _v9_session_events(db: PooledSqliteDatabase) -> None:
    """Schema 9: session events, which other processes' pollers read."""
    db.execute_sql(
        f"CREATE TABLE {SESSION_EVENTS_TABLE} ("
        " id INTEGER PRIMARY KEY AUTOINCREMENT,"
        " payload TEXT NOT NULL,"
        " at INTEGER NOT NULL)"
    )


def _v10_provenance(db: PooledSqliteDatabase) -> None:
    """Schema 10: who each entry was written for (the writing scope's
    user_id, and its session when the write named one). Existing rows get
    NULL: an unknown writer, which ForgetUser never counts as anyone's."""
    db.execute_sql("ALTER TABLE memories ADD COLUMN written_for_user_id TEXT")
    db.execute_sql("ALTER TABLE memories ADD COLUMN written_in_session TEXT")
    db.execute_sql(PROVENANCE_INDEX)


def content_digest(content: str) -> str:
    return hashlib.sha256(content.encode("utf-8")).hexdigest()


# (version, what it does, how). Append only: a released step never changes.
MIGRATIONS: list[tuple[int, str, Callable[[peewee.Database], None]]] = [
    (1, "tier-less agent notes", _v1_tierless),
    (2, "two tiers, owners, confidence", _v2_tiers),
    (3, "idempotency keys", _v3_idempotency),
    (4, "a state row per partition", _v4_tier_state),
    (5, "persisted compact indexes of large partitions", _v5_compact_index),
    (6, "entries' embeddings", _v6_vectors),
    (7, "expiry, the event log, the erasure audit log", _v7_lifecycle),
    (8, "the key page tokens are signed with", _v8_keys),
    (9, "session events", _v9_session_events),
    (10, "who each entry was written for", _v10_provenance),
]


# SQLite's primary result codes (the low byte of an extended code).
_SQLITE_READONLY, _SQLITE_IOERR, _SQLITE_CORRUPT = 8, 10, 11
_SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 13, 14, 26
# (result code, words of its message, the error, what to tell the client)
_FAULTS: tuple[tuple[int, str, type[SidecarError], str], ...] = (
    (
        _SQLITE_FULL,
        "disk is full",
        StorageFull,
        "no room left to write {location}: the disk (or its quota) is full; nothing was changed",
    ),
    (
        _SQLITE_READONLY,
        "readonly database",
        DatabaseReadOnly,
        "{location} cannot be written (a read-only file, directory or mount); reads still work",
    ),
    (
        _SQLITE_CORRUPT,
        "malformed",
        DataLoss,
        "{location} is damaged ({text}); stop writing to it and restore from a backup "
        "(`memory-sidecar check` tells more)",
    ),
    (
        _SQLITE_IOERR,
        "disk I/O error",
        DatabaseIOError,
        "the disk under {location} failed to read or write ({text}); retry",
    ),
)


class ErrorGuard(_backend.ErrorGuard):
    def translate(self, exc: Exception) -> None:
        # Peewee wraps the driver's exception and keeps it as `orig`.
        original = getattr(exc, "orig", exc)
        if not isinstance(original, sqlite3.Error | peewee.DatabaseError):
            return
        text = str(original)
        code = (getattr(original, "sqlite_errorcode", None) or 0) & 0xFF
        if "locked" in text or "busy" in text:
            raise DatabaseBusy("the database stayed locked past the busy timeout; retry") from exc
        for fault_code, words, fault, message in _FAULTS:
            if code == fault_code or words in text:
                raise fault(message.format(location=self.location, text=text)) from exc
        if code == _SQLITE_NOTADB or "file is not a database" in text:
            raise StoreError(f"{self.location} is not an SQLite database") from exc
        if code == _SQLITE_CANTOPEN or "unable to open database" in text:
            path = Path(self.location)
            if path.exists() and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
                raise DatabaseReadOnly(
                    f"{self.location} cannot be written (a read-only file, directory or mount; "
                    "SQLite also creates -wal and -shm files beside it)",
                ) from exc
            raise StoreError(
                f"cannot open {self.location}: its directory must exist and be writable"
            ) from exc


class SqliteBackend(Backend):
    """One SQLite file in WAL mode."""

    name = "sqlite"
    migrations = MIGRATIONS
    position_function = "instr"

    # Every write holds SQLite's one write lock (BEGIN IMMEDIATE), so the
    # state row needs no lock of its own, and a generation drawn as the
    # largest so far plus one is unique and grows in commit order.
    _lock_sql = (
        f"SELECT content_chars, entry_count, generation, indexed, erased FROM {STATE_TABLE}"
        " WHERE owner = ? AND tier = ?"
    )
    _create_sql = (
        f"INSERT OR IGNORE INTO {STATE_TABLE}"
        " (owner, tier, content_chars, entry_count, generation) VALUES (?, ?, 0, 0, 0)"
    )
    _advance_sql = (
        f"UPDATE {STATE_TABLE} SET content_chars = ?, entry_count = ?,"
        f" generation = (SELECT MAX(generation) FROM {STATE_TABLE}) + 1"
        " WHERE owner = ? AND tier = ? RETURNING generation"
    )
    # Both subqueries read the table before the row changes: one value.
    _erase_sql = (
        f"UPDATE {STATE_TABLE} SET content_chars = 0, entry_count = 0, indexed = 0,"
        f" generation = (SELECT MAX(generation) FROM {STATE_TABLE}) + 1,"
        f" erased = (SELECT MAX(generation) FROM {STATE_TABLE}) + 1"
        " WHERE owner = ? AND tier = ? RETURNING generation"
    )
    _thin_sql = (
        f"UPDATE {STATE_TABLE} SET content_chars = ?, entry_count = ?, indexed = 0,"
        f" generation = (SELECT MAX(generation) FROM {STATE_TABLE}) + 1,"
        f" erased = (SELECT MAX(generation) FROM {STATE_TABLE}) + 1"
        " WHERE owner = ? AND tier = ? RETURNING generation"
    )

    def __init__(
        self,
        path: str,
        *,
        synchronous: str = "normal",
        busy_timeout_ms: int = 5000,
        max_connections: int = 64,
    ) -> None:
        self.location = path
        self.path = path
        self._busy_timeout_ms = busy_timeout_ms
        self.db = open_database(
            path,
            synchronous=synchronous,
            busy_timeout_ms=busy_timeout_ms,
            max_connections=max_connections,
        )
        self.checkpointer = Checkpointer(path)

    def start(self) -> None:
        self.checkpointer.start()

    def stop(self) -> None:
        self.checkpointer.stop()

    def write_transaction(self) -> contextlib.AbstractContextManager[Any]:
        transaction: contextlib.AbstractContextManager[Any] = write_transaction(self.db)
        return transaction

    def read_transaction(self) -> contextlib.AbstractContextManager[Any]:
        # A deferred transaction reads one snapshot from its first read on.
        snapshot: contextlib.AbstractContextManager[Any] = self.db.atomic()
        return snapshot

    def migration_transaction(self) -> contextlib.AbstractContextManager[Any]:
        return self.write_transaction()

    def guard(self) -> contextlib.AbstractContextManager[None]:
        return ErrorGuard(self.path)

    def table_names(self) -> set[str]:
        return set(self.db.get_tables())

    def analyze(self) -> None:
        # SQLite plans without statistics unless ANALYZE ever ran, and its
        # plans here are right without them (bench section 12).
        return None

    def integrity_check(self) -> str:
        return str(self.db.execute_sql("PRAGMA integrity_check").fetchone()[0])

    def quick_check(self) -> str:
        # Every page's structure, without matching indexes to their tables:
        # a fraction of integrity_check's time.
        return str(self.db.execute_sql("PRAGMA quick_check(1)").fetchone()[0])

    def connection_settings(self) -> dict[str, int | str]:
        return {
            name: self.db.execute_sql(f"PRAGMA {name}").fetchone()[0]
            for name in ("journal_mode", "synchronous", "busy_timeout", "foreign_keys")
        }

    def backup(self, destination: str, progress: Callable[[int, int], None]) -> None:
        backup(self.db, destination, progress)

    def change_feed(
        self,
        on_change: OnChange,
        settings: FeedSettings,
        *,
        on_session: OnSession | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> ChangeFeed:
        return DataVersionPoller(
            self.path,
            on_change,
            interval=settings.poll_seconds,
            busy_timeout_ms=self._busy_timeout_ms,
            publish=lambda payload: self.publish_session_event(payload, to_micros(system_clock())),
            on_session=on_session,
            on_resync=on_resync,
        )
