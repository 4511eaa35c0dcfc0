"""Session lifetimes and thread safety of snapshots."""

from __future__ import annotations

import gc
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar import config
from sidecar.engine import MemoryEngine, Stats
from sidecar.memory import Scope, Tier
from sidecar.metrics import Metrics
from sidecar.sessions import Limits, SessionTable
from sidecar.store import Store, TierPolicy
from tests.conftest import MakeSidecar

SCOPE = Scope(agent_id="coder", user_id="ada")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


MakeEngine = Callable[..., tuple[MemoryEngine, Clock, Metrics]]


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[MakeEngine]:
    """An engine over a real store, with a clock the test moves by hand."""
    stores: list[Store] = []

    def make(yaml_text: str = "", *, changes: bool = False) -> tuple[MemoryEngine, Clock, Metrics]:
        path = tmp_path / "config.yaml"
        path.write_text(yaml_text)
        cfg = config.load(path, environ={})
        metrics = Metrics(CollectorRegistry())
        store = Store(str(tmp_path / "m.db"), on_query=metrics.db_query)
        store.open()
        stores.append(store)
        clock = Clock()
        engine = MemoryEngine(cfg, store, metrics=metrics, now=clock, changes=changes)
        return engine, clock, metrics

    yield make
    for store in stores:
        store.close()


