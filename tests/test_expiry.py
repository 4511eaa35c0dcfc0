"""Expiry: an entry given expires_at or ttl_seconds (or its agent's default
TTL) is never injected, searched or listed once it expires, weighs nothing
in its tier's budget, and is removed by the sweep in bounded batches.

A contract suite over real daemons on both backends. Entries expire by the
store's wall clock, injected into each daemon: a test moves it past an
entry's expiry instead of sleeping until then (replicas share one clock).
"""

from __future__ import annotations

import functools
import io
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.config import settings
from sidecar.core.clock import to_micros
from sidecar.core.memory import Scope, Tier
from sidecar.domain.engine import MemoryEngine
from sidecar.domain.expiry import Requested
from sidecar.ops import admin
from sidecar.retrieval.compact import CompactPartition
from sidecar.storage import archive
from sidecar.storage.archive import LegacyEntry
from sidecar.storage.expiry import Swept
from sidecar.storage.store import Store
from sidecar.storage.writes import Expires, NewEntry, TierPolicy
from tests.conftest import (
    CALL_SECONDS,
    MakeSidecar,
    Running,
    WallClock,
    contents,
    error_info,
    eventually,
    refused,
)
from tests.test_watch import Watcher
from tests.waits import WAIT_SECONDS

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
# No background sweep unless a test asks: what is shown must follow the
# clock alone, with no write and no removal.
NO_SWEEP = {"expiry_sweep_seconds": 0}
# Expired rows removed as soon as they expire: no grace for a clock set back
# (test_a_clock_set_back_shows_an_expired_entry_again has one).
NO_GRACE = {"expiry_grace_seconds": 0}
TTL = 2


@pytest.fixture
def clock() -> WallClock:
    return WallClock()


@pytest.fixture
def make_sidecar(make_sidecar: MakeSidecar, clock: WallClock) -> MakeSidecar:
    """Daemons whose stores judge expiry by the test's clock (replicas share it)."""
    return functools.partial(make_sidecar, clock=clock)


def wait_past(clock: WallClock, response: pb.AddMemoryResponse | pb.UpdateMemoryResponse) -> None:
    """Move the daemons' clock past the entry's expires_at."""
    expires = response.memory.expires_at.ToDatetime(tzinfo=UTC)
    clock.now = max(clock.now, expires + timedelta(milliseconds=1))


def events(running: Running, kind: str) -> list[tuple[int, str]]:
    """(generation, memory id) of the logged events of this kind."""
    db = running.store.tables.db
    with db.connection_context():
        rows = db.execute_sql(
            f"SELECT generation, memory_id FROM memory_events WHERE kind = {db.param}"
            " ORDER BY generation",
            (kind,),
        ).fetchall()
    return [(int(g), str(m)) for g, m in rows]


def row_count(running: Running) -> int:
    db = running.store.tables.db
    with db.connection_context():
        return int(db.execute_sql("SELECT COUNT(*) FROM memories").fetchone()[0])


def _facts_and_briefs(running: Running, briefs: int) -> list[pb.AddMemoryResponse]:
    """Five standing facts, then `briefs` briefs expiring after TTL (their answers)."""
    for i in range(5):
        running.add(f"Standing fact number {i} about the staging cluster", scope=SCOPE)
    return [
        running.add(f"Brief {i}: the staging cluster is down", scope=SCOPE, ttl_seconds=TTL)
        for i in range(briefs)
    ]


@pytest.mark.parametrize("refresh", ["on_write", "on_compaction"])
def test_an_expired_entry_leaves_the_frozen_block_without_any_write(
    clock: WallClock, make_sidecar: MakeSidecar, refresh: str
) -> None:
    sidecar = make_sidecar(f"defaults: {{snapshot_refresh: {refresh}}}", **NO_SWEEP)
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=TTL)
    sidecar.add("The repo uses uv", scope=SCOPE)
    first = sidecar.turn("s", "cluster", scope=SCOPE)
    assert "staging cluster" in first.system_block
    assert brief.memory.id in first.system_block_memory_ids
    assert sidecar.turn("s", scope=SCOPE).cache_hit

    wait_past(clock, brief)
    after = sidecar.turn("s", "cluster", scope=SCOPE)
    assert "staging cluster" not in after.system_block + after.turn_context
    assert "uses uv" in after.system_block
    assert not after.cache_hit
    # The header's usage no longer counts it either.
    assert after.usage[0].entry_count == 1


def test_an_expired_entry_leaves_the_turn_block(
    clock: WallClock, make_sidecar: MakeSidecar
) -> None:
    sidecar = make_sidecar("defaults: {inject_system_block: false}", **NO_SWEEP)
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=TTL)
    sidecar.add("The staging cluster runs on arm64", scope=SCOPE)
    before = sidecar.turn("s", "staging cluster", scope=SCOPE)
    assert brief.memory.id in before.injected_memory_ids

    wait_past(clock, brief)
    after = sidecar.turn("s", "staging cluster", scope=SCOPE)
    assert brief.memory.id not in after.injected_memory_ids
    assert "down today" not in after.turn_context
    assert "arm64" in after.turn_context


