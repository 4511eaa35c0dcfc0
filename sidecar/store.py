"""The store: with its private helpers (_sqlite, _statements), the only code that touches Peewee.

Every public method opens a pooled connection for its own duration, so the
store is safe to call from any thread. Writes that read before they write
(budget checks, de-duplication) run in one BEGIN IMMEDIATE transaction, so
concurrent writers can never push a tier over its budget together.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import peewee
from peewee import fn

from sidecar import _sqlite
from sidecar._statements import Record, Statements, Template
from sidecar.clock import Clock, from_micros, system_clock, to_micros
from sidecar.errors import (
    BudgetExceeded,
    CallerGone,
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
    """Tiered memories in one SQLite file.

    >>> store = Store("memory.db"); store.open()
    >>> memory, usage, created = store.add(Scope("agent"), Tier.MEMORY, "uses uv", "", 1.0,
    ...                                    TierPolicy(2200))
    """

    def __init__(
        self,
        path: str,
        *,
        synchronous: str = "normal",
        busy_timeout_ms: int = 5000,
        max_connections: int = 64,
        clock: Clock = system_clock,
        on_query: Callable[[str, float], None] | None = None,
    ) -> None:
        self.path = path
        self._clock = clock
        self._db = _sqlite.open_database(
            path,
            synchronous=synchronous,
            busy_timeout_ms=busy_timeout_ms,
            max_connections=max_connections,
        )
        self._rows = _bind(_Row, self._db, "memories")
        self._keys = _bind(_Key, self._db, "idempotency_keys")
        self._sql = Statements(self._rows)
        if on_query is not None:
            # Peewee 4.5 reports every statement it runs, with its duration.
            self._db.query_hooks.append(lambda event: on_query(event.sql, event.duration))

    # --- lifecycle ----------------------------------------------------------

    def open(self) -> int:
        """Connect and bring the schema up to date; return the schema version."""
        with self._guard(), self._db.connection_context():
            return self._migrate()

    def close(self) -> None:
        """Close every pooled connection (the last close checkpoints the WAL)."""
        self._db.close_all()

    def schema_version(self) -> int:
        with self._guard(), self._db.connection_context():
            return self._current_version()

    def integrity_check(self) -> str:
        with self._guard(), self._db.connection_context():
            row = self._db.execute_sql("PRAGMA integrity_check").fetchone()
            return str(row[0])

    def connection_settings(self) -> dict[str, int | str]:
        """The SQLite settings of the connection this thread is handed."""
        with self._guard(), self._db.connection_context():
            return {
                name: self._db.execute_sql(f"PRAGMA {name}").fetchone()[0]
                for name in ("journal_mode", "synchronous", "busy_timeout", "foreign_keys")
            }

    def backup(self, destination: str, progress: Callable[[int, int], None]) -> None:
        """A consistent copy of the whole database, safe while others write."""
        with self._guard(), self._db.connection_context():
            _sqlite.backup(self._db, destination, progress)

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

    def dump(self) -> Iterator[tuple[str, Memory]]:
        """Every entry as (owner, memory), in insertion order, read in one snapshot."""
        Row = self._rows
        with self._guard(), self._db.connection_context(), self._db.atomic():
            for row in Row.select().order_by(Row.seq).iterator():
                yield row.owner, _to_memory(row)

    def restore(self, entries: Iterable[tuple[str, Memory]]) -> tuple[int, list[str]]:
        """Insert entries exactly as given, in one transaction.

        Returns how many were inserted and the ids left out because an entry
        with that id already exists. Budgets are not applied: this restores
        what a store held, it does not write on an agent's behalf.
        """
        Row = self._rows
        inserted, present = 0, []
        with self._guard(), self._db.connection_context(), _sqlite.write_transaction(self._db):
            for owner, memory in entries:
                if Row.select().where(Row.memory_id == memory.id).exists():
                    present.append(memory.id)
                    continue
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
        return inserted, present

    def _current_version(self) -> int:
        tables = _sqlite.table_names(self._db)
        if _sqlite.SCHEMA_TABLE not in tables:
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
        row = self._db.execute_sql(f"SELECT version FROM {_sqlite.SCHEMA_TABLE}").fetchone()
        return int(row[0]) if row else 0

    def _migrate(self) -> int:
        with _sqlite.write_transaction(self._db):
            current = self._current_version()
            if current > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {current}, newer than this "
                    f"memory-sidecar understands ({SCHEMA_VERSION}); upgrade memory-sidecar"
                )
            for version, what, step in _sqlite.MIGRATIONS:
                if version <= current:
                    continue
                log.info("migrating %s to schema %d (%s)", self.path, version, what)
                step(self._db)
                self._db.execute_sql(f"UPDATE {_sqlite.SCHEMA_TABLE} SET version = ?", (version,))
                current = version
        return current

    def _guard(self) -> _sqlite.ErrorGuard:
        return _sqlite.ErrorGuard(self.path)

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
    ) -> tuple[Memory, Usage, bool]:
        """Store an entry; return it, the tier's usage after, and whether it is new.

        Content identical to an entry of the same scope and tier returns that
        entry unchanged (created = False), and so does a retry carrying the
        idempotency key of an earlier add.
        """
        _require_enabled(tier, policy)
        owner = scope.owner(tier)
        with self._guard(), self._db.connection_context(), _sqlite.write_transaction(self._db):
            _require_caller(still_wanted)
            now = to_micros(self._clock())
            if idempotency_key:
                earlier = self._replay(owner, tier, idempotency_key, content, now)
                if earlier is not None:
                    return _to_memory(earlier), self._usage(owner, tier), False
            existing = self._identical(owner, tier, content)
            usage = self._usage(owner, tier)
            if existing is not None:
                self._remember(owner, tier, idempotency_key, existing.memory_id, content, now)
                return _to_memory(existing), usage, False
            added = len(content) + (SEPARATOR_CHARS if usage.entry_count else 0)
            _check_budget(tier, policy, usage.used_chars, usage.used_chars + added, added)
            row = self._insert(str(uuid.uuid4()), owner, tier, content, category, confidence, now)
            self._remember(owner, tier, idempotency_key, row.memory_id, content, now)
            after = Usage(usage.used_chars + added, usage.entry_count + 1)
            return _to_memory(row), after, True

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
    ) -> tuple[Memory, Usage]:
        """Change the given fields of an entry of this scope."""
        with self._guard(), self._db.connection_context(), _sqlite.write_transaction(self._db):
            _require_caller(still_wanted)
            row = self._find(scope, memory_id)
            tier = Tier(row.tier)
            policy = policies[tier]
            _require_enabled(tier, policy)
            usage = self._usage(row.owner, tier)
            if content is not None and content != row.content:
                delta = len(content) - row.content_chars
                after = usage.used_chars + delta
                # Only growth is refused: an entry may always shrink, even in
                # a tier already over a budget that was lowered after the fact.
                if delta > 0:
                    _check_budget(tier, policy, usage.used_chars, after, delta)
                usage = Usage(after, usage.entry_count)
                row = row._replace(content=content, content_chars=len(content))
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
            return _to_memory(row), usage

    def delete(
        self, scope: Scope, memory_id: str, *, still_wanted: Wanted | None = None
    ) -> tuple[Memory, Usage]:
        """Remove an entry of this scope; return it as it was."""
        with self._guard(), self._db.connection_context(), _sqlite.write_transaction(self._db):
            _require_caller(still_wanted)
            row = self._find(scope, memory_id)
            self._db.execute_sql(self._sql.delete.sql, self._sql.delete.params(seq=row.seq))
            return _to_memory(row), self._usage(row.owner, Tier(row.tier))

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
        with self._guard(), self._db.connection_context(), _sqlite.write_transaction(self._db):
            usage = self._usage(owner, tier)
            used, count = usage.used_chars, usage.entry_count
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
                used, count = used + added, count + 1
                report.imported.append(entry)
        return report

    # --- reads --------------------------------------------------------------

    def list_memories(
        self, scope: Scope, tiers: Collection[Tier], category: str = ""
    ) -> tuple[list[Memory], dict[Tier, Usage]]:
        """Entries of the given tiers in insertion order, and each tier's usage.

        One read transaction, so the list and the usage agree.
        """
        Row = self._rows
        with self._guard(), self._db.connection_context(), self._db.atomic():
            query = Row.select().where(_scope_clause(Row, scope, tiers))
            if category:
                query = query.where(Row.category == category)
            memories = [_to_memory(row) for row in query.order_by(Row.seq)]
            usage = {tier: self._usage(scope.owner(tier), tier) for tier in tiers}
        return memories, usage

    def tier_entries(self, tier: Tier, owner: str) -> tuple[list[Memory], Usage]:
        """One owner's entries of one tier in insertion order, and their usage."""
        with self._guard(), self._db.connection_context():
            rows = self._rows_of(self._sql.partition, owner=owner, tier=tier.value)
        memories = [_to_memory(row) for row in rows]
        return memories, Usage.of(row.content_chars for row in rows)

    def usage(self, scope: Scope, tiers: Sequence[Tier]) -> dict[Tier, Usage]:
        with self._guard(), self._db.connection_context(), self._db.atomic():
            return {tier: self._usage(scope.owner(tier), tier) for tier in tiers}

    # --- helpers (call inside a connection) ---------------------------------

    def _rows_of(self, template: Template, **values: object) -> list[Record]:
        cursor = self._db.execute_sql(template.sql, template.params(**values))
        return [Record(*row) for row in cursor.fetchall()]

    def _usage(self, owner: str, tier: Tier) -> Usage:
        template = self._sql.usage
        chars, count = self._db.execute_sql(
            template.sql, template.params(owner=owner, tier=tier.value)
        ).fetchone()
        return Usage(rendered_chars(int(chars), int(count)), int(count))

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
        return row._replace(seq=cursor.lastrowid)

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
