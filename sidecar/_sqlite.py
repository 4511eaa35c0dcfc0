"""Everything SQLite-specific, in one place: connection set-up, schema DDL,
online backups, and which driver errors mean what.

A PostgreSQL backend (issue: many replicas) adds a sibling module with the
same things: `open_database`, `write_transaction`, `MIGRATIONS`, `backup`,
`ErrorGuard`. The store's queries themselves come from Peewee's query
builder and are portable.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable
from typing import Any

import peewee
from playhouse.pool import PooledSqliteDatabase

from sidecar.clock import parse_timestamp, system_clock, to_micros
from sidecar.errors import StoreError, Unavailable

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


def table_names(db: PooledSqliteDatabase) -> set[str]:
    return set(db.get_tables())


# --- schema ---------------------------------------------------------------

SCHEMA_TABLE = "schema_version"


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


def content_digest(content: str) -> str:
    return hashlib.sha256(content.encode("utf-8")).hexdigest()


# (version, what it does, how). Append only: a released step never changes.
MIGRATIONS: list[tuple[int, str, Callable[[PooledSqliteDatabase], None]]] = [
    (1, "tier-less agent notes", _v1_tierless),
    (2, "two tiers, owners, confidence", _v2_tiers),
    (3, "idempotency keys", _v3_idempotency),
]


class ErrorGuard:
    """Turns driver errors that a client can act on into SidecarErrors."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            return
        if isinstance(exc, peewee.OperationalError | sqlite3.OperationalError):
            text = str(exc)
            if "locked" in text or "busy" in text:
                raise Unavailable(
                    "the database stayed locked past the busy timeout; retry",
                    reason="DATABASE_BUSY",
                ) from exc
        if isinstance(exc, peewee.DatabaseError | sqlite3.DatabaseError) and (
            "file is not a database" in str(exc)
        ):
            raise StoreError(f"{self.path} is not an SQLite database") from exc