def test_a_daemon_on_the_real_clock_expires_by_it(make_sidecar: MakeSidecar) -> None:
    # The one test that waits: every other one moves an injected clock.
    sidecar = make_sidecar(clock=None, **NO_SWEEP)
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=1)
    assert contents(sidecar, SCOPE) == ["The staging cluster is down today"]
    expires = brief.memory.expires_at.ToDatetime(tzinfo=UTC)
    eventually(lambda: datetime.now(UTC) > expires, "the entry's expiry passes", pause=0.05)
    assert contents(sidecar, SCOPE) == []


def test_search_and_lists_leave_expired_entries_out_unless_asked(
    clock: WallClock,
    make_sidecar: MakeSidecar,
) -> None:
    sidecar = make_sidecar(**NO_SWEEP)
    brief = [sidecar.add(f"deploy note {i} expires", scope=SCOPE, ttl_seconds=1) for i in range(2)]
    kept = [sidecar.add(f"deploy note {i} stays", scope=SCOPE) for i in range(3)]
    # Interleaved in insertion order with the ones that stay.
    brief.append(sidecar.add("deploy note late expires", scope=SCOPE, ttl_seconds=1))
    assert brief[0].memory.HasField("expires_at")
    assert not kept[0].memory.HasField("expires_at")
    for added in brief:
        wait_past(clock, added)

    listed = sidecar.list(scope=SCOPE)
    stays = [m.content for m in listed.memories]
    assert stays == [f"deploy note {i} stays" for i in range(3)]
    assert {u.tier: u.entry_count for u in listed.usage}[pb.TIER_MEMORY] == 3
    # Paging walks the same three, one at a time.
    paged: list[str] = []
    token = ""
    while True:
        page = sidecar.list(scope=SCOPE, page_size=1, page_token=token)
        paged.extend(m.content for m in page.memories)
        token = page.next_page_token
        if not token:
            break
    assert paged == stays

    everything = sidecar.list(scope=SCOPE, include_expired=True)
    assert len(everything.memories) == 6
    assert {m.id for m in everything.memories if m.HasField("expires_at")} == {
        b.memory.id for b in brief
    }

    found = sidecar.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=SCOPE, query="deploy note"), timeout=CALL_SECONDS
    )
    assert sorted(r.memory.content for r in found.hits) == sorted(stays)
    # The model's own tools read the same way.
    tool = sidecar.stub.CallTool(
        pb.CallToolRequest(scope=SCOPE, name="memory_search", arguments_json='{"query":"deploy"}'),
        timeout=CALL_SECONDS,
    )
    assert not tool.is_error, tool.text
    assert all(f"deploy note {i} stays" in tool.text for i in range(3))
    assert "expires" not in tool.text
    # ExportMemories (the RPC) reads the same way.
    exported = "".join(
        r.jsonl
        for r in sidecar.stub.ExportMemories(
            pb.ExportMemoriesRequest(scope=SCOPE), timeout=CALL_SECONDS
        )
    )
    lines = enumerate(exported.splitlines(), start=1)
    assert [archive.parse_line(n, line)[1].content for n, line in lines] == stays


@pytest.mark.parametrize("write", ["update", "delete"])
def test_an_expired_entry_cannot_be_updated_or_deleted(
    clock: WallClock, sidecar: Running, write: str
) -> None:
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=1)
    wait_past(clock, brief)
    call: Callable[..., object]
    if write == "update":
        request: object = pb.UpdateMemoryRequest(id=brief.memory.id, scope=SCOPE, content="up")
        call = sidecar.stub.UpdateMemory
    else:
        request = pb.DeleteMemoryRequest(id=brief.memory.id, scope=SCOPE)
        call = sidecar.stub.DeleteMemory
    error = refused(call, request, timeout=CALL_SECONDS)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    info = error_info(error)
    assert (info.reason, info.metadata["id"]) == ("EXPIRED", brief.memory.id)
    # Refused before anything was written: the row waits for the sweep.
    assert row_count(sidecar) == 1
    assert events(sidecar, "expire") == []


def test_expired_entries_do_not_count_against_the_budget(
    clock: WallClock, make_sidecar: MakeSidecar
) -> None:
    sidecar = make_sidecar("defaults: {memory_char_limit: 40}", **NO_SWEEP, **NO_GRACE)
    brief = sidecar.add("a" * 30, scope=SCOPE, ttl_seconds=1)
    error = refused(sidecar.add, "b" * 30, scope=SCOPE)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    wait_past(clock, brief)
    # Reads already leave it out of the usage, before any write removed it.
    usage = {u.tier: u for u in sidecar.list(scope=SCOPE).usage}[pb.TIER_MEMORY]
    assert (usage.used_chars, usage.entry_count) == (0, 0)
    assert row_count(sidecar) == 1

    added = sidecar.add("b" * 30, scope=SCOPE)
    assert added.usage.used_chars == 30
    # The write removed the expired row first, in its own transaction, and
    # logged it; both got the write's generation.
    assert row_count(sidecar) == 1
    expired = events(sidecar, "expire")
    assert [memory_id for _, memory_id in expired] == [brief.memory.id]
    assert expired[0][0] == events(sidecar, "add")[-1][0]


