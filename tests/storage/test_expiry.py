"""A write's expiry probe (sidecar.storage.expiry): what it removes and what
it weighs, against the rows as they are, and what it costs an add: one
statement, through the partition's expiry index, with or without a grace."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest

from sidecar.core.clock import to_micros
from sidecar.core.memory import Scope, Tier
from sidecar.storage.expiry import Purged
from sidecar.storage.store import Store
from sidecar.storage.writes import Expires, NewEntry, TierPolicy

pytestmark = pytest.mark.contract

START = datetime(2026, 1, 1, tzinfo=UTC)
GRACE_SECONDS = 100.0
SCOPE = Scope("agent")
UNLIMITED = TierPolicy(0)


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


def _store(db: str, clock: Clock, batch: int) -> Store:
    store = Store(db, clock=clock, expiry_batch=batch, expiry_grace_seconds=GRACE_SECONDS)
    store.open()
    return store


@pytest.fixture
def opened(databases: Callable[[str], str]) -> Iterator[Callable[[int], tuple[Store, Clock]]]:
    stores: list[Store] = []

    def make(batch: int) -> tuple[Store, Clock]:
        clock = Clock()
        stores.append(_store(databases("m.db"), clock, batch))
        return stores[-1], clock

    yield make
    for store in stores:
        store.close()


def _add(store: Store, content: str, expires_after: float | None) -> int:
    expires = (
        Expires.never()
        if expires_after is None
        else Expires.at(to_micros(START + timedelta(seconds=expires_after)))
    )
    written = store.add(NewEntry(SCOPE, Tier.MEMORY, content), UNLIMITED, expires=expires)
    return written.memory.seq


def _purge(store: Store) -> Purged:
    """A write's purge of the agent's memory tier, as an add runs it."""
    owner = SCOPE.owner(Tier.MEMORY)
    backend = store.tables.backend
    with backend.guard(), store.tables.db.connection_context(), backend.write_transaction():
        locked = backend.lock_partition(owner, Tier.MEMORY.value)
        return store.expiry.purge(owner, Tier.MEMORY, locked, store.tables.now())


def _rows(store: Store) -> list[tuple[int, int]]:
    """(seq, content chars) of every row the agent's tier still holds."""
    Row = store.tables.rows  # noqa: N806 - a bound model class
    with store.tables.db.connection_context():
        return [(r.seq, r.content_chars) for r in Row.select().order_by(Row.seq)]


# Rows expiring 1, 2 and 3 s after START, and one that never does, with a
# 100 s grace; each case sets the clock (seconds after START) and the batch.
@pytest.mark.parametrize(
    ("batch", "seconds", "removed", "left"),
    [
        # One past its grace, two in it: the probe (batch + 1 rows) sees all.
        (5, 101.5, 1, 2),
        # The same with a batch of 2: the probe reads 3 rows, one more than
        # the batch, so what is left is weighed by a statement of its own.
        (2, 101.5, 1, 2),
        # All three past the grace, a batch of 2: two go, one is left.
        (2, 104.0, 2, 1),
        # All three past the grace, a batch of 3: all go, nothing is left.
        (3, 104.0, 3, 0),
        # None expired yet: nothing removed, nothing weighed.
        (2, 0.5, 0, 0),
        # All expired, none past the grace: nothing removed, all weighed.
        (1, 50.0, 0, 3),
    ],
)
def test_a_write_removes_the_rows_past_their_grace_and_weighs_the_rest(
    opened: Callable[[int], tuple[Store, Clock]],
    batch: int,
    seconds: float,
    removed: int,
    left: int,
) -> None:
    store, clock = opened(batch)
    seqs = [_add(store, "x" * (10 * n), float(n)) for n in (1, 2, 3)]
    _add(store, "never expires", None)
    chars = {seq: 10 * n for seq, n in zip(seqs, (1, 2, 3), strict=True)}
    clock.now = START + timedelta(seconds=seconds)

    purged = _purge(store)

    # The earliest expiries go first; the rows left are the other expired ones.
    assert [row.seq for row in purged.removed] == seqs[:removed]
    expired = [seq for n, seq in zip((1, 2, 3), seqs, strict=True) if n <= seconds]
    still = expired[removed:]
    assert (purged.left_count, purged.left_chars) == (len(still), sum(chars[s] for s in still))
    assert [seq for seq, _ in _rows(store)][: 3 - removed] == seqs[removed:]


def test_an_add_runs_one_expiry_probe_with_a_grace(
    opened: Callable[[int], tuple[Store, Clock]],
) -> None:
    # With a grace (the daemon's default) a write read its partition's
    # expired rows twice: those past the grace to remove, then the weight of
    # those in it. One probe now does both: the add's statements are the
    # state row's lock, the probe, the identical-content check, the insert,
    # the state row's update and the change event.
    store, _ = opened(500)
    _add(store, "first", None)
    statements: list[str] = []
    store.tables.db.query_hooks.append(lambda event: statements.append(event.sql))
    _add(store, "second", None)
    store.tables.db.query_hooks.pop()
    probes = [sql for sql in statements if "expires_at <=" in sql]
    assert len(probes) == 1, statements
    assert len(statements) <= 6, statements


def test_the_probe_reads_the_partition_expiry_index(
    opened: Callable[[int], tuple[Store, Clock]], backend: str
) -> None:
    if backend != "sqlite":
        pytest.skip("SQLite's plan; PostgreSQL plans by its statistics")
    store, _ = opened(500)
    for n in range(50):
        _add(store, f"entry {n}", None if n % 2 else float(n))
    statements: list[tuple[str, tuple[object, ...]]] = []
    db = store.tables.db
    execute = db.execute_sql

    def recorded(sql: str, params: tuple[object, ...] | None = None) -> object:
        statements.append((sql, tuple(params or ())))
        return execute(sql, params)

    db.execute_sql = recorded
    try:
        _add(store, "one more", None)
    finally:
        db.execute_sql = execute
    (probe, params), *_ = [(sql, ps) for sql, ps in statements if "expires_at <=" in sql]
    with db.connection_context():
        rows = db.execute_sql(f"EXPLAIN QUERY PLAN {probe}", params).fetchall()
    plan = " ".join(str(row[-1]) for row in rows)
    assert "idx_memories_partition_expiry" in plan, plan
    assert "SCAN" not in plan, plan
