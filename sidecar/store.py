"""The store: with its private helpers (_backend, _sqlite, _postgres,
_statements), the only code that touches Peewee.

Every public method opens a pooled connection for its own duration, so the
store is safe to call from any thread. Every write locks its partition's
state row (see sidecar._backend), checks the budget and duplicates against
it, and advances it in the same transaction, so concurrent writers, in this
process or any other, can never push a tier over its budget together.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import peewee
from peewee import fn

from sidecar import _sqlite
from sidecar._backend import SCHEMA_TABLE, Backend, FeedSettings, PartitionState, StatementSpan
from sidecar._statements import Record, Statements, Template
from sidecar.changes import ChangeFeed, OnChange
from sidecar.clock import Clock, from_micros, system_clock, to_micros
from sidecar.errors import (
    AlreadyExists,
    BudgetExceeded,
    CallerGone,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StoreError,
)
from sidecar.memory import (
    SEPARATOR_CHARS,
    Memory,
    Scope,
    Tier,
    Usage,
    rendered_chars,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = _sqlite.MIGRATIONS[-1][0]
# How long AddMemory remembers an idempotency key.
IDEMPOTENCY_TTL_MICROS = 24 * 3600 * 1_000_000
Wanted = Callable[[], bool]


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """What the calling agent's configuration says about one tier."""

    limit_chars: int
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class LegacyEntry:
    """One entry brought in from another store (cagent's memory.db)."""

    id: str
    content: str
    category: str
    created_at_micros: int


class Vector(NamedTuple):
    """An entry's embedding as stored: the encoder's name and its float16
    components (sidecar.embedding)."""

    model: str
    data: bytes


class Written(NamedTuple):
    """What a write did: the entry, the tier's usage after, and the generations
    of its partition before and after (equal when nothing changed)."""

    memory: Memory
    usage: Usage
    created: bool
    previous: int
    generation: int


class IndexSource(NamedTuple):
    """A partition's persisted compact index (`data`, as of generation
    `indexed`), the rows written since (`changed`, and the seqs `removed`),
    and the partition's usage and generation now."""

    data: bytes
    indexed: int
    changed: list[Record]
    removed: list[int]
    usage: Usage
    generation: int
    # Changes logged since the index (one seq may have changed many times).
    logged: int


class Loaded(NamedTuple):
    """One partition as of one generation."""

    memories: list[Memory]
    usage: Usage
    generation: int


def is_dsn(db: str) -> bool:
    """Whether `server.db` names a PostgreSQL database rather than an SQLite file."""
    return db.startswith(("postgresql://", "postgres://"))


def _usage_of(state: PartitionState) -> Usage:
    return Usage(rendered_chars(state.content_chars, state.entry_count), state.entry_count)


@dataclass(slots=True)
class ImportReport:
    imported: list[LegacyEntry] = field(default_factory=list)
    # (entry, why it was left out)
    skipped: list[tuple[LegacyEntry, str]] = field(default_factory=list)


class _Row(peewee.Model):
    """Column layout of `memories` (schema 2). Bound per store, see _bind."""

    seq = peewee.AutoField()
    memory_id = peewee.TextField(column_name="id", unique=True)
    tier = peewee.TextField()
    owner = peewee.TextField()
    content = peewee.TextField()
    content_chars = peewee.IntegerField()
    content_sha256 = peewee.TextField()
    category = peewee.TextField(default="")
    confidence = peewee.FloatField(default=1.0)
    created_at = peewee.BigIntegerField()
    updated_at = peewee.BigIntegerField()


class _Key(peewee.Model):
    """Column layout of `idempotency_keys` (schema 3)."""

    owner = peewee.TextField()
    tier = peewee.TextField()
    key = peewee.TextField()
    memory_id = peewee.TextField()
    content_sha256 = peewee.TextField()
    created_at = peewee.BigIntegerField()

    class Meta:
        primary_key = peewee.CompositeKey("owner", "tier", "key")


M = TypeVar("M", bound=peewee.Model)