def test_an_agents_default_ttl_applies_per_tier(make_sidecar: MakeSidecar) -> None:
    sidecar = make_sidecar(
        "defaults: {memory_ttl_seconds: 3600}\nagents: {coder: {user_ttl_seconds: 60}}"
    )
    other = pb.Scope(agent_id="reviewer", user_id="ada")
    note = sidecar.add("The repo uses uv", scope=SCOPE)
    profile = sidecar.add("Prefers tabs", scope=other, tier=pb.TIER_USER)
    coder_profile = sidecar.add("Prefers spaces", scope=SCOPE, tier=pb.TIER_USER)
    asked = sidecar.add("Lasts a day", scope=SCOPE, ttl_seconds=86_400)

    def lifetime(response: pb.AddMemoryResponse) -> float:
        memory = response.memory
        return memory.expires_at.ToSeconds() - memory.created_at.ToSeconds()

    assert lifetime(note) == pytest.approx(3600, abs=1)
    assert not profile.memory.HasField("expires_at")
    assert lifetime(coder_profile) == pytest.approx(60, abs=1)
    assert lifetime(asked) == pytest.approx(86_400, abs=1)


def test_an_agents_default_ttl_applies_to_the_models_tool_adds(make_sidecar: MakeSidecar) -> None:
    sidecar = make_sidecar(
        "defaults: {memory_ttl_seconds: 3600}\nagents: {coder: {user_ttl_seconds: 60}}"
    )
    for target in ("memory", "user"):
        arguments = (
            f'{{"action":"add","target":"{target}","content":"Noted by the model ({target})"}}'
        )
        called = sidecar.stub.CallTool(
            pb.CallToolRequest(scope=SCOPE, name="memory", arguments_json=arguments),
            timeout=CALL_SECONDS,
        )
        assert not called.is_error, called.text
    listed = {m.content: m for m in sidecar.list(scope=SCOPE).memories}
    lifetimes = {
        content: m.expires_at.ToSeconds() - m.created_at.ToSeconds()
        for content, m in listed.items()
        if m.HasField("expires_at")
    }
    assert lifetimes == {
        "Noted by the model (memory)": pytest.approx(3600, abs=1),
        "Noted by the model (user)": pytest.approx(60, abs=1),
    }


def _timestamp(moment: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(moment)
    return stamp


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"ttl_seconds": 60, "expires_at": "+1h"}, "EXPIRY_CONFLICT"),
        ({"ttl_seconds": -5}, "TTL_OUT_OF_RANGE"),
        ({"ttl_seconds": 10**12}, "TTL_OUT_OF_RANGE"),
        ({"expires_at": "-1h"}, "EXPIRES_AT_PAST"),
        ({"expires_at": "+200y"}, "EXPIRES_AT_TOO_FAR"),
    ],
)
def test_invalid_expiries_are_refused_and_nothing_is_stored(
    sidecar: Running, fields: dict[str, object], reason: str
) -> None:
    offsets = {
        "+1h": timedelta(hours=1),
        "-1h": -timedelta(hours=1),
        "+200y": timedelta(days=73_000),
    }
    given = dict(fields)
    if "expires_at" in given:
        given["expires_at"] = _timestamp(datetime.now(UTC) + offsets[str(given["expires_at"])])
    error = refused(sidecar.add, "The repo uses uv", scope=SCOPE, **given)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(error).reason == reason
    assert sidecar.list(scope=SCOPE, include_expired=True).memories == []


def test_update_sets_and_clears_an_expiry(clock: WallClock, sidecar: Running) -> None:
    added = sidecar.add("The repo uses uv", scope=SCOPE)
    update = sidecar.stub.UpdateMemory
    set_ = update(pb.UpdateMemoryRequest(scope=SCOPE, id=added.memory.id, ttl_seconds=600))
    assert set_.memory.content == "The repo uses uv"
    assert set_.memory.expires_at.ToSeconds() == pytest.approx(time.time() + 600, abs=5)
    # Changing only the expiry is a write: the watchers hear an update.
    assert [m for _, m in events(sidecar, "update")] == [added.memory.id]
    conflict = refused(
        update,
        pb.UpdateMemoryRequest(scope=SCOPE, id=added.memory.id, ttl_seconds=5, clear_expiry=True),
    )
    assert error_info(conflict).reason == "EXPIRY_CONFLICT"
    cleared = update(pb.UpdateMemoryRequest(scope=SCOPE, id=added.memory.id, clear_expiry=True))
    assert not cleared.memory.HasField("expires_at")
    listed = sidecar.list(scope=SCOPE)
    assert not listed.memories[0].HasField("expires_at")

    brief = update(pb.UpdateMemoryRequest(scope=SCOPE, id=added.memory.id, ttl_seconds=1))
    wait_past(clock, brief)
    gone = refused(update, pb.UpdateMemoryRequest(scope=SCOPE, id=added.memory.id, content="x"))
    assert gone.code() == grpc.StatusCode.NOT_FOUND


def test_the_sweep_removes_expired_rows_in_batches(
    clock: WallClock, make_sidecar: MakeSidecar
) -> None:
    sidecar = make_sidecar(expiry_sweep_seconds=0, expiry_sweep_batch=2, **NO_GRACE)
    brief = [sidecar.add(f"note {i}", scope=SCOPE, ttl_seconds=1) for i in range(5)]
    sidecar.add("note kept", scope=SCOPE)
    other = sidecar.add("their note", scope=pb.Scope(agent_id="reviewer"), ttl_seconds=1)
    for added in [*brief, other]:
        wait_past(clock, added)
    assert row_count(sidecar) == 7

    assert sidecar.sidecar.engine.sweep_expired() == 6
    assert row_count(sidecar) == 1
    expired = events(sidecar, "expire")
    assert {m for _, m in expired} == {a.memory.id for a in [*brief, other]}
    # Two entries per transaction: the coder's five took three generations.
    mine = {a.memory.id for a in brief}
    assert len({g for g, m in expired if m in mine}) == 3
    assert sidecar.sidecar.engine.sweep_expired() == 0
    assert contents(sidecar, SCOPE, include_expired=True) == ["note kept"]