def evicted(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value(
        "memory_snapshot_invalidations_total", {"reason": "evicted"}
    )
    assert value is not None
    return value


def test_idle_sessions_are_evicted_after_the_ttl(make_engine: MakeEngine) -> None:
    engine, clock, metrics = make_engine("defaults: {session_idle_ttl_seconds: 10}")
    engine.add(SCOPE, Tier.MEMORY, "a note", "", 1.0)
    engine.inject(SCOPE, "early")
    clock.now = 5
    engine.inject(SCOPE, "later")

    clock.now = 12
    assert engine.evict_idle() == 1
    assert engine.stats().sessions == 1
    assert evicted(metrics) == 1
    assert engine.inject(SCOPE, "later").cache_hit
    assert not engine.inject(SCOPE, "early").cache_hit  # starts afresh

    clock.now = 100
    assert engine.evict_idle() == 2
    # Nothing stays: the partitions idled past the TTL too.
    assert engine.stats() == Stats(sessions=0, views=0, partitions=0, agents=0, followed=0)


def test_sessions_beyond_the_cap_go_least_recently_used_first(make_engine: MakeEngine) -> None:
    engine, clock, metrics = make_engine("agents: {coder: {max_sessions: 3}}")
    engine.add(SCOPE, Tier.MEMORY, "a note", "", 1.0)
    for n in range(3):
        clock.now = n
        engine.inject(SCOPE, f"s{n}")
    clock.now = 3
    engine.inject(SCOPE, "s0")  # s0 is now the most recently used
    clock.now = 4
    engine.inject(SCOPE, "s3")  # a fourth session pushes out s1
    assert engine.stats().sessions == 3
    assert evicted(metrics) == 1
    assert engine.inject(SCOPE, "s0").cache_hit
    assert engine.inject(SCOPE, "s2").cache_hit
    assert not engine.inject(SCOPE, "s1").cache_hit
    # Other agents have their own cap.
    other = Scope(agent_id="writer")
    for n in range(5):
        engine.inject(other, f"w{n}")
    assert engine.stats().sessions == 3 + 5


def test_the_total_cap_evicts_the_least_recently_used_agents_session(
    make_engine: MakeEngine,
) -> None:
    engine, clock, metrics = make_engine("server: {max_sessions_total: 3}")
    agents = [Scope(agent_id=f"agent-{n}") for n in range(4)]
    for n in range(3):
        clock.now = n
        engine.inject(agents[n], "s")
    clock.now = 3
    engine.inject(agents[0], "s")  # agent-0 is now the most recently used
    clock.now = 4
    engine.inject(agents[3], "s")  # a fourth session pushes out agent-1's
    assert (engine.stats().sessions, engine.stats().agents) == (3, 3)
    assert evicted(metrics) == 1
    for n in (0, 2, 3):
        assert engine.inject(agents[n], "s").cache_hit
    assert not engine.inject(agents[1], "s").cache_hit


def test_nothing_is_kept_for_agents_whose_sessions_are_gone(make_engine: MakeEngine) -> None:
    engine, clock, _ = make_engine("defaults: {session_idle_ttl_seconds: 10}")
    for n in range(200):
        scope = Scope(agent_id=f"agent-{n}", user_id=f"user-{n}")
        engine.add(scope, Tier.MEMORY, f"note {n}", "", 1.0)
        engine.inject(scope, "s")
        engine.search(scope, "note", list(Tier), limit=5)
    stats = engine.stats()
    assert (stats.sessions, stats.agents, stats.views) == (200, 200, 200)
    assert stats.partitions == stats.followed == 400
    clock.now = 5
    engine.evict_idle()
    assert engine.stats() == stats  # nothing idle yet
    clock.now = 11
    assert engine.evict_idle() == 200
    assert engine.stats() == Stats(sessions=0, views=0, partitions=0, agents=0, followed=0)


def test_new_agents_with_nothing_stored_cost_little_and_share_one_snapshot(
    make_engine: MakeEngine,
) -> None:
    """Issue 10: a flood of new agents (one session each, nothing stored) costs
    a session each, not a snapshot, an empty partition or a dict of sessions."""
    # A one-entry partition cache: what it holds is bounded whatever the count.
    engine, clock, _ = make_engine(
        "defaults: {session_idle_ttl_seconds: 10}\nserver: {partition_cache_size: 1}"
    )
    agents = [Scope(agent_id=f"agent-{n}") for n in range(2000)]
    engine.inject(Scope(agent_id="warm-up"), "s")
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        snapshots = {id(engine.inject(scope, "s").snapshot) for scope in agents}
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # About 230 bytes each (a session, a followed partition key); a snapshot or
    # a dict of sessions per agent would add 220 bytes or more.
    assert grown / len(agents) < 400
    assert len(snapshots) == 1
    stats = engine.stats()
    assert (stats.sessions, stats.agents, stats.views) == (2001, 2001, 0)
    # Each agent's tier stays followed (a write by another process must be
    # heard); the user tier of user_id "" is one for all.
    assert stats.followed == 2001 + 1
    engine.evict_idle()
    assert engine.stats().followed == stats.followed
    assert engine.inject(agents[0], "s").cache_hit
    clock.now = 11
    assert engine.evict_idle() == 2001
    assert engine.stats() == Stats(sessions=0, views=0, partitions=0, agents=0, followed=0)


@pytest.mark.parametrize("tier", list(Tier))
def test_another_process_writing_a_never_written_tier_is_seen_on_the_next_turn(
    make_engine: MakeEngine, tmp_path: Path, tier: Tier
) -> None:
    # Sessions of scopes with nothing written share one snapshot: news of a
    # write to this scope's tier must still reach this session, and only it.
    engine, _, metrics = make_engine("server: {partition_cache_size: 1}", changes=True)
    feed = engine.feed
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
        writer.add(SCOPE, tier, "written elsewhere", "", 1.0, TierPolicy(2200))
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
            engine.add(scope, Tier.MEMORY, f"agent {n} knows fact number {k}", "", 1.0)
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
        engine.add(big, Tier.MEMORY, f"big fact number {k} about the deploy", "", 1.0)
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
        engine.add(scope, Tier.MEMORY, "a small note", "", 1.0)
        engine.search(scope, "note", [Tier.MEMORY], limit=5)
    before = selects()
    for scope in [*smalls, big]:
        engine.search(scope, "note", [Tier.MEMORY], limit=5)
    assert selects() == before


def test_a_session_holding_an_older_view_still_hears_of_remote_writes(
    make_engine: MakeEngine,
) -> None:
    engine, clock, _ = make_engine("defaults: {session_idle_ttl_seconds: 10}")
    engine.add(SCOPE, Tier.MEMORY, "a note", "", 1.0)
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
    engine._heard(SCOPE.agent_id, Tier.MEMORY.value, 10**9)
    assert not engine.inject(SCOPE, "a").cache_hit


def test_a_stale_snapshot_is_rebuilt_once_for_many_concurrent_callers(
    make_engine: MakeEngine,
) -> None:
    engine, _, metrics = make_engine()
    engine.add(SCOPE, Tier.MEMORY, "first note", "", 1.0)
    sessions = [f"s{n}" for n in range(16)]
    for session in sessions:
        engine.inject(SCOPE, session)
    engine.add(SCOPE, Tier.MEMORY, "second note", "", 1.0)

    def selects() -> float:
        return (
            metrics.registry.get_sample_value("memory_db_queries_total", {"operation": "select"})
            or 0.0
        )

    before = selects()
    barrier = threading.Barrier(len(sessions))

    def turn(session: str) -> str:
        barrier.wait()
        return engine.inject(SCOPE, session).system_block

    with ThreadPoolExecutor(max_workers=len(sessions)) as pool:
        blocks = list(pool.map(turn, sessions))
    assert len(set(blocks)) == 1
    assert "second note" in blocks[0]
    # The write was applied to the cached partition: nobody reads it back.
    assert selects() - before == 0
    assert engine.stats().views == 1


def test_an_invalidation_racing_a_rebuild_is_not_lost() -> None:
    table: SessionTable[str] = SessionTable(lambda agent: Limits(60, 10))
    session = table.get("s", "coder", now=0)
    epoch = session.epoch  # a turn starts building a view...
    assert not table.invalidate("s", "coder")  # ...compaction arrives meanwhile...
    assert not table.attach(session, "view built before compaction", epoch)
    assert session.view is None  # ...so the next turn rebuilds again
    assert session.compacted
    assert table.attach(session, "fresh view", session.epoch)
    assert session.view == "fresh view"
    assert table.invalidate("s", "coder")


def test_compaction_racing_rebuilds_is_never_lost(make_engine: MakeEngine) -> None:
    engine, _, _ = make_engine("defaults: {snapshot_refresh: on_compaction}")
    engine.inject(SCOPE, "s")
    compacted_upto = -1
    done = threading.Event()
    problems: list[str] = []

    def writer() -> None:
        nonlocal compacted_upto
        for k in range(40):
            engine.add(SCOPE, Tier.MEMORY, f"fact {k}", "", 1.0)
            engine.notify_compaction(SCOPE, "s")
            compacted_upto = k
        done.set()

    def turner() -> None:
        while not done.is_set():
            seen = compacted_upto  # compaction of this fact finished before the turn began
            block = engine.inject(SCOPE, "s").system_block
            if seen >= 0 and f"fact {seen}" not in block:
                problems.append(f"fact {seen} compacted but missing")

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=turner) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert problems == []
    assert "fact 39" in engine.inject(SCOPE, "s").system_block


def test_no_stale_block_after_an_acknowledged_write(make_sidecar: MakeSidecar) -> None:
    from sidecar._proto.memory.v1 import memory_pb2 as pb

    running = make_sidecar(max_workers=8)
    scope = pb.Scope(agent_id="coder", user_id="ada")
    writers = 6
    owned = [running.add(f"thread {i} version 0", scope=scope).memory.id for i in range(writers)]

    def work(i: int) -> list[str]:
        problems = []
        for version in range(1, 15):
            content = f"thread {i} version {version}"
            running.stub.UpdateMemory(
                pb.UpdateMemoryRequest(scope=scope, id=owned[i], content=content), timeout=10
            )
            turn = running.turn(f"session-{i}", "version", scope=scope)
            if content not in turn.system_block:
                problems.append(f"{content!r} missing after its update was acknowledged")
            hits = running.stub.SearchMemories(
                pb.SearchMemoriesRequest(scope=scope, query=f"version {version}", limit=50)
            ).hits
            if content not in [h.memory.content for h in hits]:
                problems.append(f"{content!r} not found by search")
        return problems

    with ThreadPoolExecutor(max_workers=writers) as pool:
        problems = [p for result in pool.map(work, range(writers)) for p in result]
    assert problems == []
