"""Everything PostgreSQL-specific: connections, schema DDL, notifications,
and which server errors mean what (the listener is
sidecar.storage._pg_listener). Needs the `postgres` extra (psycopg 3);
imported only when `server.db` is a postgresql:// DSN.

Many replicas share one database. What keeps them correct:

- Writers of one partition serialise on its state row (SELECT ... FOR
  UPDATE), so budgets and de-duplication hold across replicas.
- Generations come from one sequence; each write NOTIFYs inside its
  transaction, so the notification is delivered exactly when (and only if)
  the write commits.
- Migrations run under a transaction-scoped advisory lock, so replicas
  starting together migrate once.

Owns: PostgreSQL's connection parameters (the pool is sidecar.storage._pgpool), DSN
redaction, the schema steps (4 at once, then 5 to 9), the migration lock, the
notifications it sends (writes; session events and fences), the generation
sequence, and starting the listener. Must not touch: SQLite, caches, the
engine, gRPC; the password is an argument (sidecar.config.settings reads it). Only
sidecar.storage.store imports this module, inside a function.
"""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from playhouse.pool import MaxConnectionsExceeded

from sidecar.core.errors import (
    DatabaseBusy,
    DatabaseReadOnly,
    DatabaseRefused,
    DatabaseUnavailable,
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
from sidecar.storage._pg_listener import CHANNEL, EVENTS_CHANNEL, NotifyListener
from sidecar.storage._pgpool import Pool, out_of_slots
from sidecar.storage.changes import ChangeFeed, OnChange, OnSession

try:
    import psycopg
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

log = logging.getLogger("sidecar._postgres")

SEQUENCE = "memory_generation"
# pg_advisory_xact_lock key for migrations: any constant, the same in every
# replica ("memsidecar" as bytes, truncated to a bigint).
MIGRATION_LOCK = 0x6D656D7369646563
APPLICATION_NAME = "memory-sidecar"
LISTENER_NAME = "memory-sidecar-listener"


def redacted(dsn: str) -> str:
    """The DSN with any password replaced, fit for logs and messages."""
    parts = urllib.parse.urlsplit(dsn)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostinfo = netloc.rpartition("@")
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        netloc = f"{userinfo}@{hostinfo}"
    query = urllib.parse.urlencode(
        [
            (key, "***" if key == "password" else value)
            for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        ],
        safe="/:",
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _require_driver() -> None:
    if psycopg is None:
        raise StoreError(
            "server.db is a PostgreSQL DSN but psycopg is not installed; "
            "install memory-sidecar[postgres]"
        )


# --- schema ---------------------------------------------------------------


def _v4_schema(db: Any) -> None:
    """Schema 4 at once: what schemas 1-4 built on SQLite, for a new database."""
    db.execute_sql(f"CREATE TABLE {SCHEMA_TABLE} (version INTEGER NOT NULL)")
    db.execute_sql(f"INSERT INTO {SCHEMA_TABLE} (version) VALUES (0)")
    db.execute_sql(
        "CREATE TABLE memories ("
        " seq BIGSERIAL PRIMARY KEY,"
        " id TEXT NOT NULL UNIQUE,"
        " tier TEXT NOT NULL DEFAULT 'memory' CHECK (tier IN ('memory', 'user')),"
        " owner TEXT NOT NULL,"
        " content TEXT NOT NULL,"
        " content_chars INTEGER NOT NULL,"
        " content_sha256 TEXT NOT NULL,"
        " category TEXT NOT NULL DEFAULT '',"
        " confidence DOUBLE PRECISION NOT NULL DEFAULT 1.0"
        "  CHECK (confidence >= 0.0 AND confidence <= 1.0),"
        " created_at BIGINT NOT NULL,"
        " updated_at BIGINT NOT NULL)"
    )
    db.execute_sql("CREATE INDEX idx_memories_scope ON memories (owner, tier, seq)")
    db.execute_sql(f"CREATE INDEX idx_memories_content ON memories {CONTENT_INDEX}")
    db.execute_sql(
        "CREATE TABLE idempotency_keys ("
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " key TEXT NOT NULL,"
        " memory_id TEXT NOT NULL,"
        " content_sha256 TEXT NOT NULL,"
        " created_at BIGINT NOT NULL,"
        " PRIMARY KEY (owner, tier, key))"
    )
    db.execute_sql("CREATE INDEX idx_idempotency_created ON idempotency_keys (created_at)")
    db.execute_sql(
        f"CREATE TABLE {STATE_TABLE} ("
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " content_chars BIGINT NOT NULL,"
        " entry_count BIGINT NOT NULL,"
        " generation BIGINT NOT NULL,"
        " PRIMARY KEY (owner, tier))"
    )
    db.execute_sql(f"CREATE INDEX idx_{STATE_TABLE}_generation ON {STATE_TABLE} (generation)")
    db.execute_sql(f"CREATE SEQUENCE {SEQUENCE}")


def _v5_compact_index(db: Any) -> None:
    """Schema 5: large partitions' compact indexes, persisted, and the seqs
    each write changes once a partition has one (sidecar.retrieval.compact)."""
    db.execute_sql(f"ALTER TABLE {STATE_TABLE} ADD COLUMN indexed BIGINT NOT NULL DEFAULT 0")
    db.execute_sql(
        f"CREATE TABLE {INDEX_TABLE} ("
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " generation BIGINT NOT NULL,"
        " part INTEGER NOT NULL,"
        " data BYTEA NOT NULL,"
        " PRIMARY KEY (owner, tier, generation, part))"
    )
    db.execute_sql(
        f"CREATE TABLE {CHANGES_TABLE} ("
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " generation BIGINT NOT NULL,"
        " seq BIGINT NOT NULL)"
    )
    db.execute_sql(f"CREATE INDEX idx_{CHANGES_TABLE} ON {CHANGES_TABLE} (owner, tier, generation)")
    # Every change of an entry of a logged partition, whoever makes it (an
    # older release still serving, a statement typed by hand), is logged.
    db.execute_sql(
        "CREATE FUNCTION memories_log_change() RETURNS trigger AS $$"
        " DECLARE entry RECORD;"
        " BEGIN"
        "  IF TG_OP = 'DELETE' THEN entry := OLD; ELSE entry := NEW; END IF;"
        f"  INSERT INTO {CHANGES_TABLE} (owner, tier, generation, seq)"
        f"   SELECT entry.owner, entry.tier, s.generation, entry.seq FROM {STATE_TABLE} s"
        "   WHERE s.owner = entry.owner AND s.tier = entry.tier AND s.indexed <> 0;"
        "  RETURN NULL;"
        " END $$ LANGUAGE plpgsql"
    )
    db.execute_sql(
        "CREATE TRIGGER memories_log_change AFTER INSERT OR UPDATE OR DELETE ON memories"
        " FOR EACH ROW EXECUTE FUNCTION memories_log_change()"
    )


def _v6_vectors(db: Any) -> None:
    """Schema 6: entries' embeddings for semantic retrieval (sidecar.retrieval.embedding)."""
    db.execute_sql(
        f"CREATE TABLE {VECTORS_TABLE} ("
        " seq BIGINT PRIMARY KEY REFERENCES memories (seq) ON DELETE CASCADE,"
        " model TEXT NOT NULL,"
        " content_sha256 TEXT NOT NULL,"
        " vector BYTEA NOT NULL)"
    )


def _v7_lifecycle(db: Any) -> None:
    """Schema 7: as SQLite's (sidecar.storage._sqlite._v7_lifecycle)."""
    db.execute_sql("ALTER TABLE memories ADD COLUMN expires_at BIGINT")
    # Both partial (only rows that expire): the sweep finds the earliest
    # expired rows anywhere; a write finds its own partition's.
    db.execute_sql(
        "CREATE INDEX idx_memories_expiry ON memories (expires_at) WHERE expires_at IS NOT NULL"
    )
    db.execute_sql(
        "CREATE INDEX idx_memories_partition_expiry ON memories (owner, tier, expires_at)"
        " WHERE expires_at IS NOT NULL"
    )
    db.execute_sql(f"ALTER TABLE {STATE_TABLE} ADD COLUMN erased BIGINT NOT NULL DEFAULT 0")
    db.execute_sql(
        f"CREATE TABLE {EVENTS_TABLE} ("
        " generation BIGINT NOT NULL,"
        " owner TEXT NOT NULL,"
        " tier TEXT NOT NULL,"
        " kind TEXT NOT NULL,"
        " memory_id TEXT NOT NULL DEFAULT '',"
        " at BIGINT NOT NULL)"
    )
    db.execute_sql(
        f"CREATE INDEX idx_{EVENTS_TABLE}_scope ON {EVENTS_TABLE} (owner, tier, generation)"
    )
    db.execute_sql(f"CREATE INDEX idx_{EVENTS_TABLE}_at ON {EVENTS_TABLE} (at)")
    db.execute_sql(f"CREATE TABLE {EVENT_HORIZON_TABLE} (generation BIGINT NOT NULL)")
    db.execute_sql(f"INSERT INTO {EVENT_HORIZON_TABLE} (generation) VALUES (0)")
    db.execute_sql(
        f"CREATE TABLE {AUDIT_TABLE} ("
        " id BIGSERIAL PRIMARY KEY,"
        " at BIGINT NOT NULL,"
        " actor TEXT NOT NULL,"
        " action TEXT NOT NULL,"
        " target TEXT NOT NULL,"
        " counts TEXT NOT NULL,"
        " generation BIGINT NOT NULL)"
    )


def _v8_keys(db: Any) -> None:
    """Schema 8: as SQLite's (sidecar.storage._sqlite._v8_keys)."""
    db.execute_sql(f"CREATE TABLE {KEYS_TABLE} (name TEXT PRIMARY KEY, secret BYTEA NOT NULL)")
    db.execute_sql(
        f"INSERT INTO {KEYS_TABLE} (name, secret) VALUES (%s, %s)",
        (PAGE_TOKEN_KEY, os.urandom(KEY_BYTES)),
    )


def _v9_session_events(db: Any) -> None:
    """Schema 9: SQLite's session events table, for one schema on both
    backends; PostgreSQL replicas NOTIFY EVENTS_CHANNEL instead."""
    db.execute_sql(
        f"CREATE TABLE {SESSION_EVENTS_TABLE} ("
        " id BIGSERIAL PRIMARY KEY,"
        " payload TEXT NOT NULL,"
        " at BIGINT NOT NULL)"
    )


def _v10_provenance(db: Any) -> None:
    """Schema 10: as SQLite's (sidecar.storage._sqlite._v10_provenance)."""
    db.execute_sql("ALTER TABLE memories ADD COLUMN written_for_user_id TEXT")
    db.execute_sql("ALTER TABLE memories ADD COLUMN written_in_session TEXT")
    db.execute_sql(PROVENANCE_INDEX)


# (version, what it does, how). Append only, numbered like SQLite's: the
# same version means the same schema on both backends.
MIGRATIONS: list[tuple[int, str, Callable[[Any], None]]] = [
    (4, "memories, idempotency keys, a state row per partition", _v4_schema),
    (5, "persisted compact indexes of large partitions", _v5_compact_index),
    (6, "entries' embeddings", _v6_vectors),
    (7, "expiry, the event log, the erasure audit log", _v7_lifecycle),
    (8, "the key page tokens are signed with", _v8_keys),
    (9, "session events", _v9_session_events),
    (10, "who each entry was written for", _v10_provenance),
]

# SQLSTATEs a client can act on by retrying.
# Storage faults: the server's disk is full, it refuses writes (a hot
# standby), or its pages are damaged.
_STORAGE: dict[str, tuple[type[SidecarError], str]] = {
    "53100": (StorageFull, "the database server's disk is full; nothing was changed"),
    "25006": (DatabaseReadOnly, "the database refuses writes (a read-only server or standby)"),
    "XX001": (DataLoss, "the database server reports damaged data"),
    "XX002": (DataLoss, "the database server reports a damaged index"),
}

_BUSY = {
    "55P03": "the database kept a row locked past the lock timeout; retry",
    "40001": "a concurrent write conflicted; retry",
    "40P01": "a concurrent write deadlocked; retry",
    "57014": "the statement ran past its timeout; retry",
}


# What libpq says when the server answered but refused the login (a failed
# connection carries no SQLSTATE, only libpq's text): waiting does not mend
# these, a change of configuration does.
_REFUSED = (
    "authentication failed",  # password, peer, ident, cert, ...
    "no pg_hba.conf entry",
    "does not exist",  # the role or the database
    "permission denied",
    "not permitted to log in",
    "no password supplied",
    "does not support SSL",
)


class ErrorGuard(_backend.ErrorGuard):
    def translate(self, exc: Exception) -> None:
        # Peewee wraps the driver's exception and keeps it as `orig`.
        original = getattr(exc, "orig", exc)
        if psycopg is None or not isinstance(original, psycopg.Error):
            if isinstance(exc, MaxConnectionsExceeded):
                raise DatabaseBusy("every database connection stayed busy; retry") from exc
            return
        state = original.sqlstate or ""
        if out_of_slots(original):
            # Not unreachable: full. Every slot (max_connections) is taken,
            # by this replica's pool or others'; one frees up soon.
            raise DatabaseBusy(
                f"the database server has no free connection slot ({self.location}); retry"
            ) from exc
        if state in _STORAGE:
            fault, why = _STORAGE[state]
            raise fault(f"{why} ({self.location})") from exc
        if state in _BUSY:
            raise DatabaseBusy(_BUSY[state]) from exc
        # Cannot connect (08), shutting down (57P), refused login (28), no
        # such database (3D): say why, in the server's words (never a password).
        if isinstance(original, psycopg.OperationalError) and (
            not state or state.startswith(("08", "57P", "28", "3D"))
        ):
            # libpq's first line says what failed; later ones are hints.
            lines = [line.strip() for line in str(original).splitlines() if line.strip()]
            why = lines[0] if lines else "no answer"
            refused = state.startswith(("28", "3D")) or (
                not state and any(words in str(original) for words in _REFUSED)
            )
            raise (DatabaseRefused if refused else DatabaseUnavailable)(
                f"cannot reach the database at {self.location}: {why}"
            ) from exc


class PostgresBackend(Backend):
    """One PostgreSQL database, shared by any number of replicas."""

    name = "postgresql"
    migrations = MIGRATIONS
    position_function = "strpos"

    _lock_sql = (
        f"SELECT content_chars, entry_count, generation, indexed, erased FROM {STATE_TABLE}"
        " WHERE owner = %s AND tier = %s FOR UPDATE"
    )
    _create_sql = (
        f"INSERT INTO {STATE_TABLE} (owner, tier, content_chars, entry_count, generation)"
        " VALUES (%s, %s, 0, 0, 0) ON CONFLICT DO NOTHING"
    )
    # One round trip: advance the row and queue the notification, which the
    # server delivers when (and only if) the transaction commits.
    _advance_sql = (
        f"WITH advanced AS (UPDATE {STATE_TABLE} SET content_chars = %s, entry_count = %s,"
        f" generation = nextval('{SEQUENCE}') WHERE owner = %s AND tier = %s"
        " RETURNING owner, tier, generation)"
        f" SELECT generation, pg_notify('{CHANNEL}',"
        " json_build_array(owner, tier, generation)::text) FROM advanced"
    )
    # An erasure's notification carries the erased generation too, so every
    # replica drops what showed the partition's content (sidecar.storage.erasure).
    _erase_sql = (
        f"WITH next AS (SELECT nextval('{SEQUENCE}') AS g),"
        f" emptied AS (UPDATE {STATE_TABLE} SET content_chars = 0, entry_count = 0, indexed = 0,"
        " generation = next.g, erased = next.g FROM next WHERE owner = %s AND tier = %s"
        " RETURNING owner, tier, generation, erased)"
        f" SELECT generation, pg_notify('{CHANNEL}',"
        " json_build_array(owner, tier, generation, erased)::text) FROM emptied"
    )
    _thin_sql = (
        f"WITH next AS (SELECT nextval('{SEQUENCE}') AS g),"
        f" thinned AS (UPDATE {STATE_TABLE} SET content_chars = %s, entry_count = %s,"
        " indexed = 0, generation = next.g, erased = next.g FROM next"
        " WHERE owner = %s AND tier = %s RETURNING owner, tier, generation, erased)"
        f" SELECT generation, pg_notify('{CHANNEL}',"
        " json_build_array(owner, tier, generation, erased)::text) FROM thinned"
    )

    def __init__(
        self,
        dsn: str,
        *,
        password: str = "",
        busy_timeout_ms: int = 5000,
        max_connections: int = 20,
        idle_seconds: float = 60.0,
    ) -> None:
        _require_driver()
        # libpq knows postgresql:// and postgres://; Peewee only the first.
        self._dsn = "postgresql://" + dsn.split("://", 1)[1]
        self.location = redacted(dsn)
        self._password = password
        self._busy_timeout_ms = busy_timeout_ms
        self.db = Pool(
            self._dsn,
            max_connections=max_connections,
            idle_seconds=idle_seconds,
            timeout=max(busy_timeout_ms / 1000, 1),
            **self._connect_params(APPLICATION_NAME),
        )

    def _connect_params(self, application_name: str) -> dict[str, Any]:
        params: dict[str, Any] = {
            "application_name": application_name,
            "connect_timeout": max(1, round(self._busy_timeout_ms / 1000)),
            # A writer waiting on a partition's row lock gives up like an
            # SQLite writer waiting on the write lock: after the busy timeout.
            "options": f"-c lock_timeout={self._busy_timeout_ms}",
        }
        if self._password:
            params["password"] = self._password
        return params

    def batches(
        self, sql: str, params: Sequence[object], size: int
    ) -> Iterator[list[tuple[Any, ...]]]:
        # psycopg's client-side cursor downloads the whole result at once;
        # stream() reads it row by row (single-row mode).
        with self.db.connection().cursor() as cursor:
            batch: list[tuple[Any, ...]] = []
            for row in cursor.stream(sql, params):
                batch.append(row)
                if len(batch) == size:
                    yield batch
                    batch = []
            if batch:
                yield batch

    def analyze(self) -> None:
        # Until autovacuum gets round to it, a freshly loaded table has no
        # statistics, and the duplicate check's generic plan then walks the
        # partition instead of using the content index.
        self.db.execute_sql(f"ANALYZE memories, {STATE_TABLE}")

    def write_transaction(self) -> contextlib.AbstractContextManager[Any]:
        transaction: contextlib.AbstractContextManager[Any] = self.db.atomic()
        return transaction

    def read_transaction(self) -> contextlib.AbstractContextManager[Any]:
        # READ COMMITTED gives each statement its own snapshot; a partition's
        # rows and its state row must come from one.
        snapshot: contextlib.AbstractContextManager[Any] = self.db.atomic(
            isolation_level="REPEATABLE READ"
        )
        return snapshot

    @contextlib.contextmanager
    def migration_transaction(self) -> Any:
        with self.db.atomic():
            # Held until commit: a replica starting at the same moment waits
            # here, then finds the schema already migrated.
            self.db.execute_sql("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            yield

    def guard(self) -> contextlib.AbstractContextManager[None]:
        return ErrorGuard(self.location)

    def inserted_seq(self, cursor: Any) -> int:
        # Peewee renders INSERTs on PostgreSQL with RETURNING the key.
        return int(cursor.fetchone()[0])

    def table_names(self) -> set[str]:
        return set(self.db.get_tables())

    def integrity_check(self) -> str:
        # Page-level checks are the server's business (data checksums,
        # amcheck); what this daemon can break is its own bookkeeping.
        drift = self.db.execute_sql(
            f"SELECT COUNT(*) FROM {STATE_TABLE} s FULL JOIN"
            " (SELECT owner, tier, SUM(content_chars) AS chars, COUNT(*) AS n"
            "  FROM memories GROUP BY owner, tier) m"
            " ON s.owner = m.owner AND s.tier = m.tier"
            " WHERE COALESCE(s.content_chars, 0) <> COALESCE(m.chars, 0)"
            "  OR COALESCE(s.entry_count, 0) <> COALESCE(m.n, 0)"
        ).fetchone()[0]
        return "ok" if not drift else f"{drift} partition state rows disagree with their entries"

    def connection_settings(self) -> dict[str, int | str]:
        return {
            name: str(self.db.execute_sql(f"SHOW {name}").fetchone()[0])
            for name in ("application_name", "lock_timeout", "transaction_isolation")
        }

    def backup(self, destination: str, progress: Callable[[int, int], None]) -> None:
        raise StoreError(
            "backup copies SQLite files; back up PostgreSQL with pg_dump or the "
            "operator's backups (or use `memory-sidecar export`)"
        )

    def change_feed(
        self,
        on_change: OnChange,
        settings: FeedSettings,
        *,
        on_session: OnSession | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> ChangeFeed:
        heartbeat = settings.heartbeat_seconds
        # The listener may take over a pooled connection (when the server
        # has no free slot): from now on they all notice a vanished server
        # as its own do.
        self.db.connect_params.update(_keepalives(heartbeat))
        return NotifyListener(
            lambda: self._listener_connection(heartbeat),
            on_change,
            heartbeat=heartbeat,
            publish=self._notify,
            pool=self.db,
            on_session=on_session,
            on_resync=on_resync,
            adopt=_adopt,
        )

    def _notify(self, payload: str) -> None:
        # Held for the listener, the pool would make this wait its timeout
        # (beyond most callers' deadlines) for a connection in use: a
        # session event or fence is refused at once instead.
        if self.db.would_wait():
            raise DatabaseBusy(
                "no database connection free (held for the change feed's listener); retry"
            )
        # Autocommit: delivered to every listener (this one's too) after
        # every notification committed before it.
        with self.guard(), self.db.connection_context():
            self.db.execute_sql("SELECT pg_notify(%s, %s)", (EVENTS_CHANNEL, payload))

    def _listener_connection(self, heartbeat: float) -> Any:
        # Errors as the pool's: DATABASE_BUSY for no free slot, DatabaseRefused
        # for a refused login (start-up waits on the one, not the other).
        with self.guard():
            return self._listener_connect(heartbeat)

    def _listener_connect(self, heartbeat: float) -> Any:
        return psycopg.connect(
            self._dsn,
            autocommit=True,
            **_keepalives(heartbeat),
            **self._connect_params(LISTENER_NAME),
        )


def _keepalives(heartbeat: float) -> dict[str, Any]:
    # A server that vanished without closing the socket (a partition, a dead
    # node) is noticed by TCP within a few heartbeats.
    return {
        "keepalives": 1,
        "keepalives_idle": max(1, round(heartbeat)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
    }


def _adopt(connection: Any) -> None:
    """A pooled connection made the listener's: autocommit (as Peewee keeps
    it), and named as the listener's in pg_stat_activity."""
    connection.autocommit = True
    connection.execute("SELECT set_config('application_name', %s, false)", (LISTENER_NAME,))