def test_a_paced_sweep_rests_after_each_batch_and_stops_while_resting(
    clock: WallClock, make_sidecar: MakeSidecar
) -> None:
    sidecar = make_sidecar(expiry_sweep_batch=2, **NO_SWEEP, **NO_GRACE)
    engine = sidecar.sidecar.engine
    briefs = [sidecar.add(f"note {i}", scope=SCOPE, ttl_seconds=1) for i in range(5)]
    wait_past(clock, briefs[-1])
    rests: list[float] = []
    assert engine.sweep_expired(rest=rests.append) == 5
    # Once after each of the three batches, PACE times as long as the batch took.
    assert len(rests) == 3
    assert min(rests) >= 0

    # Told to stop while resting (the server's stop event wakes its wait):
    # the pass ends there, the rest left for the next.
    briefs = [sidecar.add(f"note {i}", scope=SCOPE, ttl_seconds=1) for i in range(5)]
    wait_past(clock, briefs[-1])
    stopped = threading.Event()
    assert engine.sweep_expired(stop=stopped.is_set, rest=lambda _: stopped.set()) == 2
    assert row_count(sidecar) == 3
    assert engine.sweep_expired() == 3


def test_the_background_sweep_runs(clock: WallClock, make_sidecar: MakeSidecar) -> None:
    sidecar = make_sidecar(expiry_sweep_seconds=0.1, **NO_GRACE)
    brief = sidecar.add("note", scope=SCOPE, ttl_seconds=1)
    wait_past(clock, brief)
    eventually(lambda: row_count(sidecar) == 0, "the sweep removes the row", pause=0.05)


@pytest.mark.parametrize("held", ["in_full", "compactly"])
def test_a_sweep_of_hidden_entries_keeps_frozen_blocks_and_tells_watchers_and_replicas(
    clock: WallClock, make_sidecar: MakeSidecar, held: str
) -> None:
    # Removing entries that were hidden already changes nothing a frozen
    # block shows: however many batches (generations) the sweep takes, the
    # session keeps its block, while watchers see each removal once and
    # another replica drops them from what it holds.
    server = {"compact_tier_entries": 4} if held == "compactly" else {}
    settings = "defaults: {memory_char_limit: 0}"
    a = make_sidecar(settings, expiry_sweep_batch=2, **server, **NO_SWEEP, **NO_GRACE)
    b = make_sidecar(settings, **server, **NO_SWEEP, **NO_GRACE)
    briefs = _facts_and_briefs(a, 5)
    gone = {brief.memory.id for brief in briefs}
    watcher = Watcher(a.stub, scope=SCOPE)
    assert watcher.next().kind == pb.MemoryEvent.KIND_SYNC
    wait_past(clock, briefs[-1])
    first = a.turn("s", "staging", scope=SCOPE)
    assert len(first.system_block_memory_ids) == 5
    assert not gone & (set(first.system_block_memory_ids) | set(first.injected_memory_ids))
    eventually(
        lambda: len(b.turn("s", "staging", scope=SCOPE).system_block_memory_ids) == 5,
        "B hears A's writes",
        pause=0.02,
    )
    key = (Tier.MEMORY, SCOPE.agent_id)
    held_by_b = b.sidecar.engine.inside().partitions.cached(key)
    # A compact tier holds its expired rows until removed (it reads entries
    # back by the clock); one held in full was loaded without them.
    assert held_by_b is not None
    assert held_by_b.count == (10 if held == "compactly" else 5)

    try:
        assert a.sidecar.engine.sweep_expired() == 5
        swept = events(a, "expire")
        assert len({g for g, _ in swept}) == 3  # two per batch
        for message in ("staging", "cluster down", ""):
            turn = a.turn("s", message, scope=SCOPE)
            assert turn.cache_hit
            assert turn.snapshot_generation == first.snapshot_generation
            assert turn.system_block == first.system_block
            assert not gone & set(turn.injected_memory_ids)
        # Each removal reaches watchers once, in generation order.
        expired = watcher.take(5)
        assert [e.kind for e in expired] == [pb.MemoryEvent.KIND_EXPIRE] * 5
        assert {e.id for e in expired} == gone
        assert [e.generation for e in expired] == sorted(e.generation for e in expired)
        note = a.add("The repo uses uv", scope=SCOPE)
        after = watcher.next()
        assert (after.kind, after.id) == (pb.MemoryEvent.KIND_ADD, note.memory.id)
    finally:
        watcher.close()

    # The replica hears the removals' generations and holds the tier without them.
    def b_dropped() -> bool:
        turn = b.turn("s", "staging", scope=SCOPE)
        assert not gone & (set(turn.system_block_memory_ids) | set(turn.injected_memory_ids))
        cached = b.sidecar.engine.inside().partitions.cached(key)
        return cached is not None and cached.count == 6

    eventually(b_dropped, "B drops the removed entries", pause=0.02)


