"""Expiry in the database: removing a partition's expired rows inside a
write transaction, the sweep's batches, and what expired rows still weigh
until they are removed.

An expired row is hidden at once, by every read, but removed only once
its expiry is `grace` old (server.expiry_grace_seconds): a wall clock
stepped ahead hides entries, and stepped back shows them again, instead
of letting the sweep delete them for good.

Reached as `store.expiry`; every write of the store also calls `purge` on
its own partition, after locking its state row and before its budget
check: it removes at most `batch` rows past their grace
(server.expiry_sweep_batch), and an expired row it leaves (in its grace,
or past the batch) never counts against the budget the write is checked
against. Expired rows are found
through the partial indexes of schema 7, which hold only rows with an
expiry: idx_memories_partition_expiry for a partition's (a write's, the
sweep's batch), idx_memories_expiry for the earliest anywhere (the sweep's
`due`). A database where nothing expires pays one empty index probe per
write (the rows expired by now: those past their grace to remove, the rest
weighed; see purge_bounded) and one per load of a partition (`hidden`).

One of the storage modules, the only code that touches SQL (see
sidecar.storage.store). Like the store's, the sweep opens a pooled connection for
its own duration and locks the partition's state row.

Owns: purge, purge_bounded and advance (inside a write), ExpiryStore (the
grace, the sweep's batches, the partitions with expired rows, the usage
expired rows hold, the latest expiry a read leaves out). Must not touch:
caches, partitions or the change feed (sidecar.domain.expiry updates them), the
engine, configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from sidecar.core.errors import NotFound, Reason
from sidecar.core.memory import Tier, Usage
from sidecar.storage._backend import PartitionState
from sidecar.storage._statements import Record
from sidecar.storage._tables import Tables, usage_of

_COLUMNS = "seq, id, content_chars"
# idx_memories_partition_expiry (owner, tier, expires_at, partial) serves
# this with the expiry condition: the partition's expired rows only, however
# many rows the partition or other partitions hold, expired or not.
_OF_PARTITION = "owner = {p} AND tier = {p}"


class Expired(NamedTuple):
    """An expired row as the sweep removes it."""

    seq: int
    memory_id: str
    content_chars: int


class Swept(NamedTuple):
    """One sweep batch of one partition: the rows removed, the partition's
    usage after, its generations before and after (equal: nothing was
    removed), and the time (microseconds) every row removed had expired by:
    hidden by every read since then, so nothing that shows only entries
    expiring later showed any of them (sidecar.domain.partition)."""

    removed: tuple[Expired, ...]
    usage: Usage
    previous: int
    generation: int
    cutoff: int


def purge(
    tables: Tables,
    owner: str,
    tier: Tier,
    state: PartitionState,
    now: int,
    limit: int | None = None,
) -> tuple[PartitionState, list[Expired]]:
    """Delete the partition's rows expired by `now` (at most `limit`) and
    return its state without them, and what was deleted. Inside the write
    transaction that locked the state row; the caller advances the
    generation with the removed seqs and logs them (`logged`)."""
    found = [row for row, _ in _expired(tables, owner, tier, now, limit)]
    return _removed(tables, state, found), found


def _expired(
    tables: Tables, owner: str, tier: Tier, now: int, limit: int | None
) -> list[tuple[Expired, int]]:
    """The partition's rows expired by `now` (the first `limit`), earliest
    expiry first, each with its expiry."""
    db, p = tables.db, tables.db.param
    sql = (
        f"SELECT {_COLUMNS}, expires_at FROM memories WHERE expires_at IS NOT NULL"
        f" AND expires_at <= {p} AND {_OF_PARTITION.format(p=p)} ORDER BY expires_at, seq"
    )
    params: list[object] = [now, owner, tier.value]
    if limit is not None:
        sql += f" LIMIT {p}"
        params.append(limit)
    rows = db.execute_sql(sql, params).fetchall()
    return [(Expired(int(s), str(i), int(c)), int(at)) for s, i, c, at in rows]


def _removed(tables: Tables, state: PartitionState, found: Sequence[Expired]) -> PartitionState:
    """Delete the `found` rows; the partition's state without them."""
    if not found:
        return state
    db, p = tables.db, tables.db.param
    for start in range(0, len(found), 500):
        seqs = [row.seq for row in found[start : start + 500]]
        marks = ", ".join([p] * len(seqs))
        db.execute_sql(f"DELETE FROM memories WHERE seq IN ({marks})", seqs)
    return state._replace(
        content_chars=state.content_chars - sum(row.content_chars for row in found),
        entry_count=state.entry_count - len(found),
    )


