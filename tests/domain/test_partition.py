"""sidecar.domain.partition: the partition cache, its byte budget, and freshness
learned from this process's writes and other processes' (the change feed)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sidecar.core.memory import Scope, Tier
from sidecar.retrieval.compact import CompactPartition
from sidecar.retrieval.partition import Partition
from sidecar.storage.expiry import Expired, Swept
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry, TierPolicy
from tests.conftest import MakeEngine
from tests.waits import WAIT_SECONDS

SCOPE = Scope(agent_id="coder", user_id="ada")


@pytest.mark.parametrize("tier", list(Tier))
def test_another_process_writing_a_never_written_tier_is_seen_on_the_next_turn(
    make_engine: MakeEngine, tmp_path: Path, tier: Tier
) -> None:
    # Sessions of scopes with nothing written share one snapshot: news of a
    # write to this scope's tier must still reach this session, and only it.
    engine, _, metrics = make_engine("server: {partition_cache_size: 1}", changes=True)
    feed = engine.inside().feed
    assert feed is not None
    feed.run_once()  # verified: cached turns trust the feed, reading nothing
    other = Scope(agent_id="other", user_id="bob")
    assert engine.inject(SCOPE, "s").system_block == ""
    assert engine.inject(other, "s").system_block == ""
    assert engine.inject(SCOPE, "s").snapshot is engine.inject(other, "s").snapshot
    engine.evict_idle()  # the janitor keeps following what sessions hold

    def selects() -> float:
        return (
            metrics.registry.get_sample_value("memory_db_queries_total", {"operation": "select"})
            or 0.0
        )

    before = selects()
    assert engine.inject(SCOPE, "s").cache_hit
    assert selects() == before

    writer = Store(str(tmp_path / "m.db"))
    writer.open()
    try:
        writer.add(NewEntry(SCOPE, tier, "written elsewhere"), TierPolicy(2200))
    finally:
        writer.close()
    feed.run_once()
    turn = engine.inject(SCOPE, "s")
    assert not turn.cache_hit
    assert "written elsewhere" in turn.system_block
    assert engine.inject(SCOPE, "s").cache_hit
    # The other scope's session still holds the shared snapshot.
    assert engine.inject(other, "s").cache_hit
    assert engine.inject(other, "s").system_block == ""


def test_the_partition_cache_is_bounded_by_bytes(make_engine: MakeEngine) -> None:
    engine, _, metrics = make_engine("server: {partition_cache_bytes: 200000}")
    for n in range(40):
        scope = Scope(agent_id=f"agent-{n}")
        for k in range(10):
            engine.add(NewEntry(scope, Tier.MEMORY, f"agent {n} knows fact number {k}"))
        engine.search(scope, "fact", [Tier.MEMORY], limit=5)
    cached = metrics.registry.get_sample_value("memory_partition_cache_bytes")
    assert cached is not None
    assert 0 < cached <= 200_000
    assert 0 < engine.stats().partitions < 40


def test_a_tier_larger_than_the_cache_budget_is_not_reloaded_every_time(
    make_engine: MakeEngine,
) -> None:
    engine, _, metrics = make_engine(
        "server: {partition_cache_bytes: 50000}\ndefaults: {memory_char_limit: 0}"
    )
    big = Scope(agent_id="big", user_id="ada")
    for k in range(200):
        engine.add(NewEntry(big, Tier.MEMORY, f"big fact number {k} about the deploy"))
    # Searching both tiers caches the big tier (over the budget) and then the
    # small user tier: the big one must stay, or every search reloads it.
    engine.search(big, "deploy", list(Tier), limit=5)

    def selects() -> float:
        return (
            metrics.registry.get_sample_value("memory_db_queries_total", {"operation": "select"})
            or 0.0
        )

    before = selects()
    for _ in range(5):
        engine.search(big, "deploy", list(Tier), limit=5)
    assert selects() == before
    # Small tiers of other agents are cached within the budget beside it.
    smalls = [Scope(agent_id=f"small-{n}") for n in range(3)]
    for scope in smalls:
        engine.add(NewEntry(scope, Tier.MEMORY, "a small note"))
        engine.search(scope, "note", [Tier.MEMORY], limit=5)
    before = selects()
    for scope in [*smalls, big]:
        engine.search(scope, "note", [Tier.MEMORY], limit=5)
    assert selects() == before


def test_a_session_holding_an_older_view_still_hears_of_remote_writes(
    make_engine: MakeEngine,
) -> None:
    engine, clock, _ = make_engine("defaults: {session_idle_ttl_seconds: 10}")
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "a note"))
    engine.inject(SCOPE, "a")
    # Another session of the scope compacts: its rebuilt view replaces the
    # shared one, and ends; session "a" keeps the older view.
    engine.inject(SCOPE, "b")
    engine.notify_compaction(SCOPE, "b")
    engine.inject(SCOPE, "b")
    engine.end_session(SCOPE, "b")
    clock.now = 9
    assert engine.inject(SCOPE, "a").cache_hit
    clock.now = 15  # the partitions' last load is past the TTL; "a" is not
    engine.evict_idle()
    # Another process writes the tier (what the change feed reports).
    engine.inside().partitions.heard(SCOPE.agent_id, Tier.MEMORY.value, 10**9)
    assert not engine.inject(SCOPE, "a").cache_hit


def test_a_tier_held_in_full_that_reaches_the_compact_size_is_let_go(
    make_engine: MakeEngine,
) -> None:
    # Writes keep a cached tier current (near-duplicate checks load it), but
    # one that reaches compact_tier_entries is held compactly from its next
    # use, as a process that never held it would hold it.
    engine, _, _ = make_engine(
        "defaults: {memory_char_limit: 0}\nserver: {compact_tier_entries: 4}"
    )
    key = (Tier.MEMORY, SCOPE.agent_id)
    for k in range(3):
        engine.add(NewEntry(SCOPE, Tier.MEMORY, f"fact number {k} about the {k}th deploy"))
    assert isinstance(engine.inside().partitions.cached(key), Partition)
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "the last fact, about the release train"))
    assert engine.inside().partitions.cached(key) is None
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "one more, about the staging cluster"))
    assert engine.inside().partitions.cached(key) is None  # not loaded for a write
    hits = engine.search(SCOPE, "release train", [Tier.MEMORY], limit=5)
    assert [m.content for m, _ in hits][:1] == ["the last fact, about the release train"]
    assert isinstance(engine.inside().partitions.cached(key), CompactPartition)


def test_a_run_of_sweeps_keeps_views_current_until_another_write_comes_between(
    make_engine: MakeEngine,
) -> None:
    # The sweep's batches of entries that expired before anything a view
    # shows leave the view current, batch after batch; a batch after a
    # write this process did not make (its previous generation is not the
    # run's last) starts a new run, which views from before it are not in.
    engine, _, _ = make_engine()
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "a note"))
    first = engine.inject(SCOPE, "s")
    partitions = engine.inside().partitions
    key = (Tier.MEMORY, SCOPE.agent_id)
    held = partitions.cached(key)
    assert held is not None
    g, usage = held.generation, held.usage
    gone = (Expired(10**9, "gone", 5),)
    long_ago = 1_000_000  # microseconds: 1970, before anything shown expires

    partitions.swept(key, Swept(gone, usage, g, g + 10, long_ago))
    partitions.swept(key, Swept(gone, usage, g + 10, g + 20, long_ago))
    turn = engine.inject(SCOPE, "s")
    assert turn.cache_hit
    assert turn.generation == first.generation
    # Held in full without them: the cached partition moved on as it was.
    moved = partitions.cached(key)
    assert isinstance(moved, Partition)
    assert isinstance(held, Partition)
    assert moved.generation == g + 20
    assert moved.memories is held.memories

    partitions.swept(key, Swept(gone, usage, g + 25, g + 30, long_ago))
    assert not engine.inject(SCOPE, "s").cache_hit


def test_a_sweep_batch_heard_from_the_feed_before_its_caches_are_told_keeps_views(
    make_engine: MakeEngine,
) -> None:
    # The batch is noted before its commit: the feed may deliver its
    # generation before the sweeping thread updates the caches. A batch
    # whose commit failed is forgotten, and views rebuild.
    engine, _, _ = make_engine()
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "a note"))
    first = engine.inject(SCOPE, "s")
    partitions = engine.inside().partitions
    key = (Tier.MEMORY, SCOPE.agent_id)
    held = partitions.cached(key)
    assert held is not None
    g = held.generation
    batch = Swept((Expired(10**9, "gone", 5),), held.usage, g, g + 10, 1_000_000)
    partitions.sweeps.add(key, batch)
    assert engine.inject(SCOPE, "s").cache_hit  # noted, not committed yet
    partitions.heard(SCOPE.agent_id, Tier.MEMORY.value, g + 10)
    turn = engine.inject(SCOPE, "s")
    assert turn.cache_hit
    assert turn.generation == first.generation
    partitions.sweeps.forget(key)
    assert not engine.inject(SCOPE, "s").cache_hit


def test_a_read_takes_the_partition_a_sweep_batch_is_moving_past_without_waiting(
    make_engine: MakeEngine,
) -> None:
    # A sweep batch holds the partition's stripe through its transaction
    # and the caches' update. A read that comes once its generation is
    # heard takes the cached partition as it was (all the batch removes was
    # hidden already) instead of waiting for the stripe; once another
    # write comes between, it loads the partition again.
    engine, _, _ = make_engine()
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "a note"))
    engine.inject(SCOPE, "s")
    partitions = engine.inside().partitions
    key = (Tier.MEMORY, SCOPE.agent_id)
    held = partitions.cached(key)
    assert held is not None
    g = held.generation
    partitions.sweeps.add(key, Swept((Expired(10**9, "gone", 5),), held.usage, g, g + 10, 1))
    partitions.heard(SCOPE.agent_id, Tier.MEMORY.value, g + 10)
    got: list[object] = []
    with partitions.writing([key]):  # the batch, under way
        reader = threading.Thread(target=lambda: got.append(partitions.get(key)))
        reader.start()
        reader.join(WAIT_SECONDS)
        assert not reader.is_alive()
    assert got == [held]
    assert engine.inject(SCOPE, "s").cache_hit

    partitions.heard(SCOPE.agent_id, Tier.MEMORY.value, g + 20)  # another process wrote
    assert partitions.get(key) is not held
