"""What the store needs from a database backend. Private to the storage
modules (see sidecar.storage.store).

Two backends implement it: SQLite (sidecar.storage._sqlite, the embedded default)
and PostgreSQL (sidecar.storage._postgres, for many replicas on one database). The
store's queries on `memories` come from Peewee's query builder and are
portable; what differs lives behind this class: connection set-up, schema
DDL, transactions, the per-partition state row and its generation, how other
processes hear about writes, and which driver errors mean what.

The per-partition state row (`tier_state`, one per owner and tier) holds the
partition's content_chars, entry_count and generation. Every write locks it,
checks the budget against it and advances it in the same transaction, so a
budget check is O(1) and budgets hold across processes.

Owns: the Backend contract, the table names, PartitionState, the portable SQL on
the state, index, change-log and vector tables, and statement tracing (which
error each storage fault is: its leaf in sidecar.core.errors, on both backends).
Must not touch: Peewee's models or query builder (sidecar.storage.store), caches,
the engine, gRPC, configuration (settings are arguments).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from sidecar.core.errors import StoreError
from sidecar.storage.changes import ChangeFeed, OnChange, OnSession

SCHEMA_TABLE = "schema_version"
STATE_TABLE = "tier_state"
# A large partition's compact index as of some generation, in parts, and the
# seqs each write since then changed (sidecar.retrieval.compact; schema 5).
INDEX_TABLE = "tier_index"
CHANGES_TABLE = "tier_changes"
# An entry's embedding for semantic retrieval (sidecar.retrieval.embedding; schema 6):
# one row per entry, deleted with it, naming the encoder and the content it
# was computed from, so a vector is only used for the text it describes.
VECTORS_TABLE = "memory_vectors"
# Every change of every partition, for WatchMemories (schema 7): one row per
# changed entry (kind add, update, delete, expire) or per erased partition
# (kind erase, no entry), keyed by the generation the write took. Pruned by
# age; EVENT_HORIZON_TABLE holds the largest generation pruned so far, so a
# resume from before it is refused instead of silently missing events.
EVENTS_TABLE = "memory_events"
EVENT_HORIZON_TABLE = "memory_event_horizon"
# Erasures (ForgetUser, DeleteScope): who, what, when and how many, never
# content (schema 7).
AUDIT_TABLE = "audit_log"
# Random keys made once per database by a migration, so that every replica
# of it holds the same ones (schema 8): page tokens are signed with
# PAGE_TOKEN_KEY (sidecar.api.paging).
KEYS_TABLE = "server_keys"
PAGE_TOKEN_KEY = "page_tokens"
KEY_BYTES = 32
# Session events (a compaction or an end of session sent to one replica) for
# the other processes' SQLite pollers, kept SESSION_EVENTS_KEPT_SECONDS
# (schema 9; PostgreSQL notifies instead and leaves the table empty).
SESSION_EVENTS_TABLE = "session_events"
SESSION_EVENTS_KEPT_SECONDS = 3600
# The duplicate check asks for a partition's first entry with a digest
# (ORDER BY seq LIMIT 1). With seq in the index no planner walks the whole
# partition in seq order instead (PostgreSQL's generic plan did: 1 ms per
# write at 10,000 entries).
CONTENT_INDEX = "(owner, tier, content_sha256, seq)"
# The agent notes written for a user (ForgetUser, a for_user export): rows
# of a known writer only (schema 10).
PROVENANCE_INDEX = (
    "CREATE INDEX idx_memories_written_for ON memories (written_for_user_id, tier, seq)"
    " WHERE written_for_user_id IS NOT NULL"
)
# Rows per multi-row INSERT of a bulk write (a restore): one round trip per
# batch, well under SQLite's 32,766 parameters and PostgreSQL's 65,535.
ROWS_PER_INSERT = 500
Step = Callable[[Any], None]
# sql -> a context manager the statement runs inside (sidecar.api.tracing).
StatementSpan = Callable[[str], contextlib.AbstractContextManager[Any]]
# Peewee sends queries through execute_sql, but BEGIN, COMMIT and ROLLBACK
# straight through a cursor: BEGIN IMMEDIATE is where an SQLite writer waits
# for the lock, COMMIT where it waits for the disk.
_TRANSACTION_CONTROL = ("begin", "commit", "rollback")


class PartitionState(NamedTuple):
    """A partition's state row: what its entries occupy, its generation, and
    `indexed`: the generation its persisted compact index is as of (> 0),
    or -(g + 1) while changes are logged from generation g on without an
    index yet, or 0 (neither). While it is not 0, a trigger on `memories`
    logs every change of the partition's entries (tier_changes: the seq and
    the partition's generation before the write), whichever process or
    statement makes it (schema 5)."""

    content_chars: int
    entry_count: int
    generation: int
    indexed: int = 0
    # The generation of the partition's last erasure (ForgetUser,
    # DeleteScope), 0 for none: a view built before it is never served again.
    erased: int = 0


@dataclass(frozen=True, slots=True)
class FeedSettings:
    """How a change feed hears about other processes' writes."""

    poll_seconds: float
    heartbeat_seconds: float