class Purged(NamedTuple):
    """What a write's purge did: the partition's state without the rows it
    removed, those rows, and the weight of the expired rows it left (only
    when it hit its limit): invisible, they count in no budget and no usage
    the write reports (`weighed`), but in the state row until removed."""

    state: PartitionState
    removed: list[Expired]
    left_chars: int = 0
    left_count: int = 0

    def weighed(self, state: PartitionState) -> PartitionState:
        """`state` (this one, or the write's after it) without the expired rows left."""
        return state._replace(
            content_chars=state.content_chars - self.left_chars,
            entry_count=state.entry_count - self.left_count,
        )


def purge_bounded(
    tables: Tables,
    owner: str,
    tier: Tier,
    locked: PartitionState,
    now: int,
    limit: int,
    grace: int = 0,
) -> Purged:
    """purge of the rows expired by `now` minus `grace`, at most `limit`,
    for a write: one write never removes (and logs, and tombstones) a mass
    expiry at once, holding the write lock meanwhile; the sweep and later
    writes remove the rest. The rows expired by `now` it leaves weigh
    nothing (`Purged.weighed`).

    One probe serves both the removal and the weighing: it reads the rows
    expired by `now` (not `now` minus the grace), one past `limit`. Those
    past their grace come first (the probe is ordered by expiry), so the
    first of them up to `limit` are the rows to remove; when the probe
    found no more than `limit` rows it saw every expired row, and the ones
    it did not remove are what is left. Only a partition with more expired
    rows than that is weighed by a second statement. With a grace (the
    default), a write used to pay that second probe every time.
    """
    found = _expired(tables, owner, tier, now, limit + 1)
    due = [row for row, at in found if at <= now - grace][:limit]
    state = _removed(tables, locked, due)
    if len(found) <= limit:
        left = [row for row, _ in found[len(due) :]]
        return Purged(state, due, sum(row.content_chars for row in left), len(left))
    chars, count = _expired_weight(tables, owner, tier.value, now)
    return Purged(state, due, chars, count)


def _expired_weight(tables: Tables, owner: str, tier: str, now: int) -> tuple[int, int]:
    """(content chars, rows) of the partition's rows expired by `now`."""
    p = tables.db.param
    sql = (
        "SELECT COALESCE(SUM(content_chars), 0), COUNT(*) FROM memories"
        f" WHERE expires_at IS NOT NULL AND expires_at <= {p} AND {_OF_PARTITION.format(p=p)}"
    )
    chars, count = tables.db.execute_sql(sql, (now, owner, tier)).fetchone()
    return int(chars), int(count)


def advance(
    tables: Tables,
    owner: str,
    tier: Tier,
    after: PartitionState,
    expired: Sequence[Expired],
    seq: int | None,
    now: int,
) -> int:
    """Advance the partition past a write that first removed `expired`:
    their seqs go with the written `seq` (if any) to the change log, and
    each gets an `expire` event (WatchMemories). Return the generation."""
    seqs = [gone.seq for gone in expired] + ([] if seq is None else [seq])
    generation = tables.advance(owner, tier, after, seqs)
    for gone in expired:
        tables.logged(owner, tier, generation, "expire", gone.memory_id, now)
    return generation