def test_a_sweep_removing_what_a_frozen_block_shows_rebuilds_it(
    clock: WallClock, make_sidecar: MakeSidecar
) -> None:
    # The block still shows an entry when the sweep removes it (it was
    # built before the entry expired); a clock then set back before that
    # expiry must not bring the removed entry back from the frozen block.
    sidecar = make_sidecar(**NO_SWEEP, **NO_GRACE)
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=TTL)
    sidecar.add("The repo uses uv", scope=SCOPE)
    first = sidecar.turn("s", scope=SCOPE)
    assert brief.memory.id in first.system_block_memory_ids
    right = clock.now
    wait_past(clock, brief)
    assert sidecar.sidecar.engine.sweep_expired() == 1
    clock.now = right
    back = sidecar.turn("s", scope=SCOPE)
    assert not back.cache_hit
    assert back.snapshot_generation > first.snapshot_generation
    assert brief.memory.id not in back.system_block_memory_ids
    assert "uses uv" in back.system_block


@pytest.mark.parametrize("refresh", ["on_write", "on_compaction"])
def test_a_compact_tier_hides_an_expired_entry_and_refreshes_its_block(
    clock: WallClock, make_sidecar: MakeSidecar, refresh: str
) -> None:
    sidecar = make_sidecar(
        f"defaults: {{snapshot_refresh: {refresh}, memory_char_limit: 0}}",
        compact_tier_entries=4,
        **NO_SWEEP,
        **NO_GRACE,
    )
    for i in range(5):
        sidecar.add(f"Standing fact number {i}", scope=SCOPE)
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=TTL)
    first = sidecar.turn("s", "staging", scope=SCOPE)
    key = (Tier.MEMORY, SCOPE.agent_id)
    held = sidecar.sidecar.engine.inside().partitions.cached(key)
    assert isinstance(held, CompactPartition)
    assert brief.memory.id in first.system_block_memory_ids

    wait_past(clock, brief)
    after = sidecar.turn("s", "staging", scope=SCOPE)
    assert brief.memory.id not in after.system_block_memory_ids
    assert brief.memory.id not in after.injected_memory_ids
    # Still the same compact partition: nothing was loaded again.
    assert sidecar.sidecar.engine.inside().partitions.cached(key) is held
    found = sidecar.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=SCOPE, query="staging cluster"), timeout=CALL_SECONDS
    )
    assert list(found.hits) == []

    # The sweep's removal reaches the cached compact partition as a delete.
    assert sidecar.sidecar.engine.sweep_expired() == 1
    swept = sidecar.sidecar.engine.inside().partitions.cached(key)
    assert isinstance(swept, CompactPartition)
    assert swept.count == 5
    assert swept.storage is held.storage
    last = sidecar.turn("s", "staging", scope=SCOPE)
    assert brief.memory.id not in last.system_block_memory_ids
    assert len(last.system_block_memory_ids) == 5


def test_a_turn_during_a_sweep_batch_reads_the_tier_before_it_without_waiting(
    clock: WallClock, make_sidecar: MakeSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch holds the partition's stripe from its transaction until the
    # caches take it in. A turn that comes after its commit is heard reads
    # the cached compact partition from before the batch, without waiting:
    # the entries it still holds expired already and are never shown.
    sidecar = make_sidecar(
        "defaults: {memory_char_limit: 0}", compact_tier_entries=4, **NO_SWEEP, **NO_GRACE
    )
    briefs = _facts_and_briefs(sidecar, 3)
    gone = {brief.memory.id for brief in briefs}
    wait_past(clock, briefs[-1])
    first = sidecar.turn("s", "staging", scope=SCOPE)
    partitions = sidecar.sidecar.engine.inside().partitions
    key = (Tier.MEMORY, SCOPE.agent_id)
    held = partitions.cached(key)
    assert isinstance(held, CompactPartition)
    reached, release, resumed = threading.Event(), threading.Event(), threading.Event()
    taken_in = partitions.swept
    batches: list[int] = []

    def swept(key: tuple[Tier, str], batch: Swept) -> None:  # committed, under the stripe
        batches.append(batch.generation)
        reached.set()
        release.wait(WAIT_SECONDS)
        resumed.set()
        taken_in(key, batch)

    monkeypatch.setattr(partitions, "swept", swept)
    sweep = threading.Thread(target=sidecar.sidecar.engine.sweep_expired)
    sweep.start()
    try:
        assert reached.wait(WAIT_SECONDS)
        partitions.heard(SCOPE.agent_id, Tier.MEMORY.value, batches[0])  # as the feed would
        turn = sidecar.turn("s", "staging cluster down", scope=SCOPE)
        assert not resumed.is_set()  # the turn did not wait for the batch
        assert turn.cache_hit
        assert turn.system_block == first.system_block
        assert not gone & (set(turn.system_block_memory_ids) | set(turn.injected_memory_ids))
        assert partitions.cached(key) is held
    finally:
        release.set()
        sweep.join(WAIT_SECONDS)
    taken = partitions.cached(key)
    assert isinstance(taken, CompactPartition)
    assert (taken.generation, taken.count) == (batches[-1], 5)


def test_another_replica_drops_an_expired_entry_without_any_write(
    clock: WallClock,
    make_sidecar: MakeSidecar,
) -> None:
    settings = "defaults: {snapshot_refresh: on_compaction}"
    a = make_sidecar(settings, **NO_SWEEP)
    b = make_sidecar(settings, **NO_SWEEP)
    brief = a.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=TTL)
    a.add("The repo uses uv", scope=SCOPE)

    def shows(text: str) -> Callable[[], bool]:
        return lambda: text in b.turn("s", scope=SCOPE).system_block

    eventually(shows("uses uv"), "B hears A's writes", pause=0.02)
    assert shows("staging cluster")()
    assert b.turn("s", scope=SCOPE).cache_hit
    queries = b.db_queries()

    wait_past(clock, brief)
    after = b.turn("s", scope=SCOPE)
    assert "staging cluster" not in after.system_block
    assert "uses uv" in after.system_block
    # Nobody wrote: the rows are all still there, and B read the tier again
    # because of its own clock.
    assert row_count(a) == 2
    assert b.db_queries() > queries


