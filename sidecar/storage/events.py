"""The event log WatchMemories reads: every change of every partition, in
generation order, read in bounded batches, and pruned by age.

Reached as `store.events`. Writes append their event in their own
transaction (`Tables.logged`); this module only reads the log, and prunes
it. One of the storage modules, the only code that touches SQL (see
sidecar.storage.store).

Generations come from one database-wide sequence, so a scope's events (its
two partitions) are totally ordered by generation. What a reader may trust
is another matter: on PostgreSQL two transactions writing different
partitions may commit out of generation order (the one that drew 10 after
the one that drew 11), and a reader that had passed 11 would never see 10.
`settled` therefore answers a bound below which nothing of the given
partitions can still be in flight: it takes their state rows FOR SHARE for
a moment, which waits for any writer holding them (every write locks its
partition's state row before it draws a generation) and keeps new ones out
until the bound is read. On SQLite writers hold the one write lock, so they
commit in generation order and the bound is simply the newest generation.

Owns: the reads of memory_events (and of the entries their ids name), the
settled bound, the horizon, pruning. Must not touch: the write path (store,
Tables.logged), caches, gRPC.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from sidecar.core.memory import Memory, Tier
from sidecar.storage._backend import EVENT_HORIZON_TABLE, EVENTS_TABLE, STATE_TABLE
from sidecar.storage._tables import Tables, to_memory

# (tier, owner), as sidecar.domain.partition keys a partition.
Key = tuple[Tier, str]


class Event(NamedTuple):
    """One logged change: kind is add, update, delete, expire or erase.

    `memory` is the entry as it is now, for add and update (None when it has
    been deleted since: a later event says so); None for the other kinds.
    """

    generation: int
    tier: Tier
    kind: str
    memory_id: str
    memory: Memory | None = None


class Batch(NamedTuple):
    """Events after a generation, in generation order, and how far they go:
    every event of the partitions with a generation up to `through` has
    been read (a batch never ends inside one write's events)."""

    events: list[Event]
    through: int
    # The log's horizon as of the same snapshot (see EventLog.horizon).
    horizon: int


class EventLog:
    """The memory_events table of one store."""

    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self._backend = tables.backend
        self._db = tables.db
        self._guard = tables.backend.guard
        self._p = tables.db.param
        # Whether writers of different partitions may commit out of
        # generation order (see the module's docstring).
        self._concurrent = tables.backend.name == "postgresql"

    def settled(self, keys: Sequence[Key]) -> int:
        """A generation G such that every event of these partitions up to G
        has committed, and any written later has a larger generation: the
        database's newest generation, read when no writer of the
        partitions is in flight."""
        newest = f"SELECT COALESCE(MAX(generation), 0) FROM {STATE_TABLE}"
        with self._guard(), self._db.connection_context():
            if not self._concurrent:
                return int(self._db.execute_sql(newest).fetchone()[0])
            with self._backend.write_transaction():
                # The row locks make this a writing transaction: its commit
                # need not wait for the WAL to reach the disk (nothing is
                # lost with it but the locks, which end with it anyway).
                self._db.execute_sql("SET LOCAL synchronous_commit TO OFF")
                # In (owner, tier) order: a write that locks several
                # partitions (an erasure) must take them in this order too,
                # or the two may deadlock (PostgreSQL then fails one).
                for owner, tier in sorted((owner, tier.value) for tier, owner in keys):
                    self._share(owner, tier)
                return int(self._db.execute_sql(newest).fetchone()[0])

    def _share(self, owner: str, tier: str) -> None:
        """Wait for the partition's writer, if any, and keep others out
        until the transaction ends (PostgreSQL). A partition never written
        gets its state row, as its first write would: an insert in flight
        is waited for too, which no SELECT would do."""
        p = self._p
        lock = f"SELECT generation FROM {STATE_TABLE} WHERE owner = {p} AND tier = {p} FOR SHARE"
        if self._db.execute_sql(lock, (owner, tier)).fetchone() is None:
            self._db.execute_sql(self._backend._create_sql, (owner, tier))
            self._db.execute_sql(lock, (owner, tier)).fetchone()

    def newest(self) -> int:
        """The database's newest generation (committed)."""
        with self._guard(), self._db.connection_context():
            row = self._db.execute_sql(
                f"SELECT COALESCE(MAX(generation), 0) FROM {STATE_TABLE}"
            ).fetchone()
        return int(row[0])

    def horizon(self) -> int:
        """The largest generation pruned so far: events after it are all
        kept, so a watch may resume from any generation at or after it."""
        with self._guard(), self._db.connection_context():
            return self._horizon()

    def _horizon(self) -> int:
        row = self._db.execute_sql(f"SELECT MAX(generation) FROM {EVENT_HORIZON_TABLE}").fetchone()
        return int(row[0] or 0)

    def read(self, keys: Sequence[Key], after: int, through: int, limit: int) -> Batch:
        """The partitions' events with after < generation <= through, in
        generation order: about `limit` of them (fewer, to end at a whole
        write; more only when one write alone logged more), each add and
        update with its entry as it is now. One snapshot, horizon included."""
        p = self._p
        sql = (
            f"SELECT generation, kind, memory_id FROM {EVENTS_TABLE}"
            f" WHERE owner = {p} AND tier = {p} AND generation > {p} AND generation <= {p}"
            f" ORDER BY generation, memory_id LIMIT {p}"
        )
        whole = (
            f"SELECT generation, kind, memory_id FROM {EVENTS_TABLE}"
            f" WHERE owner = {p} AND tier = {p} AND generation = {p} ORDER BY memory_id"
        )
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            horizon = self._horizon()
            runs: list[list[tuple[int, str, str, Tier]]] = []
            # The first generation a partition's run may not hold whole.
            cut = through + 1
            for tier, owner in keys:
                rows = self._db.execute_sql(
                    sql, (owner, tier.value, after, through, limit + 1)
                ).fetchall()
                runs.append([(int(g), str(k), str(m), tier) for g, k, m in rows])
                if len(rows) > limit:
                    cut = min(cut, int(rows[-1][0]))
            merged = list(heapq.merge(*runs, key=lambda r: (r[0], r[3].value, r[2])))
            if len(merged) > limit:
                cut = min(cut, merged[limit][0])
            taken = [row for row in merged if row[0] < cut]
            if not taken and merged:
                # One write logged more than `limit` events: it is read whole.
                generation, tier = merged[0][0], merged[0][3]
                owner = dict(keys)[tier]
                rows = self._db.execute_sql(whole, (owner, tier.value, generation)).fetchall()
                taken = [(int(g), str(k), str(m), tier) for g, k, m in rows]
                cut = generation + 1
            entries = self._entries([m for _g, k, m, _t in taken if k in ("add", "update")])
        events = [
            Event(g, tier, k, m, entries.get(m) if k in ("add", "update") else None)
            for g, k, m, tier in taken
        ]
        return Batch(events, through if cut > through else cut - 1, horizon)

    def rest(self, keys: Sequence[Key], generation: int, after: tuple[Tier, str]) -> Batch:
        """The partitions' events of one generation that follow `after` (a
        tier and an id) in the order reads send them, (tier, memory_id): the
        rest of a generation a stream was cut inside. One snapshot."""
        p = self._p
        sql = (
            f"SELECT generation, kind, memory_id FROM {EVENTS_TABLE}"
            f" WHERE owner = {p} AND tier = {p} AND generation = {p} ORDER BY memory_id"
        )
        last = (after[0].value, after[1])
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            horizon = self._horizon()
            taken = []
            for tier, owner in sorted(keys, key=lambda key: key[0].value):
                rows = self._db.execute_sql(sql, (owner, tier.value, generation)).fetchall()
                taken += [
                    (int(g), str(k), str(m), tier) for g, k, m in rows if (tier.value, m) > last
                ]
            entries = self._entries([m for _g, k, m, _t in taken if k in ("add", "update")])
        events = [
            Event(g, tier, k, m, entries.get(m) if k in ("add", "update") else None)
            for g, k, m, tier in taken
        ]
        return Batch(events, generation, horizon)

    def _entries(self, ids: list[str]) -> dict[str, Memory]:
        rows = self._tables.rows
        found: dict[str, Memory] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            for row in rows.select().where(rows.memory_id.in_(chunk)):
                found[row.memory_id] = to_memory(row)
        return found

    def backlog(self, keys: Sequence[Key], after: int, cap: int) -> int:
        """How many of the partitions' events are logged after `after`, counted
        up to `cap` (an index range scan of at most `cap` rows each)."""
        p = self._p
        sql = (
            f"SELECT COUNT(*) FROM (SELECT 1 FROM {EVENTS_TABLE}"
            f" WHERE owner = {p} AND tier = {p} AND generation > {p} LIMIT {p}) AS t"
        )
        total = 0
        with self._guard(), self._db.connection_context():
            for tier, owner in keys:
                row = self._db.execute_sql(sql, (owner, tier.value, after, cap)).fetchone()
                total += int(row[0])
        return min(total, cap)

    def prune(self, before: int, limit: int) -> tuple[int, int]:
        """Delete up to `limit` of the oldest events logged before `before`
        (microseconds since the epoch) and raise the horizon past them, in
        one transaction; (how many were deleted, the horizon after)."""
        p = self._p
        # Rows picked by the `at` index, deleted by their physical address:
        # a batch costs its own rows, however many more are due.
        address = "ctid" if self._concurrent else "rowid"
        picked = f"SELECT {address} FROM {EVENTS_TABLE} WHERE at < {p} ORDER BY at LIMIT {p}"
        where = f"ctid = ANY(ARRAY({picked}))" if self._concurrent else f"rowid IN ({picked})"
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            rows = self._db.execute_sql(
                f"DELETE FROM {EVENTS_TABLE} WHERE {where} RETURNING generation", (before, limit)
            ).fetchall()
            if rows:
                top = max(int(row[0]) for row in rows)
                self._db.execute_sql(
                    f"UPDATE {EVENT_HORIZON_TABLE} SET generation ="
                    f" CASE WHEN generation < {p} THEN {p} ELSE generation END",
                    (top, top),
                )
            return len(rows), self._horizon()
