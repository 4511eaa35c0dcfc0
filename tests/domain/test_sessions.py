"""Session lifetimes and thread safety of snapshots."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from sidecar.core.memory import Scope, Tier
from sidecar.core.metrics import Metrics
from sidecar.domain.engine import Stats
from sidecar.domain.sessions import Limits, SessionTable
from sidecar.storage.writes import NewEntry
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    MakeEngine,
    MakeSidecar,
)

SCOPE = Scope(agent_id="coder", user_id="ada")


def evicted(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value(
        "memory_snapshot_invalidations_total", {"reason": "evicted"}
    )
    assert value is not None
    return value


def test_idle_sessions_are_evicted_after_the_ttl(make_engine: MakeEngine) -> None:
    engine, clock, metrics = make_engine("defaults: {session_idle_ttl_seconds: 10}")
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "a note"))
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
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "a note"))
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
        engine.add(NewEntry(scope, Tier.MEMORY, f"note {n}"))
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
            engine.add(NewEntry(SCOPE, Tier.MEMORY, f"fact {k}"))
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
        thread.join(WAIT_SECONDS)
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
                pb.UpdateMemoryRequest(scope=scope, id=owned[i], content=content),
                timeout=CALL_SECONDS,
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


def test_drop_where_ends_the_sessions_whose_view_must_go() -> None:
    table: SessionTable[str] = SessionTable(lambda agent: Limits(60, 10))
    for agent, session, view in (
        ("a", "one", "showed ada"),
        ("a", "two", "showed bob"),
        ("a", "three", None),
        ("b", "only", "showed ada"),
        ("c", "only", "showed bob"),
    ):
        held = table.get(session, agent, 0.0)
        if view is not None:
            table.attach(held, view, held.epoch)
    assert table.drop_where(lambda view: "ada" in view) == 2
    assert len(table) == 3
    assert table.agents == 2  # b had no other session
    assert sorted((agent, key) for agent, key, _ in table.views()) == [("a", "two"), ("c", "only")]
    assert table.drop_where(lambda view: "ada" in view) == 0
