"""The store: tiered memories in one database, written within each tier's
budget, a write taken as one value (sidecar.storage.writes). Beside it,
sharing the handle it builds (sidecar.storage._tables), are the other
storage modules: schema, index (`store.indexes`), vectors (`store.vectors`),
expiry, events, erasure, and archive (backup, dump, restore, import).

Every public method opens a pooled connection for its own duration: the
store is safe to call from any thread. Every write locks its partition's
state row (sidecar.storage._backend), checks the budget and duplicates
against it and advances it in one transaction: concurrent writers, of any
process, can never push a tier over its budget together.

Owns: Store (its backend, lifecycle, the writes and reads of entries, usage,
idempotency keys). Must not touch: the engine, service, server, ranking or
compact; with its neighbours and private helpers (_tables, _backend,
_sqlite, _postgres, _statements) the only code that touches Peewee.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

from peewee import fn

from sidecar.core.clock import Clock, system_clock, to_micros
from sidecar.core.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, Reason
from sidecar.core.memory import SEPARATOR_CHARS, Memory, Scope, Tier, Usage
from sidecar.storage import _sqlite, schema
from sidecar.storage._backend import (
    PAGE_TOKEN_KEY,
    Backend,
    FeedSettings,
    PartitionState,
    StatementSpan,
)
from sidecar.storage._statements import Record, unexpired
from sidecar.storage._tables import Tables, scope_clause, to_memory, usage_of
from sidecar.storage.changes import ChangeFeed, OnChange, OnSession
from sidecar.storage.erasure import Erasure
from sidecar.storage.events import EventLog
from sidecar.storage.expiry import (
    Expired,
    ExpiryStore,
    Purged,
    advance,
)
from sidecar.storage.group_commit import GroupCommit
from sidecar.storage.index import IndexStore
from sidecar.storage.schema import _Row
from sidecar.storage.vectors import Vector, VectorStore
from sidecar.storage.writes import (
    NEVER,
    UNCHANGED,
    Edit,
    Expires,
    NewEntry,
    TierPolicy,
    Wanted,
    Written,
    check_budget,
    require_caller,
    require_enabled,
    require_expected,
)

log = logging.getLogger("sidecar.store")

# How long close() waits for connections other threads still use.
CLOSE_WAIT_SECONDS = 5.0

# How long AddMemory remembers an idempotency key.
IDEMPOTENCY_TTL_MICROS = 24 * 3600 * 1_000_000


class Loaded(NamedTuple):
    """One partition as of one generation."""

    memories: list[Memory]
    usage: Usage
    generation: int
    # The latest expiry of the entries left out as expired (ExpiryStore.hidden).
    hidden: int | None = None


def is_dsn(db: str) -> bool:
    """Whether `server.db` names a PostgreSQL database rather than an SQLite file."""
    return db.startswith(("postgresql://", "postgres://"))


class Store:
    """Tiered memories in one SQLite file or one PostgreSQL database.

    `db` is a file path, or a postgresql:// DSN (the password, if any, is
    given apart so that it never appears where the DSN is shown).

    >>> store = Store("memory.db"); store.open() == schema.SCHEMA_VERSION  # brought up to date
    True
    >>> written = store.add(NewEntry(Scope("agent"), Tier.MEMORY, "uses uv"), TierPolicy(2200))
    >>> store.close()
    """

    def __init__(
        self,
        db: str,
        *,
        password: str = "",
        synchronous: str = "normal",
        busy_timeout_ms: int = 5000,
        max_connections: int = 64,
        pool_idle_seconds: float = 60.0,
        clock: Clock = system_clock,
        on_query: Callable[[str, float], None] | None = None,
        expiry_batch: int = 500,
        expiry_grace_seconds: float = 0.0,
        group_commit: bool = True,
        on_group: Callable[[int], None] | None = None,
    ) -> None:
        self._clock = self.clock = clock  # "now" for expiry here and in the caches above
        self._backend: Backend
        if is_dsn(db):
            from sidecar.storage._postgres import PostgresBackend  # needs the postgres extra

            self._backend = PostgresBackend(
                db,
                password=password,
                busy_timeout_ms=busy_timeout_ms,
                max_connections=max_connections,
                idle_seconds=pool_idle_seconds,
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
        # The handle the storage modules share, and the concerns beside the
        # rows that have a module each (sidecar.storage.archive reaches `tables`).
        self.tables = Tables(self._backend, clock)
        self.indexes = IndexStore(self.tables)
        self.expiry = ExpiryStore(
            self.tables, batch=expiry_batch, grace_seconds=expiry_grace_seconds
        )
        self.vectors = VectorStore(self.tables)
        self.events = EventLog(self.tables)
        self.erasure = Erasure(self.tables, clock)
        # Adds share transactions on SQLite only: on PostgreSQL writers of
        # different partitions already run at once (row locks), and a group
        # locking many state rows could deadlock with another replica's.
        grouped = group_commit and self.backend == "sqlite"
        self.group_commit = GroupCommit(self._backend, enabled=grouped, on_group=on_group)
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
                        reason=Reason.DATABASE_CORRUPT,
                    )
                version = schema.migrate(self._backend)
            self._backend.start()
            return version
        except BaseException:
            self.close()  # a store that failed to open holds no connection
            raise

    def close(self, wait: float = CLOSE_WAIT_SECONDS) -> None:
        """Close every pooled connection (the last close checkpoints the WAL).

        Connections another thread still uses (a call past the server's
        grace, a stream finishing its read) are waited for, up to `wait`
        seconds: closing one under a running statement frees the driver's
        connection beneath it, which crashed the process (a segfault in
        libpq, seen with a WatchMemories read during shutdown)."""
        deadline = time.monotonic() + wait
        while (busy := self._borrowed()) and time.monotonic() < deadline:
            time.sleep(0.01)
        if busy:
            log.warning("closing the store while %d connections are still in use", busy)
        self._backend.stop()
        self._db.close_all()

    def _borrowed(self) -> int:
        """Connections handed out to other threads than this one."""
        mine = 0 if self._db.is_closed() else 1
        return max(0, len(getattr(self._db, "_in_use", ())) - mine)

    def page_token_key(self) -> bytes:
        """The key page tokens are signed with: random, made once per
        database, so every replica on it accepts the others' tokens."""
        with self._guard(), self._db.connection_context():
            return self._backend.key(PAGE_TOKEN_KEY)

    def trace(self, span: StatementSpan | None) -> None:
        """Run every statement inside `span(sql)` (sidecar.api.tracing); None stops."""
        self._backend.trace(span)

    def schema_version(self) -> int:
        with self._guard(), self._db.connection_context():
            return schema.current_version(self._backend)

    def integrity_check(self) -> str:
        with self._guard(), self._db.connection_context():
            return self._backend.integrity_check()

    def connection_settings(self) -> dict[str, int | str]:
        """The settings of the connection this thread is handed."""
        with self._guard(), self._db.connection_context():
            return self._backend.connection_settings()

    def change_feed(
        self,
        on_change: OnChange,
        *,
        poll_seconds: float,
        heartbeat_seconds: float,
        on_session: OnSession | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> ChangeFeed:
        """A feed of the partitions other processes write (not started)."""
        settings = FeedSettings(poll_seconds=poll_seconds, heartbeat_seconds=heartbeat_seconds)
        return self._backend.change_feed(
            on_change, settings, on_session=on_session, on_resync=on_resync
        )

    def generations(self, keys: Iterable[tuple[Tier, str]]) -> dict[tuple[Tier, str], int]:
        """The current generation of each (tier, owner) partition that was ever written."""
        return {key: generation for key, (generation, _) in self.freshness(keys).items()}

    def freshness(
        self, keys: Iterable[tuple[Tier, str]]
    ) -> dict[tuple[Tier, str], tuple[int, int]]:
        """(generation, generation of its last erasure or 0) of each (tier,
        owner) partition that was ever written."""
        wanted = {(owner, tier.value): (tier, owner) for tier, owner in keys}
        with self._guard(), self._db.connection_context():
            states = self._backend.states(wanted)
        return {wanted[key]: (state.generation, state.erased) for key, state in states.items()}

    def counts(self) -> dict[tuple[Tier, str], int]:
        """Entries per (tier, owner)."""
        Row = self.tables.rows
        with self._guard(), self._db.connection_context():
            query = Row.select(Row.tier, Row.owner, fn.COUNT(Row.seq)).group_by(Row.tier, Row.owner)
            counts: dict[tuple[Tier, str], int] = {}
            rows: Iterable[tuple[str, str, int]] = query.tuples()  # type: ignore[assignment]
            for tier, owner, count in rows:
                counts[(Tier(tier), owner)] = int(count)
            return counts

    def _guard(self) -> contextlib.AbstractContextManager[None]:
        return self._backend.guard()

    # --- writes -------------------------------------------------------------

    def add(
        self,
        entry: NewEntry,
        policy: TierPolicy,
        *,
        expires: Expires = NEVER,
        still_wanted: Wanted | None = None,
        vector: Vector | None = None,
        on_commit: Callable[[Written], None] | None = None,
    ) -> Written:
        """Store an entry (`vector`: its embedding); say what was stored and
        whether it is new (`on_commit` hears it first, once committed: GroupCommit.run).

        Content identical to an entry of the same scope and tier returns that
        entry unchanged (created = False), and so does a retry carrying the
        idempotency key of an earlier add.
        """
        tier, content, key = entry.tier, entry.content, entry.idempotency_key
        require_enabled(tier, policy)
        owner = entry.scope.owner(tier)

        def write() -> Written:  # inside the write transaction (see GroupCommit)
            locked = self._backend.lock_partition(owner, tier.value)
            require_caller(still_wanted)
            now = to_micros(self._clock())
            purged = self.expiry.purge(owner, tier, locked, now)
            state, expired = purged.state, purged.removed
            usage = usage_of(purged.weighed(state))
            if key:
                earlier = _replay(self.tables, owner, tier, key, content, now)
                if earlier is not None:
                    return _unchanged(self.tables, earlier, locked, purged, now)
            existing = self.tables.identical(owner, tier, content, now)
            if existing is not None:
                _remember(self.tables, owner, tier, key, existing.memory_id, content, now)
                return _unchanged(self.tables, existing, locked, purged, now)
            added = len(content) + (SEPARATOR_CHARS if usage.entry_count else 0)
            check_budget(tier, policy, usage.used_chars, added, len(content))
            row = self.tables.insert_new(entry, owner, now, expires.applied(None))
            _put_vector(self.tables, row.seq, content, vector)
            _remember(self.tables, owner, tier, key, row.memory_id, content, now)
            after = state._replace(
                content_chars=state.content_chars + len(content),
                entry_count=state.entry_count + 1,
            )
            generation = advance(self.tables, owner, tier, after, expired, row.seq, now)
            self.tables.logged(owner, tier, generation, "add", row.memory_id, now)
            return _done(row, purged.weighed(after), True, locked, generation, expired)

        return self.group_commit.run(write, on_commit)

    def update(
        self,
        edit: Edit,
        policies: Mapping[Tier, TierPolicy],
        *,
        expires: Expires = UNCHANGED,
        still_wanted: Wanted | None = None,
        vector: Vector | None = None,
    ) -> Written:
        """Change the fields `edit` gives of the entry it names (see
        Tables.edited) and its expiry (`vector`: the new content's
        embedding, stored if the content changes).

        Content identical to another entry of the same tier is refused
        (ALREADY_EXISTS, naming that entry): two entries never say the same.
        """
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            row, locked = self.tables.edited(edit.scope, edit.memory_id, edit.match, edit.tier)
            require_caller(still_wanted)
            require_expected(edit, row.content)
            tier = Tier(row.tier)
            now = to_micros(self._clock())
            purged = self.expiry.purge_edited(row, locked, now)
            state, expired = purged.state, purged.removed
            policy = policies[tier]
            require_enabled(tier, policy)
            after = state
            if edit.content is not None and edit.content != row.content:
                row, after = _new_content(self.tables, row, edit.content, purged, policy, now)
                _put_vector(self.tables, row.seq, edit.content, vector)
            row = _edited(row, edit, expires, now)
            _rewrite(self.tables, row)
            generation = advance(self.tables, row.owner, tier, after, expired, row.seq, now)
            self.tables.logged(row.owner, tier, generation, "update", row.memory_id, row.updated_at)
            return _done(row, purged.weighed(after), False, locked, generation, expired)

    def holding(self, scope: Scope, tier: Tier, match: str) -> Memory:
        """The one entry of the scope's tier whose content holds `match`, as
        an edit by `match` would find it now (MATCH_NOT_FOUND, AMBIGUOUS_MATCH
        as it would), read without a lock: edit it with `Edit.expected`."""
        with self._guard(), self._db.connection_context():
            return to_memory(self.tables.holding(scope.owner(tier), tier, match))

    def delete(
        self,
        scope: Scope,
        memory_id: str,
        *,
        match: str = "",
        tier: Tier = Tier.MEMORY,
        still_wanted: Wanted | None = None,
    ) -> Written:
        """Remove an entry of this scope, named by id or by `match` in
        `tier`, as update does; the memory is as it was."""
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            row, locked = self.tables.edited(scope, memory_id, match, tier)
            require_caller(still_wanted)
            now = to_micros(self._clock())
            purged = self.expiry.purge_edited(row, locked, now)
            state, expired = purged.state, purged.removed
            self._db.execute_sql(
                self.tables.sql.delete.sql, self.tables.sql.delete.params(seq=row.seq)
            )
            after = state._replace(
                content_chars=state.content_chars - row.content_chars,
                entry_count=state.entry_count - 1,
            )
            tier = Tier(row.tier)
            generation = advance(self.tables, row.owner, tier, after, expired, row.seq, now)
            self.tables.logged(row.owner, tier, generation, "delete", row.memory_id, now)
            return _done(row, purged.weighed(after), False, locked, generation, expired)

    # --- reads --------------------------------------------------------------

    def list_memories(
        self,
        scope: Scope,
        tiers: Collection[Tier],
        category: str = "",
        *,
        after_seq: int = 0,
        limit: int | None = None,
        include_expired: bool = False,
    ) -> tuple[list[Memory], dict[Tier, Usage]]:
        """Entries of the given tiers in insertion order, and each tier's usage:
        the first `limit` entries after `after_seq` (a page), or all of them;
        those expired and not yet swept only with `include_expired`.

        One read transaction, so the list and the usage agree.
        """
        Row = self.tables.rows
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            query = Row.select().where(scope_clause(Row, scope, tiers) & (Row.seq > after_seq))
            if not include_expired:
                query = query.where(unexpired(Row, self.tables.now()))
            if category:
                query = query.where(Row.category == category)
            query = query.order_by(Row.seq)
            if limit is not None:
                query = query.limit(limit)
            memories = [to_memory(row) for row in query]
            usage = self._usages(scope, tiers)
        return memories, usage

    def tier_entries(self, tier: Tier, owner: str) -> Loaded:
        """One owner's entries of one tier in insertion order, their usage and
        the partition's generation, all as of one snapshot."""
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            partition = self.tables.sql.partition
            now = self.tables.now()
            rows = self.tables.rows_of(partition, owner=owner, tier=tier.value, now=now)
            state = self._backend.states([(owner, tier.value)]).get((owner, tier.value))
            hidden = self.expiry.hidden(owner, tier.value, now)
        memories = [to_memory(row) for row in rows]
        # Counted from the rows read: expired rows not yet swept weigh nothing.
        usage = Usage.of(row.content_chars for row in rows)
        return Loaded(memories, usage, 0 if state is None else state.generation, hidden)

    def tier_state(self, tier: Tier, owner: str) -> tuple[int, bool]:
        """How many entries the partition holds, and whether its changes are
        logged (it has or is getting a compact index), from its state row."""
        with self._guard(), self._db.connection_context():
            state = self._backend.states([(owner, tier.value)]).get((owner, tier.value))
        return (state.entry_count, state.indexed != 0) if state is not None else (0, False)

    def memories_by_seq(self, tier: Tier, owner: str, seqs: Sequence[int]) -> list[Memory]:
        """The partition's entries with these seqs, in the order asked; any
        since removed are left out."""
        if not seqs:
            return []
        with self._guard(), self._db.connection_context():
            records = self.tables.records_by_seq(owner, tier, seqs, self.tables.now())
            found = {r.seq: to_memory(r) for r in records}
        return [found[s] for s in seqs if s in found]

    def usage(self, scope: Scope, tiers: Sequence[Tier]) -> dict[Tier, Usage]:
        with self._guard(), self._db.connection_context():
            return self._usages(scope, tiers)

    # --- helpers (call inside a connection) ---------------------------------

    def _usages(self, scope: Scope, tiers: Collection[Tier]) -> dict[Tier, Usage]:
        keys = {tier: (scope.owner(tier), tier.value) for tier in tiers}
        states = self._backend.states(keys.values())
        states = self.expiry.discounted(states, self.tables.now())
        return {
            tier: usage_of(states[key]) if key in states else Usage() for tier, key in keys.items()
        }


def _replay(
    tables: Tables, owner: str, tier: Tier, key: str, content: str, now: int
) -> _Row | Record | None:
    """The entry an earlier add with this key stored, if the key is known."""
    Key = tables.keys
    Key.delete().where(Key.created_at < now - IDEMPOTENCY_TTL_MICROS).execute()
    record = Key.get_or_none((Key.owner == owner) & (Key.tier == tier.value) & (Key.key == key))
    if record is None:
        return None
    if record.content_sha256 != _sqlite.content_digest(content):
        raise InvalidArgument(
            "idempotency_key was already used for different content; use a new key",
            reason=Reason.IDEMPOTENCY_KEY_REUSED,
            metadata={"idempotency_key": key},
        )
    Row = tables.rows
    row: _Row | None = Row.get_or_none(Row.memory_id == record.memory_id)
    if row is None:
        raise FailedPrecondition(
            "idempotency_key was already used, and the memory it stored has been deleted since",
            reason=Reason.IDEMPOTENCY_KEY_USED,
            metadata={"idempotency_key": key, "id": record.memory_id},
        )
    return row


def _remember(
    tables: Tables, owner: str, tier: Tier, key: str, memory_id: str, content: str, now: int
) -> None:
    if key:
        tables.keys.create(
            owner=owner,
            tier=tier.value,
            key=key,
            memory_id=memory_id,
            content_sha256=_sqlite.content_digest(content),
            created_at=now,
        )


def _done(
    row: _Row | Record,
    after: PartitionState,
    created: bool,
    locked: PartitionState,
    generation: int,
    expired: Sequence[Expired],
) -> Written:
    """What a write did, its partition locked at `locked` and written at
    `generation` (after removing `expired`)."""
    seqs = tuple(gone.seq for gone in expired)
    return Written(to_memory(row), usage_of(after), created, locked.generation, generation, seqs)


def _unchanged(
    tables: Tables, row: _Row | Record, locked: PartitionState, purged: Purged, now: int
) -> Written:
    """An add that stored nothing new: the partition still advances if it
    removed expired rows first."""
    generation, state, expired = locked.generation, purged.state, purged.removed
    if expired:
        generation = advance(tables, row.owner, Tier(row.tier), state, expired, None, now)
    return _done(row, purged.weighed(state), False, locked, generation, expired)


def _new_content(
    tables: Tables, row: Record, content: str, purged: Purged, policy: TierPolicy, now: int
) -> tuple[Record, PartitionState]:
    """The row with its new content, and its partition's state after
    (`purged`: as the write found it): refused if another entry of the
    tier says exactly this, or if it grows the tier past its budget."""
    tier, state = Tier(row.tier), purged.state
    usage = usage_of(purged.weighed(state))
    twin = tables.identical(row.owner, tier, content, now)
    if twin is not None:
        raise AlreadyExists(
            f"another entry of the {tier.label} tier already says exactly this "
            f"(id {twin.memory_id}); update or delete that one instead",
            reason=Reason.DUPLICATE_CONTENT,
            metadata={"id": row.memory_id, "existing_id": twin.memory_id},
        )
    delta = len(content) - row.content_chars
    after = state._replace(content_chars=state.content_chars + delta)
    # Only growth is refused: an entry may always shrink, even in
    # a tier already over a budget that was lowered after the fact.
    if delta > 0:
        check_budget(tier, policy, usage.used_chars, delta, len(content))
    return row._replace(content=content, content_chars=len(content)), after


def _put_vector(tables: Tables, seq: int, content: str, vector: Vector | None) -> None:
    """Store the embedding of a row's new content, if one was given."""
    if vector is not None:
        digest = _sqlite.content_digest(content)
        tables.backend.put_vector(seq, vector.model, digest, vector.data)


def _rewrite(tables: Tables, row: Record) -> None:
    """Write an edited row's fields back (inside the write transaction)."""
    tables.db.execute_sql(
        tables.sql.update.sql,
        tables.sql.update.params(
            content=row.content,
            content_chars=row.content_chars,
            content_sha256=_sqlite.content_digest(row.content),
            category=row.category,
            confidence=row.confidence,
            updated_at=row.updated_at,
            expires_at=row.expires_at,
            seq=row.seq,
        ),
    )


def _edited(row: Record, edit: Edit, expires: Expires, now: int) -> Record:
    """The row with the edit's other fields and expiry, updated now."""
    if edit.category is not None:
        row = row._replace(category=edit.category)
    if edit.confidence is not None:
        row = row._replace(confidence=float(edit.confidence))
    return row._replace(expires_at=expires.applied(row.expires_at), updated_at=now)