def _bind(model: type[M], db: peewee.Database, table: str) -> type[M]:
    # A subclass per store instead of model.bind(db): binding mutates the class,
    # and two stores in one process (tests, the import command) must not share.
    meta = type("Meta", (), {"database": db, "table_name": table})
    return type(model.__name__.lstrip("_"), (model,), {"Meta": meta, "__module__": __name__})


# Seqs per `IN (...)` list (SQLite allows 32,766 parameters; PostgreSQL 65,535).
_SEQ_BATCH = 500


def _to_memory(row: _Row | Record) -> Memory:
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


class Store:
    """Tiered memories in one SQLite file or one PostgreSQL database.

    `db` is a file path, or a postgresql:// DSN (the password, if any, is
    given apart so that it never appears where the DSN is shown).

    >>> store = Store("memory.db"); store.open()
    >>> written = store.add(Scope("agent"), Tier.MEMORY, "uses uv", "", 1.0, TierPolicy(2200))
    """

    def __init__(
        self,
        db: str,
        *,
        password: str = "",
        synchronous: str = "normal",
        busy_timeout_ms: int = 5000,
        max_connections: int = 64,
        clock: Clock = system_clock,
        on_query: Callable[[str, float], None] | None = None,
    ) -> None:
        self._clock = clock
        self._backend: Backend
        if is_dsn(db):
            from sidecar._postgres import PostgresBackend  # needs the postgres extra

            self._backend = PostgresBackend(
                db,
                password=password,
                busy_timeout_ms=busy_timeout_ms,
                max_connections=max_connections,
            )
        else:
            self._backend = _sqlite.SqliteBackend(
                db,
                synchronous=synchronous,
                busy_timeout_ms=busy_timeout_ms,
                max_connections=max_connections,
            )
        # Where the data lives, for logs and messages (a DSN without password).
        self.path = self._backend.location
        self.backend = self._backend.name
        self._db = self._backend.db
        self._rows = _bind(_Row, self._db, "memories")
        self._keys = _bind(_Key, self._db, "idempotency_keys")
        self._sql = Statements(self._rows)
        if on_query is not None:
            # Peewee 4.5 reports every statement it runs, with its duration.
            self._db.query_hooks.append(lambda event: on_query(event.sql, event.duration))

    # --- lifecycle ----------------------------------------------------------

    def open(self) -> int:
        """Connect, check the storage, bring the schema up to date; return the
        schema version. A damaged database is refused here, before serving."""
        try:
            with self._guard(), self._db.connection_context():
                problem = self._backend.quick_check()
                if problem != "ok":
                    raise DataLoss(
                        f"{self.path} is damaged ({problem}); restore it from a backup, or run "
                        "`memory-sidecar check` for the full report",
                        reason="DATABASE_CORRUPT",
                    )
                return self._migrate()
        except BaseException:
            self.close()  # a store that failed to open holds no connection
            raise

    def close(self) -> None:
        """Close every pooled connection (the last close checkpoints the WAL)."""
        self._db.close_all()

    def trace(self, span: StatementSpan | None) -> None:
        """Run every statement inside `span(sql)` (sidecar.tracing); None stops."""
        self._backend.trace(span)

    def schema_version(self) -> int:
        with self._guard(), self._db.connection_context():
            return self._current_version()

    def integrity_check(self) -> str:
        with self._guard(), self._db.connection_context():
            return self._backend.integrity_check()

    def connection_settings(self) -> dict[str, int | str]:
        """The settings of the connection this thread is handed."""
        with self._guard(), self._db.connection_context():
            return self._backend.connection_settings()

    def backup(self, destination: str, progress: Callable[[int, int], None]) -> None:
        """A consistent copy of the whole database, safe while others write."""
        with self._guard(), self._db.connection_context():
            self._backend.backup(destination, progress)

    def change_feed(
        self, on_change: OnChange, *, poll_seconds: float, heartbeat_seconds: float
    ) -> ChangeFeed:
        """A feed of the partitions other processes write (not started)."""
        return self._backend.change_feed(
            on_change, FeedSettings(poll_seconds=poll_seconds, heartbeat_seconds=heartbeat_seconds)
        )

    def generations(self, keys: Iterable[tuple[Tier, str]]) -> dict[tuple[Tier, str], int]:
        """The current generation of each (tier, owner) partition that was ever written."""
        wanted = {(owner, tier.value): (tier, owner) for tier, owner in keys}
        with self._guard(), self._db.connection_context():
            states = self._backend.states(wanted)
        return {wanted[key]: state.generation for key, state in states.items()}

    def counts(self) -> dict[tuple[Tier, str], int]:
        """Entries per (tier, owner)."""
        Row = self._rows
        with self._guard(), self._db.connection_context():
            query = Row.select(Row.tier, Row.owner, fn.COUNT(Row.seq)).group_by(Row.tier, Row.owner)
            counts: dict[tuple[Tier, str], int] = {}
            rows: Iterable[tuple[str, str, int]] = query.tuples()  # type: ignore[assignment]
            for tier, owner, count in rows:
                counts[(Tier(tier), owner)] = int(count)
            return counts

    def dump(self, batch: int = 1000) -> Iterator[tuple[str, Memory]]:
        """Every entry as (owner, memory), in insertion order, read in one
        snapshot, `batch` rows at a time (a driver may hold a whole result
        in memory: a million-entry store would)."""
        Row = self._rows
        after = 0
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            while True:
                rows = list(Row.select().where(Row.seq > after).order_by(Row.seq).limit(batch))
                for row in rows:
                    yield row.owner, _to_memory(row)
                if len(rows) < batch:
                    return
                after = rows[-1].seq

    def restore(self, entries: Iterable[tuple[str, Memory]]) -> tuple[int, list[str]]:
        """Insert entries exactly as given, in one transaction.

        Returns how many were inserted and the ids left out because an entry
        with that id already exists. Budgets are not applied: this restores
        what a store held, it does not write on an agent's behalf.
        """
        Row = self._rows
        inserted, present = 0, []
        states: dict[tuple[str, Tier], PartitionState] = {}
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            for owner, memory in entries:
                if Row.select().where(Row.memory_id == memory.id).exists():
                    present.append(memory.id)
                    continue
                key = (owner, memory.tier)
                if key not in states:
                    states[key] = self._backend.lock_partition(owner, memory.tier.value)
                state = states[key]
                states[key] = state._replace(
                    content_chars=state.content_chars + len(memory.content),
                    entry_count=state.entry_count + 1,
                )
                self._insert(
                    memory.id,
                    owner,
                    memory.tier,
                    memory.content,
                    memory.category,
                    memory.confidence,
                    to_micros(memory.created_at),
                    updated_at=to_micros(memory.updated_at),
                )
                inserted += 1
            for (owner, tier), state in states.items():
                self._advance(owner, tier, state)
        if inserted:
            self._analyze()
        return inserted, present

    def _analyze(self) -> None:
        with self._guard(), self._db.connection_context():
            self._backend.analyze()

    def _current_version(self) -> int:
        tables = self._backend.table_names()
        if SCHEMA_TABLE not in tables:
            if "memories" in tables:
                raise StoreError(
                    f"{self.path} holds a 'memories' table but no schema version: it looks "
                    "like a cagent memory.db; adopt it with `memory-sidecar import-cagent`"
                )
            if tables:
                raise StoreError(
                    f"{self.path} is not a memory-sidecar database (it has tables {sorted(tables)})"
                )
            return 0
        row = self._db.execute_sql(f"SELECT version FROM {SCHEMA_TABLE}").fetchone()
        return int(row[0]) if row else 0

    def _migrate(self) -> int:
        with self._backend.migration_transaction():
            current = self._current_version()
            if current > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {current}, newer than this "
                    f"memory-sidecar understands ({SCHEMA_VERSION}); upgrade memory-sidecar"
                )
            for version, what, step in self._backend.migrations:
                if version <= current:
                    continue
                log.info("migrating %s to schema %d (%s)", self.path, version, what)
                step(self._db)
                self._db.execute_sql(
                    f"UPDATE {SCHEMA_TABLE} SET version = {self._db.param}", (version,)
                )
                current = version
        return current

    def _guard(self) -> contextlib.AbstractContextManager[None]:
        return self._backend.guard()

    # --- writes -------------------------------------------------------------

    def add(
        self,
        scope: Scope,
        tier: Tier,
        content: str,
        category: str,
        confidence: float,
        policy: TierPolicy,
        *,
        idempotency_key: str = "",
        still_wanted: Wanted | None = None,
        vector: Vector | None = None,
    ) -> Written:
        """Store an entry; say what was stored and whether it is new.

        Content identical to an entry of the same scope and tier returns that
        entry unchanged (created = False), and so does a retry carrying the
        idempotency key of an earlier add.
        """
        _require_enabled(tier, policy)
        owner = scope.owner(tier)
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            state = self._backend.lock_partition(owner, tier.value)
            _require_caller(still_wanted)
            usage = _usage_of(state)
            now = to_micros(self._clock())
            if idempotency_key:
                earlier = self._replay(owner, tier, idempotency_key, content, now)
                if earlier is not None:
                    unchanged = state.generation
                    return Written(_to_memory(earlier), usage, False, unchanged, unchanged)
            existing = self._identical(owner, tier, content)
            if existing is not None:
                self._remember(owner, tier, idempotency_key, existing.memory_id, content, now)
                unchanged = state.generation
                return Written(_to_memory(existing), usage, False, unchanged, unchanged)
            added = len(content) + (SEPARATOR_CHARS if state.entry_count else 0)
            _check_budget(tier, policy, usage.used_chars, usage.used_chars + added, added)
            row = self._insert(str(uuid.uuid4()), owner, tier, content, category, confidence, now)
            if vector is not None:
                digest = _sqlite.content_digest(content)
                self._backend.put_vector(row.seq, vector.model, digest, vector.data)
            self._remember(owner, tier, idempotency_key, row.memory_id, content, now)
            after = state._replace(
                content_chars=state.content_chars + len(content),
                entry_count=state.entry_count + 1,
            )
            generation = self._advance(owner, tier, after, [row.seq])
            return Written(_to_memory(row), _usage_of(after), True, state.generation, generation)

    def update(
        self,
        scope: Scope,
        memory_id: str,
        policies: Mapping[Tier, TierPolicy],
        *,
        content: str | None = None,
        category: str | None = None,
        confidence: float | None = None,
        still_wanted: Wanted | None = None,
        vector: Vector | None = None,
    ) -> Written:
        """Change the given fields of an entry of this scope (`vector`: the
        new content's embedding, stored if the content changes).

        Content identical to another entry of the same tier is refused
        (ALREADY_EXISTS, naming that entry): two entries never say the same.
        """
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            row, state = self._find_locked(scope, memory_id)
            _require_caller(still_wanted)
            tier = Tier(row.tier)
            policy = policies[tier]
            _require_enabled(tier, policy)
            usage = _usage_of(state)
            after = state
            if content is not None and content != row.content:
                twin = self._identical(row.owner, tier, content)
                if twin is not None:
                    raise AlreadyExists(
                        f"another entry of the {tier.label} tier already says exactly this "
                        f"(id {twin.memory_id}); update or delete that one instead",
                        reason="DUPLICATE_CONTENT",
                        metadata={"id": memory_id, "existing_id": twin.memory_id},
                    )
                delta = len(content) - row.content_chars
                after = state._replace(content_chars=state.content_chars + delta)
                # Only growth is refused: an entry may always shrink, even in
                # a tier already over a budget that was lowered after the fact.
                if delta > 0:
                    _check_budget(tier, policy, usage.used_chars, usage.used_chars + delta, delta)
                row = row._replace(content=content, content_chars=len(content))
                if vector is not None:
                    digest = _sqlite.content_digest(content)
                    self._backend.put_vector(row.seq, vector.model, digest, vector.data)
            if category is not None:
                row = row._replace(category=category)
            if confidence is not None:
                row = row._replace(confidence=float(confidence))
            row = row._replace(updated_at=to_micros(self._clock()))
            self._db.execute_sql(
                self._sql.update.sql,
                self._sql.update.params(
                    content=row.content,
                    content_chars=row.content_chars,
                    content_sha256=_sqlite.content_digest(row.content),
                    category=row.category,
                    confidence=row.confidence,
                    updated_at=row.updated_at,
                    seq=row.seq,
                ),
            )
            generation = self._advance(row.owner, tier, after, [row.seq])
            return Written(_to_memory(row), _usage_of(after), False, state.generation, generation)

    def delete(
        self, scope: Scope, memory_id: str, *, still_wanted: Wanted | None = None
    ) -> Written:
        """Remove an entry of this scope; the memory is as it was."""
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            row, state = self._find_locked(scope, memory_id)
            _require_caller(still_wanted)
            self._db.execute_sql(self._sql.delete.sql, self._sql.delete.params(seq=row.seq))
            after = state._replace(
                content_chars=state.content_chars - row.content_chars,
                entry_count=state.entry_count - 1,
            )
            generation = self._advance(row.owner, Tier(row.tier), after, [row.seq])
            return Written(_to_memory(row), _usage_of(after), False, state.generation, generation)

    def import_entries(
        self, scope: Scope, tier: Tier, entries: Iterable[LegacyEntry], policy: TierPolicy
    ) -> ImportReport:
        """Adopt entries with their ids and times, all in one transaction.

        Entries are taken in the order given; one that would overflow the tier,
        duplicates an entry already there, or reuses an id already taken is
        left out and reported, and the rest go on.
        """
        owner = scope.owner(tier)
        report = ImportReport()
        Row = self._rows
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            state = self._backend.lock_partition(owner, tier.value)
            used, count = _usage_of(state).used_chars, state.entry_count
            chars = state.content_chars
            for entry in entries:
                if not entry.content:
                    report.skipped.append((entry, "empty content"))
                    continue
                if Row.select().where(Row.memory_id == entry.id).exists():
                    report.skipped.append((entry, "id already present"))
                    continue
                if self._identical(owner, tier, entry.content) is not None:
                    report.skipped.append((entry, "identical entry already present"))
                    continue
                added = len(entry.content) + (SEPARATOR_CHARS if count else 0)
                if policy.limit_chars and used + added > policy.limit_chars:
                    report.skipped.append(
                        (
                            entry,
                            f"does not fit: needs {added:,} chars, "
                            f"{max(policy.limit_chars - used, 0):,} free",
                        )
                    )
                    continue
                self._insert(
                    entry.id,
                    owner,
                    tier,
                    entry.content,
                    entry.category,
                    1.0,
                    entry.created_at_micros,
                )
                used, count, chars = used + added, count + 1, chars + len(entry.content)
                report.imported.append(entry)
            if report.imported:
                self._advance(owner, tier, state._replace(content_chars=chars, entry_count=count))
        if report.imported:
            self._analyze()
        return report

    # --- reads --------------------------------------------------------------

    def list_memories(
        self,
        scope: Scope,
        tiers: Collection[Tier],
        category: str = "",
        *,
        after_seq: int = 0,
        limit: int | None = None,
    ) -> tuple[list[Memory], dict[Tier, Usage]]:
        """Entries of the given tiers in insertion order, and each tier's usage:
        the first `limit` entries after `after_seq` (a page), or all of them.

        One read transaction, so the list and the usage agree.
        """
        Row = self._rows
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            query = Row.select().where(_scope_clause(Row, scope, tiers) & (Row.seq > after_seq))
            if category:
                query = query.where(Row.category == category)
            query = query.order_by(Row.seq)
            if limit is not None:
                query = query.limit(limit)
            memories = [_to_memory(row) for row in query]
            usage = self._usages(scope, tiers)
        return memories, usage

    def tier_entries(self, tier: Tier, owner: str) -> Loaded:
        """One owner's entries of one tier in insertion order, their usage and
        the partition's generation, all as of one snapshot."""
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            rows = self._rows_of(self._sql.partition, owner=owner, tier=tier.value)
            state = self._backend.states([(owner, tier.value)]).get((owner, tier.value))
        memories = [_to_memory(row) for row in rows]
        if state is None:
            return Loaded(memories, Usage.of(row.content_chars for row in rows), 0)
        return Loaded(memories, _usage_of(state), state.generation)

    def tier_state(self, tier: Tier, owner: str) -> tuple[int, bool]:
        """How many entries the partition holds, and whether its changes are
        logged (it has or is getting a compact index), from its state row."""
        with self._guard(), self._db.connection_context():
            state = self._backend.states([(owner, tier.value)]).get((owner, tier.value))
        return (state.entry_count, state.indexed != 0) if state is not None else (0, False)

    def scan_tier(
        self, tier: Tier, owner: str, consume: Callable[[list[Record]], None], *, batch: int = 5000
    ) -> tuple[Usage, int]:
        """Hand one partition's entries to `consume`, `batch` rows at a time
        in insertion order, and return its usage and generation: all as of
        one snapshot, without holding every row (or a Memory per row) at once."""
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            state = self._backend.states([(owner, tier.value)]).get((owner, tier.value))
            params = self._sql.partition.params(owner=owner, tier=tier.value)
            chars = count = 0
            for rows in self._backend.batches(self._sql.partition.sql, params, batch):
                records = [Record(*row) for row in rows]
                chars += sum(r.content_chars for r in records)
                count += len(records)
                consume(records)
        if state is None:
            return Usage(rendered_chars(chars, count), count), 0
        return _usage_of(state), state.generation

    def compact_source(self, tier: Tier, owner: str) -> IndexSource:
        """What loading a partition from its persisted compact index needs,
        as of one snapshot (no index: `data` is empty)."""
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            state = self._backend.states([(owner, tier.value)]).get((owner, tier.value))
            if state is None or state.indexed <= 0:
                return IndexSource(b"", 0, [], [], Usage(), state.generation if state else 0, 0)
            data = self._backend.read_index(owner, tier.value, state.indexed)
            seqs, logged = self._backend.changes_since(owner, tier.value, state.indexed)
            changed = self._records_by_seq(owner, tier, seqs)
        present = {r.seq for r in changed}
        removed = [s for s in seqs if s not in present]
        usage = _usage_of(state)
        return IndexSource(data, state.indexed, changed, removed, usage, state.generation, logged)

    def start_logging(self, tier: Tier, owner: str) -> None:
        """Log the partition's changes from now on, unless they already are:
        an index built from what is read after this can be completed."""
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            state = self._backend.lock_partition(owner, tier.value)
            if not state.indexed:
                self._backend.start_logging(owner, tier.value, state.generation)

    def stop_logging(self, tier: Tier, owner: str) -> None:
        """Drop the partition's index and stop logging its changes (it is
        held in full: nothing would ever read or trim the log)."""
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            if self._backend.lock_partition(owner, tier.value).indexed:
                self._backend.drop_index(owner, tier.value)

    def save_index(self, tier: Tier, owner: str, generation: int, parts: Sequence[bytes]) -> bool:
        """Persist a partition's compact index as of `generation`, if that is
        newer than the one kept and every change since it is logged.

        The parts are written first, each in a transaction of its own and
        without the partition's lock (writers wait for neither: on SQLite a
        million-entry index took 1.3 s to write); only the switch to them
        locks the partition.
        """
        staging = -secrets.randbits(62) - 1
        with self._guard(), self._db.connection_context():
            for number, part in enumerate(parts):
                with self._backend.write_transaction():
                    self._backend.stage_index_part(owner, tier.value, staging, number, part)
            with self._backend.write_transaction():
                state = self._backend.lock_partition(owner, tier.value)
                if state.indexed > 0:
                    complete = state.indexed < generation
                else:  # logging since generation -(indexed + 1), or not at all
                    complete = state.indexed < 0 and generation >= -(state.indexed + 1)
                if complete:
                    self._backend.save_index(owner, tier.value, generation, staging)
                else:
                    self._backend.drop_staged(owner, tier.value, staging)
            return complete

    def memories_by_seq(self, tier: Tier, owner: str, seqs: Sequence[int]) -> list[Memory]:
        """The partition's entries with these seqs, in the order asked; any
        since removed are left out."""
        if not seqs:
            return []
        with self._guard(), self._db.connection_context():
            found = {r.seq: _to_memory(r) for r in self._records_by_seq(owner, tier, seqs)}
        return [found[s] for s in seqs if s in found]

    # --- embeddings -----------------------------------------------------------

    def vectors(self, tier: Tier, owner: str, model: str) -> tuple[list[int], list[bytes]]:
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
        self, model: str, after: int, limit: int, *, below: int | None = None
    ) -> list[tuple[int, str, str]]:
        """(seq, content, digest) of up to `limit` entries after seq `after`
        that lack a vector of this model for their current content; with
        `below`, only of tiers of fewer entries than that."""
        with self._guard(), self._db.connection_context():
            rows = self._backend.unembedded(model, after, limit, below)
        return [(int(seq), str(content), str(digest)) for seq, content, digest in rows]

    def put_vectors(self, model: str, vectors: Sequence[tuple[int, str, bytes]]) -> None:
        """Store (seq, digest, vector) rows computed apart from any write;
        a row whose entry is gone or now says something else is skipped."""
        if not vectors:
            return
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            for seq, digest, data in vectors:
                self._backend.put_vector_if_current(seq, model, digest, data)

    def usage(self, scope: Scope, tiers: Sequence[Tier]) -> dict[Tier, Usage]:
        with self._guard(), self._db.connection_context():
            return self._usages(scope, tiers)

    # --- helpers (call inside a connection) ---------------------------------

    def _rows_of(self, template: Template, **values: object) -> list[Record]:
        cursor = self._db.execute_sql(template.sql, template.params(**values))
        return [Record(*row) for row in cursor.fetchall()]

    def _records_by_seq(self, owner: str, tier: Tier, seqs: Sequence[int]) -> list[Record]:
        """The partition's rows with these seqs (those that exist), read
        `_SEQ_BATCH` at a time."""
        records: list[Record] = []
        for start in range(0, len(seqs), _SEQ_BATCH):
            sql, params = self._sql.by_seqs(owner, tier.value, seqs[start : start + _SEQ_BATCH])
            records.extend(Record(*row) for row in self._db.execute_sql(sql, params).fetchall())
        return records

    def _usages(self, scope: Scope, tiers: Collection[Tier]) -> dict[Tier, Usage]:
        keys = {tier: (scope.owner(tier), tier.value) for tier in tiers}
        states = self._backend.states(keys.values())
        return {
            tier: _usage_of(states[key]) if key in states else Usage() for tier, key in keys.items()
        }

    def _advance(
        self, owner: str, tier: Tier, after: PartitionState, seqs: Sequence[int] = ()
    ) -> int:
        """Store the partition's new state; return its generation. (A trigger
        logs the entries the write changed, if the partition's changes are
        logged.) A bulk write (no seqs) drops the partition's compact index:
        indexing its rows again is cheaper than replaying the log."""
        generation = self._backend.advance(
            owner, tier.value, after.content_chars, after.entry_count
        )
        if after.indexed and not seqs:
            self._backend.drop_index(owner, tier.value)
        return generation

    def _find_locked(self, scope: Scope, memory_id: str) -> tuple[Record, PartitionState]:
        """The entry of this scope with this id, and its partition's state row, locked.

        Read again once the partition is locked: another writer may have
        changed or removed the entry in between.
        """
        row = self._find(scope, memory_id)
        state = self._backend.lock_partition(row.owner, row.tier)
        locked = self._find(scope, memory_id)
        if (locked.owner, locked.tier) != (row.owner, row.tier):  # pragma: no cover - ids are fixed
            raise NotFound(f"no memory with id {memory_id!r} in this scope")
        return locked, state

    def _replay(
        self, owner: str, tier: Tier, key: str, content: str, now: int
    ) -> _Row | Record | None:
        """The entry an earlier add with this key stored, if the key is known."""
        Key = self._keys
        Key.delete().where(Key.created_at < now - IDEMPOTENCY_TTL_MICROS).execute()
        record = Key.get_or_none((Key.owner == owner) & (Key.tier == tier.value) & (Key.key == key))
        if record is None:
            return None
        if record.content_sha256 != _sqlite.content_digest(content):
            raise InvalidArgument(
                "idempotency_key was already used for different content; use a new key",
                reason="IDEMPOTENCY_KEY_REUSED",
                metadata={"idempotency_key": key},
            )
        Row = self._rows
        row: _Row | None = Row.get_or_none(Row.memory_id == record.memory_id)
        if row is None:
            raise FailedPrecondition(
                "idempotency_key was already used, and the memory it stored has been deleted since",
                reason="IDEMPOTENCY_KEY_USED",
                metadata={"idempotency_key": key, "id": record.memory_id},
            )
        return row

    def _remember(
        self, owner: str, tier: Tier, key: str, memory_id: str, content: str, now: int
    ) -> None:
        if key:
            self._keys.create(
                owner=owner,
                tier=tier.value,
                key=key,
                memory_id=memory_id,
                content_sha256=_sqlite.content_digest(content),
                created_at=now,
            )

    def _identical(self, owner: str, tier: Tier, content: str) -> Record | None:
        """The first entry of this owner and tier with exactly this content."""
        rows = self._rows_of(
            self._sql.identical,
            owner=owner,
            tier=tier.value,
            digest=_sqlite.content_digest(content),
            content=content,
        )
        return rows[0] if rows else None

    def _insert(
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
        cursor = self._db.execute_sql(
            self._sql.insert.sql,
            self._sql.insert.params(
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
        return row._replace(seq=self._backend.inserted_seq(cursor))

    def _find(self, scope: Scope, memory_id: str) -> Record:
        rows = self._rows_of(self._sql.by_id, id=memory_id)
        row = rows[0] if rows else None
        if row is None or row.owner != scope.owner(Tier(row.tier)):
            # The same answer whether the id does not exist or belongs to
            # another scope: a request never learns about other scopes.
            raise NotFound(
                f"no memory with id {memory_id!r} in this scope",
                metadata={"id": memory_id},
            )
        return row


def _scope_clause(Row: type[_Row], scope: Scope, tiers: Iterable[Tier]) -> Any:
    clause: Any = None
    for tier in tiers:
        part = (Row.tier == tier.value) & (Row.owner == scope.owner(tier))
        clause = part if clause is None else (clause | part)
    return clause


def _require_caller(still_wanted: Wanted | None) -> None:
    """Refuse to write for a caller that has gone.

    Checked after the write lock is taken: a call that waited on the lock
    past its deadline, or was cancelled, changes nothing.
    """
    if still_wanted is not None and not still_wanted():
        raise CallerGone("the caller cancelled or its deadline passed; nothing was written")


def _require_enabled(tier: Tier, policy: TierPolicy) -> None:
    if not policy.enabled:
        raise FailedPrecondition(
            f"the {tier.label} tier is disabled for this agent; writes to it are refused",
            reason="TIER_DISABLED",
            metadata={"tier": tier.value},
        )


def _check_budget(tier: Tier, policy: TierPolicy, used: int, after: int, added: int) -> None:
    if policy.limit_chars and after > policy.limit_chars:
        raise BudgetExceeded(
            tier=tier.value,
            label=tier.label,
            used=used,
            limit=policy.limit_chars,
            requested=added,
        )
