"""The event log's reads: whole writes per batch, the settled bound, pruning."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from sidecar.core.memory import Scope, Tier
from sidecar.storage.events import Batch
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry, TierPolicy
from tests.conftest import (
    WAIT_SECONDS,
    eventually,
)

pytestmark = pytest.mark.contract

SCOPE = Scope("coder", "ada")
KEYS = [(tier, SCOPE.owner(tier)) for tier in Tier]


@pytest.fixture
def store(databases: Callable[[str], str]) -> Iterator[Store]:
    opened = Store(databases("events.db"))
    opened.open()
    yield opened
    opened.close()


def logged(store: Store, generation: int, tier: Tier, kind: str, memory_id: str, at: int) -> None:
    """An event as a write (the expiry sweep's, say) appends it."""
    with store._db.connection_context(), store._backend.write_transaction():
        store.tables.logged(SCOPE.owner(tier), tier, generation, kind, memory_id, at)


def test_a_batch_never_ends_inside_one_writes_events(store: Store) -> None:
    added = [store.add(NewEntry(SCOPE, Tier.MEMORY, f"note {n}"), TierPolicy(0)) for n in range(3)]
    top = added[-1].generation
    # One write that logged five events under one generation.
    for n in range(5):
        logged(store, top + 100, Tier.USER, "expire", f"gone-{n}", 0)
    through = top + 100
    first = store.events.read(KEYS, 0, through, 4)
    assert [e.memory_id for e in first.events] == [w.memory.id for w in added]
    assert first.through == top + 99  # nothing else logged up to the big write
    assert first.events[0].memory is not None
    assert first.events[0].memory.content == "note 0"
    # More than a batch in one write: read whole.
    second = store.events.read(KEYS, first.through, through, 4)
    assert [e.memory_id for e in second.events] == [f"gone-{n}" for n in range(5)]
    assert second.through == through
    assert store.events.read(KEYS, through, through, 4) == Batch([], through, 0)
    assert store.events.backlog(KEYS, 0, 100) == 8
    assert store.events.backlog(KEYS, 0, 5) == 5


def test_pruning_raises_the_horizon_past_what_it_deleted(store: Store) -> None:
    for generation, at in ((1, 10), (2, 20), (3, 30)):
        logged(store, generation, Tier.MEMORY, "delete", f"m{generation}", at)
    assert store.events.prune(25, 1) == (1, 1)
    assert store.events.prune(25, 10) == (1, 2)
    assert store.events.prune(25, 10) == (0, 2)
    assert [e.generation for e in store.events.read(KEYS, 2, 3, 10).events] == [3]
    assert store.events.horizon() == 2


def test_the_settled_bound_waits_for_a_writer_in_flight(store: Store, backend: str) -> None:
    """On PostgreSQL a write to one tier may draw generation g and commit
    after a write to the other tier drew g + 1: a reader bounded by g + 1
    must not pass g before it commits."""
    if backend != "postgresql":
        pytest.skip("SQLite's writers commit in generation order")
    drawn, release, result = threading.Event(), threading.Event(), []

    def slow_writer() -> None:
        with store._db.connection_context(), store._backend.write_transaction():
            store._backend.lock_partition("coder", "memory")
            generation = store._backend.advance("coder", "memory", 0, 0)
            store._backend.append_event(generation, "coder", "memory", "delete", "slow", 0)
            result.append(generation)
            drawn.set()
            release.wait(WAIT_SECONDS)

    writer = threading.Thread(target=slow_writer)
    writer.start()
    assert drawn.wait(WAIT_SECONDS)
    added_id = store.add(NewEntry(SCOPE, Tier.USER, "committed first"), TierPolicy(0)).memory.id
    batches: list[Batch] = []

    def reader() -> None:
        through = store.events.settled(KEYS)
        batches.append(store.events.read(KEYS, 0, through, 100))

    reading = threading.Thread(target=reader)
    reading.start()
    with store._db.connection_context():
        eventually(
            lambda: store._db.execute_sql(
                "SELECT count(*) FROM pg_locks WHERE NOT granted"
            ).fetchone()[0],
            "the reader waits for the writer",
            within=WAIT_SECONDS,
        )
    release.set()
    writer.join(WAIT_SECONDS)
    reading.join(WAIT_SECONDS)
    assert [e.memory_id for e in batches[0].events] == ["slow", added_id]
    assert batches[0].events[0].generation == result[0]