def test_export_and_import_keep_the_expiry(sidecar: Running, tmp_path: Path) -> None:
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=3600)
    sidecar.add("The repo uses uv", scope=SCOPE)
    dump = tmp_path / "dump.jsonl"
    assert admin.export(sidecar.store, str(dump), io.StringIO()) == 0
    fresh = Store(str(tmp_path / "fresh.db"))
    fresh.open()
    try:
        assert admin.import_file(fresh, str(dump), io.StringIO()) == 0
        memories, _ = fresh.list_memories(Scope("coder", "ada"), [Tier.MEMORY])
    finally:
        fresh.close()
    expiries = {m.id: m.expires_at for m in memories}
    assert expiries[brief.memory.id] == brief.memory.expires_at.ToDatetime(tzinfo=UTC)
    assert len([at for at in expiries.values() if at is None]) == 1


def test_the_injected_clock_decides_what_has_expired(tmp_path: Path) -> None:
    clock = WallClock()
    store = Store(str(tmp_path / "m.db"), clock=clock)
    store.open()
    engine = MemoryEngine(settings.Config(), store)
    try:
        scope = Scope("coder", "ada")
        expires = engine.inside().expiry.for_add(scope, Tier.MEMORY, Requested(ttl_seconds=60))
        assert expires == Expires.at(to_micros(clock.now) + 60_000_000)
        text = "The staging cluster is down"
        brief = engine.add(NewEntry(scope, Tier.MEMORY, text), expiry=Requested(ttl_seconds=60))
        engine.add(NewEntry(scope, Tier.MEMORY, "The repo uses uv"))
        assert "staging" in engine.inject(scope, "s").system_block
        assert engine.inject(scope, "s").cache_hit

        clock.now += timedelta(seconds=59)
        assert engine.inject(scope, "s").cache_hit
        assert engine.sweep_expired() == 0
        clock.now += timedelta(seconds=1)
        after = engine.inject(scope, "s")
        assert not after.cache_hit
        assert "staging" not in after.system_block
        assert engine.search(scope, "staging", [Tier.MEMORY], limit=5) == []
        listed, usage = engine.list_memories(scope, [Tier.MEMORY], "")
        assert [m.content for m in listed] == ["The repo uses uv"]
        assert usage[Tier.MEMORY].entry_count == 1
        everything, _ = engine.list_memories(scope, [Tier.MEMORY], "", include_expired=True)
        assert brief.memory.id in {m.id for m in everything}

        assert engine.sweep_expired() == 1
        everything, _ = engine.list_memories(scope, [Tier.MEMORY], "", include_expired=True)
        assert [m.content for m in everything] == ["The repo uses uv"]
    finally:
        store.close()


def test_a_write_to_a_compact_tier_removes_its_expired_entries_in_place(
    clock: WallClock,
    make_sidecar: MakeSidecar,
) -> None:
    sidecar = make_sidecar(
        "defaults: {memory_char_limit: 0}", compact_tier_entries=4, **NO_SWEEP, **NO_GRACE
    )
    for i in range(5):
        sidecar.add(f"Standing fact number {i}", scope=SCOPE)
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=1)
    sidecar.turn("s", "staging", scope=SCOPE)
    key = (Tier.MEMORY, SCOPE.agent_id)
    held = sidecar.sidecar.engine.inside().partitions.cached(key)
    assert isinstance(held, CompactPartition)
    wait_past(clock, brief)

    added = sidecar.add("The staging cluster is back", scope=SCOPE)
    assert added.usage.entry_count == 6
    assert [m for _, m in events(sidecar, "expire")] == [brief.memory.id]
    written = sidecar.sidecar.engine.inside().partitions.cached(key)
    assert isinstance(written, CompactPartition)
    assert written.storage is held.storage
    assert written.count == 6
    turn = sidecar.turn("s", "staging", scope=SCOPE)
    assert added.memory.id in turn.system_block_memory_ids
    assert brief.memory.id not in turn.system_block_memory_ids
    # Nothing was loaded again for it.
    now_held = sidecar.sidecar.engine.inside().partitions.cached(key)
    assert isinstance(now_held, CompactPartition)
    assert now_held.storage is held.storage
    assert now_held.generation > held.generation