class ErrorGuard(abc.ABC):
    """Turns driver errors a client can act on into SidecarErrors; any other
    error passes through (and becomes INTERNAL, logged, at the edge)."""

    def __init__(self, location: str) -> None:
        self.location = location

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # The error a client can act on may be one the driver raised while
        # handling it: SQLite rolls back by itself on a full disk, and the
        # transaction's own ROLLBACK then fails with "no transaction is
        # active". Look down the chain.
        seen: set[int] = set()
        while isinstance(exc, Exception) and id(exc) not in seen:
            seen.add(id(exc))
            self.translate(exc)
            exc = exc.__cause__ or exc.__context__

    @abc.abstractmethod
    def translate(self, exc: Exception) -> None:
        """Raise the SidecarError that `exc` stands for, if it stands for one."""


def _traced(method: Callable[..., Any], sql: str, span: StatementSpan) -> Callable[..., Any]:
    def traced(*args: Any, **kwargs: Any) -> Any:
        with span(sql):
            return method(*args, **kwargs)

    return traced


class Backend(abc.ABC):
    """One database: its connections, schema and dialect."""

    name: ClassVar[str]
    # Where the data lives, fit for logs and messages (no password).
    location: str
    db: Any  # a pooled peewee.Database (playhouse is untyped)
    migrations: ClassVar[list[tuple[int, str, Step]]]

    def start(self) -> None:
        """Start the backend's own threads (the store has opened it): none here."""
        return None

    def stop(self) -> None:
        """Stop them (the store is closing)."""
        return None

    # --- transactions -------------------------------------------------------

    @abc.abstractmethod
    def write_transaction(self) -> contextlib.AbstractContextManager[Any]:
        """A read-then-write transaction; writers of one partition serialise
        on its state row (see lock_partition)."""

    @abc.abstractmethod
    def read_transaction(self) -> contextlib.AbstractContextManager[Any]:
        """A transaction whose reads all see one snapshot."""

    @abc.abstractmethod
    def migration_transaction(self) -> contextlib.AbstractContextManager[Any]:
        """A transaction only one process at a time runs: migrations."""

    @abc.abstractmethod
    def guard(self) -> contextlib.AbstractContextManager[None]:
        """Turns driver errors a client can act on into SidecarErrors."""

    # --- the state rows -----------------------------------------------------

    _lock_sql: str
    _create_sql: str
    _advance_sql: str
    # Empties a partition's state row, advances its generation and sets
    # `erased` to it, returning it (sidecar.storage.erasure); on PostgreSQL it also
    # NOTIFYs with the erasure, as _advance_sql does with a write.
    _erase_sql: str
    # The same with the partition's totals given: some entries were erased.
    _thin_sql: str
    # The SQL function (text, part) -> where part first occurs in text, from
    # 1, or 0: exact and case-sensitive, unlike LIKE (which SQLite folds for
    # ASCII, and where % and _ are wildcards).
    position_function: ClassVar[str]

    def key(self, name: str) -> bytes:
        """The database's key of that name (schema 8). Call inside a connection."""
        row = self.db.execute_sql(
            f"SELECT secret FROM {KEYS_TABLE} WHERE name = {self.db.param}", (name,)
        ).fetchone()
        if row is None:
            raise StoreError(f"{self.location} has no key {name!r}; was schema 8 rolled back?")
        return bytes(row[0])

    def lock_partition(self, owner: str, tier: str) -> PartitionState:
        """The partition's state row, locked until the transaction ends.

        Call inside write_transaction. A partition that has never been
        written gets its row here.
        """
        state = self.lock_existing(owner, tier)
        if state is None:
            self.db.execute_sql(self._create_sql, (owner, tier))
            state = self.lock_existing(owner, tier)
            assert state is not None
        return state

    def lock_existing(self, owner: str, tier: str) -> PartitionState | None:
        """The partition's state row locked as lock_partition does, or None
        (no row is created: a partition never written)."""
        row = self.db.execute_sql(self._lock_sql, (owner, tier)).fetchone()
        return None if row is None else PartitionState(*(int(value) for value in row))

    def advance(self, owner: str, tier: str, content_chars: int, entry_count: int) -> int:
        """Store the partition's new totals; return its new generation.

        Generations come from one sequence for the whole database, so a newer
        write always has a larger number than an older one. Call inside
        write_transaction, after lock_partition.
        """
        row = self.db.execute_sql(
            self._advance_sql, (content_chars, entry_count, owner, tier)
        ).fetchone()
        return int(row[0])

    def erased_state(self, owner: str, tier: str) -> int:
        """Mark the partition erased: its state row emptied (no entries, no
        index), its generation advanced, and `erased` set to that generation,
        which is returned. Call inside write_transaction, after lock_partition."""
        return int(self.db.execute_sql(self._erase_sql, (owner, tier)).fetchone()[0])

    def thinned_state(self, owner: str, tier: str, content_chars: int, entry_count: int) -> int:
        """Mark the partition erased after some of its entries were (the
        agent notes ForgetUser erases for a user): its totals set, its
        persisted index dropped, its generation advanced and `erased` set to
        it, which is returned. Call inside write_transaction, after
        lock_partition."""
        params = (content_chars, entry_count, owner, tier)
        return int(self.db.execute_sql(self._thin_sql, params).fetchone()[0])

    def batches(
        self, sql: str, params: Sequence[object], size: int
    ) -> Iterator[list[tuple[Any, ...]]]:
        """A query's rows, `size` at a time, without the driver holding them all."""
        cursor = self.db.execute_sql(sql, params)
        while rows := cursor.fetchmany(size):
            yield rows

    def states(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], PartitionState]:
        """The state rows of these (owner, tier) partitions that exist."""
        p = self.db.param
        sql = (
            f"SELECT content_chars, entry_count, generation, indexed, erased FROM {STATE_TABLE}"
            f" WHERE owner = {p} AND tier = {p}"
        )
        found: dict[tuple[str, str], PartitionState] = {}
        for owner, tier in keys:
            row = self.db.execute_sql(sql, (owner, tier)).fetchone()
            if row is not None:
                found[(owner, tier)] = PartitionState(*(int(value) for value in row))
        return found

    # --- the event log (WatchMemories) --------------------------------------

    def append_event(
        self, generation: int, owner: str, tier: str, kind: str, memory_id: str, at: int
    ) -> None:
        """Log one change for watchers. Inside the write's transaction."""
        p = self.db.param
        self.db.execute_sql(
            f"INSERT INTO {EVENTS_TABLE} (generation, owner, tier, kind, memory_id, at)"
            f" VALUES ({p}, {p}, {p}, {p}, {p}, {p})",
            (generation, owner, tier, kind, memory_id, at),
        )

    def append_events(
        self, generation: int, owner: str, tier: str, kind: str, memory_ids: Sequence[str], at: int
    ) -> None:
        """append_event for many entries of one write: one statement per
        batch of rows, not per row (a restore logs an event per entry)."""
        p = self.db.param
        for start in range(0, len(memory_ids), ROWS_PER_INSERT):
            batch = memory_ids[start : start + ROWS_PER_INSERT]
            values = ", ".join([f"({p}, {p}, {p}, {p}, {p}, {p})"] * len(batch))
            params = [v for m in batch for v in (generation, owner, tier, kind, m, at)]
            self.db.execute_sql(
                f"INSERT INTO {EVENTS_TABLE} (generation, owner, tier, kind, memory_id, at)"
                f" VALUES {values}",
                params,
            )

    def publish_session_event(self, payload: str, at: int) -> None:
        """Add a session event for other processes' pollers (SQLite's feed),
        dropping those older than SESSION_EVENTS_KEPT_SECONDS: a poller that
        was away longer resyncs instead (sidecar.storage._sqlite.DataVersionPoller)."""
        p = self.db.param
        with self.guard(), self.db.connection_context(), self.write_transaction():
            self.db.execute_sql(
                f"DELETE FROM {SESSION_EVENTS_TABLE} WHERE at < {p}",
                (at - SESSION_EVENTS_KEPT_SECONDS * 1_000_000,),
            )
            self.db.execute_sql(
                f"INSERT INTO {SESSION_EVENTS_TABLE} (payload, at) VALUES ({p}, {p})", (payload, at)
            )

    # --- the persisted compact index (sidecar.retrieval.compact) ----------------------

    def start_logging(self, owner: str, tier: str, generation: int) -> None:
        """Log the partition's changes from `generation` on (no index yet).
        Inside write_transaction, after lock_partition."""
        p = self.db.param
        self.db.execute_sql(
            f"UPDATE {STATE_TABLE} SET indexed = {p} WHERE owner = {p} AND tier = {p}",
            (-(generation + 1), owner, tier),
        )

    def drop_index(self, owner: str, tier: str) -> None:
        """Forget the partition's persisted index (a bulk write: import,
        restore); its next load indexes its rows. Inside write_transaction."""
        p = self.db.param
        for table in (INDEX_TABLE, CHANGES_TABLE):
            sql = f"DELETE FROM {table} WHERE owner = {p} AND tier = {p}"
            self.db.execute_sql(sql, (owner, tier))
        self.db.execute_sql(
            f"UPDATE {STATE_TABLE} SET indexed = 0 WHERE owner = {p} AND tier = {p}", (owner, tier)
        )

    def read_index(self, owner: str, tier: str, generation: int) -> bytes:
        p = self.db.param
        cursor = self.db.execute_sql(
            f"SELECT data FROM {INDEX_TABLE}"
            f" WHERE owner = {p} AND tier = {p} AND generation = {p} ORDER BY part",
            (owner, tier, generation),
        )
        return b"".join(bytes(row[0]) for row in cursor.fetchall())

    def changes_since(self, owner: str, tier: str, generation: int) -> tuple[list[int], int]:
        """The seqs the writes after that generation changed, each once, and
        how many changes were logged (a seq changed twice counts twice)."""
        p = self.db.param
        cursor = self.db.execute_sql(
            f"SELECT seq, COUNT(*) FROM {CHANGES_TABLE}"
            f" WHERE owner = {p} AND tier = {p} AND generation >= {p} GROUP BY seq",
            (owner, tier, generation),
        )
        rows = cursor.fetchall()
        return sorted(int(row[0]) for row in rows), sum(int(row[1]) for row in rows)

    def stage_index_part(
        self, owner: str, tier: str, generation: int, number: int, part: bytes
    ) -> bool:
        """Store one part of an index as of `generation` (in use once
        save_index says so); False, storing nothing, if that part is there:
        an index in use, or another attempt's (under way or cut off)."""
        p = self.db.param
        cursor = self.db.execute_sql(
            f"INSERT INTO {INDEX_TABLE} (owner, tier, generation, part, data)"
            f" VALUES ({p}, {p}, {p}, {p}, {p})"
            " ON CONFLICT (owner, tier, generation, part) DO NOTHING",
            (owner, tier, generation, number, part),
        )
        return int(cursor.rowcount) == 1

    def index_parts_before(self, owner: str, tier: str, generation: int) -> list[tuple[int, int]]:
        """(generation, part) of the index parts older than `generation`."""
        p = self.db.param
        sql = f"SELECT generation, part FROM {INDEX_TABLE} WHERE owner = {p} AND tier = {p}"
        rows = self.db.execute_sql(f"{sql} AND generation < {p}", (owner, tier, generation))
        return [(int(g), int(n)) for g, n in rows.fetchall()]

    def drop_index_part(self, owner: str, tier: str, generation: int, part: int) -> None:
        p = self.db.param
        self.db.execute_sql(
            f"DELETE FROM {INDEX_TABLE}"
            f" WHERE owner = {p} AND tier = {p} AND generation = {p} AND part = {p}",
            (owner, tier, generation, part),
        )

    def save_index(self, owner: str, tier: str, generation: int) -> None:
        """Put the index staged as of `generation` in use, in place (moving
        a 13.5 MB part to a new key held the write lock 0.7 s), and drop the
        changes it holds from the log (logged with the generation before
        each write). Inside write_transaction, after lock_partition."""
        p = self.db.param
        self.db.execute_sql(
            f"DELETE FROM {CHANGES_TABLE} WHERE owner = {p} AND tier = {p} AND generation < {p}",
            (owner, tier, generation),
        )
        self.db.execute_sql(
            f"UPDATE {STATE_TABLE} SET indexed = {p} WHERE owner = {p} AND tier = {p}",
            (generation, owner, tier),
        )

    # --- embeddings (sidecar.retrieval.embedding) --------------------------------------

    def put_vector(self, seq: int, model: str, digest: str, data: bytes) -> None:
        """Store (or replace) an entry's vector. Inside write_transaction."""
        p = self.db.param
        self.db.execute_sql(
            f"INSERT INTO {VECTORS_TABLE} (seq, model, content_sha256, vector)"
            f" VALUES ({p}, {p}, {p}, {p}) ON CONFLICT (seq) DO UPDATE SET"
            " model = excluded.model, content_sha256 = excluded.content_sha256,"
            " vector = excluded.vector",
            (seq, model, digest, data),
        )

    def put_vector_if_current(self, seq: int, model: str, digest: str, data: bytes) -> None:
        """put_vector, unless the entry is gone or its content changed since
        the vector was computed from it (a backfill racing a write)."""
        p = self.db.param
        self.db.execute_sql(
            f"INSERT INTO {VECTORS_TABLE} (seq, model, content_sha256, vector)"
            f" SELECT {p}, {p}, {p}, {p}"
            f" WHERE EXISTS (SELECT 1 FROM memories WHERE seq = {p} AND content_sha256 = {p})"
            " ON CONFLICT (seq) DO UPDATE SET"
            " model = excluded.model, content_sha256 = excluded.content_sha256,"
            " vector = excluded.vector",
            (seq, model, digest, data, seq, digest),
        )

    def vectors(self, owner: str, tier: str, model: str) -> Iterator[list[tuple[Any, ...]]]:
        """(seq, vector) of the partition's entries whose vector is this
        model's and describes their current content, by seq, in batches."""
        p = self.db.param
        return self.batches(
            f"SELECT v.seq, v.vector FROM {VECTORS_TABLE} v JOIN memories m ON m.seq = v.seq"
            f" WHERE m.owner = {p} AND m.tier = {p} AND v.model = {p}"
            " AND v.content_sha256 = m.content_sha256 ORDER BY v.seq",
            (owner, tier, model),
            4096,
        )

    def unembedded(
        self, model: str, after: int, limit: int, below: int | None, size: int | None = None
    ) -> list[tuple[Any, ...]]:
        """(seq, content, digest) of up to `limit` entries past seq `after`
        without a current vector of this model (of `size` bytes, if given),
        by seq; with `below`, only of partitions of fewer entries than that."""
        p = self.db.param
        params: list[Any] = [model]
        sized = ""
        if size is not None:
            # length() is a blob's and a bytea's size in bytes on both.
            sized = f" AND length(v.vector) = {p}"
            params.append(size)
        params.append(after)
        smaller = ""
        if below is not None:
            smaller = (
                f" AND EXISTS (SELECT 1 FROM {STATE_TABLE} s WHERE s.owner = m.owner"
                f" AND s.tier = m.tier AND s.entry_count < {p})"
            )
            params.append(below)
        params.append(limit)
        cursor = self.db.execute_sql(
            f"SELECT m.seq, m.content, m.content_sha256 FROM memories m"
            f" LEFT JOIN {VECTORS_TABLE} v ON v.seq = m.seq AND v.model = {p}"
            f" AND v.content_sha256 = m.content_sha256{sized}"
            f" WHERE v.seq IS NULL AND m.seq > {p}{smaller} ORDER BY m.seq LIMIT {p}",
            tuple(params),
        )
        return list(cursor.fetchall())

    def all_states(self) -> Iterator[tuple[str, str, PartitionState]]:
        """Every state row, as (owner, tier, state)."""
        cursor = self.db.execute_sql(
            f"SELECT owner, tier, content_chars, entry_count, generation FROM {STATE_TABLE}"
        )
        for owner, tier, chars, count, generation in cursor:
            yield owner, tier, PartitionState(int(chars), int(count), int(generation))

    # --- everything else ----------------------------------------------------

    def trace(self, span: StatementSpan | None) -> None:
        """Run every statement this database sends inside `span(sql)`; None
        goes back to Peewee's own methods.

        Wraps the methods of this one Database instance, so an untraced
        store runs Peewee's code untouched, at no cost.
        """
        db = self.db
        for name in ("execute_sql", *_TRANSACTION_CONTROL):
            vars(db).pop(name, None)
        if span is None:
            return
        execute_sql = db.execute_sql

        def traced_execute_sql(sql: str, params: Any = None, *args: Any, **kwargs: Any) -> Any:
            with span(sql):
                return execute_sql(sql, params, *args, **kwargs)

        db.execute_sql = traced_execute_sql
        for name in _TRANSACTION_CONTROL:
            setattr(db, name, _traced(getattr(db, name), name.upper(), span))

    def inserted_seq(self, cursor: Any) -> int:
        """The seq of the row an INSERT just added."""
        return int(cursor.lastrowid)

    @abc.abstractmethod
    def table_names(self) -> set[str]: ...

    @abc.abstractmethod
    def analyze(self) -> None:
        """Refresh the planner's statistics after a bulk load."""

    def quick_check(self) -> str:
        """'ok', or the first problem found by a fast structural check (run at
        start-up; a server-side database checks its own storage)."""
        return "ok"

    @abc.abstractmethod
    def integrity_check(self) -> str:
        """'ok', or what is wrong with the database's storage."""

    @abc.abstractmethod
    def connection_settings(self) -> dict[str, int | str]:
        """The settings of the connection this thread is handed."""

    @abc.abstractmethod
    def backup(self, destination: str, progress: Callable[[int, int], None]) -> None: ...

    @abc.abstractmethod
    def change_feed(
        self,
        on_change: OnChange,
        settings: FeedSettings,
        *,
        on_session: OnSession | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> ChangeFeed:
        """A feed of other processes' writes, started by the caller, that
        tells its listeners (given here: see ChangeFeed)."""