class ExpiryStore:
    """The expiry sweep's storage half, over one store's tables."""

    def __init__(self, tables: Tables, *, batch: int = 500, grace_seconds: float = 0.0) -> None:
        self._tables = tables
        self._backend = tables.backend
        self._db = tables.db
        # At most this many expired rows are removed by one write (server.expiry_sweep_batch).
        self.batch = batch
        # How long (microseconds) an expired row is kept, hidden, before any
        # write or sweep removes it (server.expiry_grace_seconds).
        self.grace = round(grace_seconds * 1_000_000)

    def purge(self, owner: str, tier: Tier, locked: PartitionState, now: int) -> Purged:
        """A write's purge of its own partition (see purge_bounded)."""
        return purge_bounded(self._tables, owner, tier, locked, now, self.batch, self.grace)

    def purge_edited(self, row: Record, locked: PartitionState, now: int) -> Purged:
        """purge, for a write that edits `row`: an expired entry itself
        cannot be edited (it is gone: NOT_FOUND, reason EXPIRED), in its
        grace, removed by this write or not."""
        if row.expires_at is not None and row.expires_at <= now:
            raise NotFound(
                f"the memory with id {row.memory_id!r} has expired",
                reason=Reason.EXPIRED,
                metadata={"id": row.memory_id},
            )
        return self.purge(row.owner, Tier(row.tier), locked, now)

    def due(self, now: int, limit: int) -> list[tuple[Tier, str]]:
        """Partitions holding rows expired by `now` minus the grace, from
        the first `limit` such rows (the earliest expired first)."""
        p = self._db.param
        sql = (
            "SELECT tier, owner FROM memories WHERE expires_at IS NOT NULL"
            f" AND expires_at <= {p} ORDER BY expires_at LIMIT {p}"
        )
        with self._backend.guard(), self._db.connection_context():
            rows = self._db.execute_sql(sql, (now - self.grace, limit)).fetchall()
        return list(dict.fromkeys((Tier(tier), str(owner)) for tier, owner in rows))

    def sweep(
        self,
        tier: Tier,
        owner: str,
        now: int,
        limit: int,
        before_commit: Callable[[Swept], None] | None = None,
    ) -> Swept:
        """Remove up to `limit` of the partition's rows expired by `now`
        minus the grace in one write transaction: lock its state row,
        delete, store its new totals and generation (with the seqs, so a
        compact tier's change log has them) and log an `expire` event per
        entry. `before_commit` is told what was removed just before the
        commit (the caches must know it before any feed hears of it)."""
        tables = self._tables
        backend = self._backend
        with backend.guard(), self._db.connection_context(), backend.write_transaction():
            state = backend.lock_partition(owner, tier.value)
            cutoff = now - self.grace
            after, removed = purge(tables, owner, tier, state, cutoff, limit)
            if not removed:
                return Swept((), usage_of(state), state.generation, state.generation, cutoff)
            generation = tables.advance(owner, tier, after, [gone.seq for gone in removed])
            # One statement per batch of events, not one per entry: the sweep
            # holds the write lock (and, in Python, the GIL turns need) the
            # less for it.
            ids = [gone.memory_id for gone in removed]
            tables.logged_many(owner, tier, generation, "expire", ids, now)
            swept = Swept(tuple(removed), usage_of(after), state.generation, generation, cutoff)
            if before_commit is not None:
                before_commit(swept)
        return swept

    def discounted(
        self, states: Mapping[tuple[str, str], PartitionState], now: int
    ) -> dict[tuple[str, str], PartitionState]:
        """The (owner, tier) partitions' states without their rows expired
        by `now` and not yet removed: those weigh nothing in usage. Call
        inside a connection."""
        found = dict(states)
        for (owner, tier), state in states.items():
            chars, count = _expired_weight(self._tables, owner, tier, now)
            if count:
                found[(owner, tier)] = Purged(state, [], chars, count).weighed(state)
        return found

    def hidden(self, owner: str, tier: str, now: int) -> int | None:
        """The latest expiry (microseconds) among the partition's rows
        expired by `now` and not removed yet, which every read leaves out,
        or None: a clock set back before it shows them again. Call inside
        a connection (the read's own, so both agree)."""
        p = self._db.param
        sql = (
            "SELECT MAX(expires_at) FROM memories"
            f" WHERE expires_at IS NOT NULL AND expires_at <= {p} AND {_OF_PARTITION.format(p=p)}"
        )
        (latest,) = self._db.execute_sql(sql, (now, owner, tier)).fetchone()
        return None if latest is None else int(latest)
