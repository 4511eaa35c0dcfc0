"""sidecar.domain.snapshots: one view per scope and generation, built once however
many sessions ask, and one shared view for every scope with nothing stored."""

from __future__ import annotations

import gc
import threading
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

from sidecar.core.memory import Scope, Tier
from sidecar.domain.engine import Stats
from sidecar.storage.writes import NewEntry
from tests.conftest import MakeEngine

SCOPE = Scope(agent_id="coder", user_id="ada")


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


def test_a_stale_snapshot_is_rebuilt_once_for_many_concurrent_callers(
    make_engine: MakeEngine,
) -> None:
    engine, _, metrics = make_engine()
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "first note"))
    sessions = [f"s{n}" for n in range(16)]
    for session in sessions:
        engine.inject(SCOPE, session)
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "second note"))

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