@pytest.mark.parametrize("replay", [False, True], ids=["identical", "idempotent_replay"])
def test_an_add_storing_nothing_new_removes_expired_entries_without_repeating_one(
    clock: WallClock, make_sidecar: MakeSidecar, replay: bool
) -> None:
    sidecar = make_sidecar(
        "defaults: {memory_char_limit: 0}", compact_tier_entries=4, **NO_SWEEP, **NO_GRACE
    )
    for i in range(5):
        sidecar.add(f"Standing fact number {i}", scope=SCOPE)
    key_of_first = "add-standing-0" if replay else ""
    existing = sidecar.add("The repo uses uv", scope=SCOPE, idempotency_key=key_of_first)
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=1)
    sidecar.turn("s", "staging", scope=SCOPE)
    key = (Tier.MEMORY, SCOPE.agent_id)
    held = sidecar.sidecar.engine.inside().partitions.cached(key)
    assert isinstance(held, CompactPartition)
    wait_past(clock, brief)

    # Stores nothing new, but removes the expired entry first (the
    # generation advances for that removal alone).
    again = sidecar.add("The repo uses uv", scope=SCOPE, idempotency_key=key_of_first)
    assert not again.created
    assert again.memory.id == existing.memory.id
    assert [m for _, m in events(sidecar, "expire")] == [brief.memory.id]
    cached = sidecar.sidecar.engine.inside().partitions.cached(key)
    assert isinstance(cached, CompactPartition)
    assert cached.count == 6
    found = sidecar.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=SCOPE, query="repo uses uv"), timeout=CALL_SECONDS
    )
    assert [h.memory.id for h in found.hits].count(existing.memory.id) == 1
    turn = sidecar.turn("s2", "repo", scope=SCOPE)
    assert turn.system_block.count("The repo uses uv") == 1


def test_a_write_removes_at_most_a_batch_of_expired_entries(
    clock: WallClock, make_sidecar: MakeSidecar
) -> None:
    sidecar = make_sidecar(
        "defaults: {memory_char_limit: 400}", expiry_sweep_batch=3, **NO_SWEEP, **NO_GRACE
    )
    briefs = [
        sidecar.add(f"expiring note number {i:02d} here", scope=SCOPE, ttl_seconds=1)
        for i in range(10)
    ]
    wait_past(clock, briefs[-1])

    # The write removes three, in its own transaction; the seven left stay
    # invisible and weigh nothing in the budget it is checked against.
    added = sidecar.add("n" * 200, scope=SCOPE)
    assert added.created
    assert (added.usage.used_chars, added.usage.entry_count) == (200, 1)
    assert len(events(sidecar, "expire")) == 3
    assert row_count(sidecar) == 8
    assert contents(sidecar, SCOPE) == ["n" * 200]
    # A leftover expired entry is no twin of new content: it is stored anew.
    again = sidecar.add("expiring note number 09 here", scope=SCOPE)
    assert again.created
    assert again.memory.id not in {b.memory.id for b in briefs}
    assert len(events(sidecar, "expire")) == 6
    # Nor can one be edited while its row is still there.
    error = refused(
        sidecar.stub.UpdateMemory,
        pb.UpdateMemoryRequest(id=briefs[8].memory.id, scope=SCOPE, content="edited"),
        timeout=CALL_SECONDS,
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(error).reason == "EXPIRED"
    assert len(events(sidecar, "expire")) == 6
    assert sidecar.sidecar.engine.sweep_expired() == 4
    assert row_count(sidecar) == 2


def test_an_import_removes_expired_entries_first(tmp_path: Path) -> None:
    clock = WallClock()
    store = Store(str(tmp_path / "m.db"), clock=clock)
    store.open()
    try:
        scope, policy = Scope("coder"), TierPolicy(60)
        soon = to_micros(clock.now) + 1_000_000
        for text in ("User's shell is fish", "x" * 35):
            store.add(NewEntry(scope, Tier.MEMORY, text), policy, expires=Expires.at(soon))
        clock.now += timedelta(seconds=2)
        entries = [
            LegacyEntry("0b1c", "User's shell is fish", "environment", to_micros(clock.now)),
            LegacyEntry("1d2e", "Run tests with `just test`", "workflow", to_micros(clock.now)),
        ]

        # Neither is a duplicate of an expired entry, and those weigh nothing.
        report = archive.import_entries(store, scope, Tier.MEMORY, entries, policy)
        assert report.skipped == []
        assert [e.id for e in report.imported] == ["0b1c", "1d2e"]
        listed, _ = store.list_memories(scope, [Tier.MEMORY], "", include_expired=True)
        assert [m.id for m in listed] == ["0b1c", "1d2e"]
        assert store.usage(scope, [Tier.MEMORY])[Tier.MEMORY].entry_count == 2
        db = store.tables.db
        with db.connection_context():
            kinds = db.execute_sql("SELECT kind FROM memory_events").fetchall()
        assert [k for (k,) in kinds].count("expire") == 2
    finally:
        store.close()


# --- a wall clock stepped ahead, then back -------------------------------------
# The daemon's default grace (server.expiry_grace_seconds, 6 h): an expired
# entry is hidden at once but removed only once its expiry is that old.
HOUR = 3600


@pytest.mark.parametrize("refresh", ["on_write", "on_compaction"])
def test_a_clock_set_back_shows_an_expired_entry_again(
    clock: WallClock, make_sidecar: MakeSidecar, refresh: str
) -> None:
    sidecar = make_sidecar(f"defaults: {{snapshot_refresh: {refresh}}}", **NO_SWEEP)
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=HOUR)
    sidecar.add("The repo uses uv", scope=SCOPE)
    assert brief.memory.id in sidecar.turn("s", "staging", scope=SCOPE).system_block_memory_ids
    assert sidecar.turn("s", scope=SCOPE).cache_hit
    right = clock.now

    # Two hours ahead: hidden at once, everywhere; neither the sweep nor a
    # write to its tier removes it.
    clock.move(2 * HOUR)
    ahead = sidecar.turn("s", "staging", scope=SCOPE)
    assert "staging cluster" not in ahead.system_block + ahead.turn_context
    assert contents(sidecar, SCOPE) == ["The repo uses uv"]
    assert sidecar.sidecar.engine.sweep_expired() == 0
    sidecar.add("The repo pins Python 3.12", scope=SCOPE)
    assert row_count(sidecar) == 3
    assert events(sidecar, "expire") == []

    # Set back: it shows again, in the frozen block too (no write told
    # anyone: each cache compares its clock), in searches and lists.
    clock.now = right
    back = sidecar.turn("s", "staging", scope=SCOPE)
    assert not back.cache_hit
    assert brief.memory.id in back.system_block_memory_ids
    assert "pins Python" in back.system_block
    found = sidecar.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=SCOPE, query="staging cluster"), timeout=CALL_SECONDS
    )
    assert [h.memory.id for h in found.hits] == [brief.memory.id]
    assert "The staging cluster is down today" in contents(sidecar, SCOPE)
    assert sidecar.turn("s", scope=SCOPE).cache_hit

    # Past its expiry and the grace, the sweep removes it for good.
    clock.move(HOUR + 6 * HOUR + 1)
    assert sidecar.sidecar.engine.sweep_expired() == 1
    assert [m for _, m in events(sidecar, "expire")] == [brief.memory.id]
    clock.now = right
    # (A new session: under on_compaction "s" keeps its frozen block past
    # a removal, as past a delete.)
    again = sidecar.turn("s2", "staging", scope=SCOPE)
    assert brief.memory.id not in again.system_block_memory_ids
    assert "staging cluster" not in contents(sidecar, SCOPE, include_expired=True)


def test_a_compact_tier_shows_an_expired_entry_again_when_the_clock_is_set_back(
    clock: WallClock, make_sidecar: MakeSidecar
) -> None:
    sidecar = make_sidecar(
        "defaults: {snapshot_refresh: on_compaction, memory_char_limit: 0}",
        compact_tier_entries=4,
        **NO_SWEEP,
    )
    for i in range(5):
        sidecar.add(f"Standing fact number {i}", scope=SCOPE)
    brief = sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=HOUR)
    assert brief.memory.id in sidecar.turn("s", "staging", scope=SCOPE).system_block_memory_ids
    key = (Tier.MEMORY, SCOPE.agent_id)
    held = sidecar.sidecar.engine.inside().partitions.cached(key)
    assert isinstance(held, CompactPartition)
    right = clock.now

    clock.move(2 * HOUR)
    assert brief.memory.id not in sidecar.turn("s", "staging", scope=SCOPE).system_block_memory_ids
    assert sidecar.turn("s", scope=SCOPE).cache_hit
    clock.now = right
    back = sidecar.turn("s", "staging", scope=SCOPE)
    assert not back.cache_hit
    assert brief.memory.id in back.system_block_memory_ids
    # The same compact partition: its entries are read back by the clock.
    assert sidecar.sidecar.engine.inside().partitions.cached(key) is held


def test_an_entry_hidden_by_a_clock_ahead_frees_its_budget_and_returns_over_it(
    clock: WallClock, make_sidecar: MakeSidecar
) -> None:
    sidecar = make_sidecar("defaults: {memory_char_limit: 40}", **NO_SWEEP)
    sidecar.add("a" * 30, scope=SCOPE, ttl_seconds=HOUR)
    right = clock.now
    clock.move(2 * HOUR)
    # Hidden, it weighs nothing: the write fits.
    added = sidecar.add("b" * 30, scope=SCOPE)
    assert added.usage.used_chars == 30

    # Back, both count: the tier reads over its budget, as after a lowered
    # budget, and refuses growth until something is removed.
    clock.now = right
    usage = {u.tier: u for u in sidecar.list(scope=SCOPE).usage}[pb.TIER_MEMORY]
    assert (usage.used_chars, usage.entry_count) == (63, 2)
    error = refused(sidecar.add, "c", scope=SCOPE)
    assert error_info(error).reason == "TIER_BUDGET_EXCEEDED"
    sidecar.stub.DeleteMemory(
        pb.DeleteMemoryRequest(scope=SCOPE, id=added.memory.id), timeout=CALL_SECONDS
    )
    assert sidecar.add("c", scope=SCOPE).created


def test_forget_user_erases_an_entry_hidden_by_a_clock_ahead(
    clock: WallClock, make_sidecar: MakeSidecar
) -> None:
    sidecar = make_sidecar(**NO_SWEEP)
    user = pb.Scope(agent_id="coder", user_id="ada")
    sidecar.add("Ada is on call this week", scope=user, tier=pb.TIER_USER, ttl_seconds=HOUR)
    right = clock.now
    clock.move(2 * HOUR)
    sidecar.stub.ForgetUser(pb.ForgetUserRequest(user_id="ada"), timeout=CALL_SECONDS)
    clock.now = right
    assert contents(sidecar, user, include_expired=True) == []
    assert "on call" not in sidecar.turn("s", scope=user).system_block
