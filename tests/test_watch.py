"""WatchMemories: a scope's changes in generation order, resumable, live
across replicas and processes, with a bounded lag, a retention horizon and
a cap on streams.

Every test runs on both backends. A watcher reads its stream on a thread of
its own into a queue; waits are liveness bounds, never timing claims.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.api import server
from sidecar.core.memory import Memory, Scope, Tier
from sidecar.storage import archive
from sidecar.storage.archive import LegacyEntry
from sidecar.storage.writes import TierPolicy
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    MakeSidecar,
    Running,
    error_info,
    eventually,
    refused,
    spawn_daemon,
)

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
K = pb.MemoryEvent
# Budgets off: the slow-consumer test writes large entries.
UNLIMITED = "defaults:\n  memory_char_limit: 0\n  user_char_limit: 0\n"


class Watcher:
    """One WatchMemories stream, read on a thread into a queue."""

    def __init__(
        self,
        stub: pb_grpc.MemoryServiceStub,
        after: int = 0,
        *,
        scope: pb.Scope = SCOPE,
        tier: pb.Tier = pb.TIER_UNSPECIFIED,
        read: bool = True,
        after_tier: pb.Tier = pb.TIER_UNSPECIFIED,
        after_id: str = "",
    ) -> None:
        self.call = stub.WatchMemories(
            pb.WatchMemoriesRequest(
                scope=scope,
                tier=tier,
                after_generation=after,
                after_tier=after_tier,
                after_id=after_id,
            )
        )
        self.queue: queue.Queue[pb.MemoryEvent | grpc.RpcError] = queue.Queue()
        # Cleared: the stream is not read past its first message until
        # `resume_reading`.
        self._reading = threading.Event()
        if read:
            self._reading.set()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        # The first message (a SYNC, from now on) is always read: the test
        # then knows where the stream starts before it writes.
        try:
            for response in self.call:
                self.queue.put(response.event)
                self._reading.wait()
        except grpc.RpcError as error:
            self.queue.put(error)

    def resume_reading(self) -> None:
        self._reading.set()

    def next(self) -> pb.MemoryEvent:
        item = self.queue.get(timeout=WAIT_SECONDS)
        if isinstance(item, grpc.RpcError):
            raise item
        return item

    def take(self, count: int) -> list[pb.MemoryEvent]:
        return [self.next() for _ in range(count)]

    def drain(self) -> tuple[list[pb.MemoryEvent], grpc.RpcError]:
        """The events still to come, and the status the stream ends with."""
        events: list[pb.MemoryEvent] = []
        while True:
            item = self.queue.get(timeout=WAIT_SECONDS)
            if isinstance(item, grpc.RpcError):
                return events, item
            events.append(item)

    def close(self) -> None:
        self.call.cancel()
        self._reading.set()
        self._thread.join(timeout=WAIT_SECONDS)


@pytest.fixture
def watchers() -> Any:
    opened: list[Watcher] = []

    def watch(stub: pb_grpc.MemoryServiceStub, after: int = 0, **kwargs: Any) -> Watcher:
        watcher = Watcher(stub, after, **kwargs)
        opened.append(watcher)
        return watcher

    yield watch
    for watcher in opened:
        watcher.close()


Watch = Callable[..., Watcher]


def synced(watch: Watch, stub: pb_grpc.MemoryServiceStub, **kwargs: Any) -> tuple[Watcher, int]:
    """A watch from now on, and the generation its SYNC names."""
    watcher = watch(stub, **kwargs)
    first = watcher.next()
    assert first.kind == K.KIND_SYNC
    return watcher, first.generation


def write_some(running: Running, tag: str = "") -> list[tuple[int, str]]:
    """Adds, an update and a delete over both tiers: the (kind, id) each
    logs, in order."""
    note = running.add(f"The repo uses uv{tag}", scope=SCOPE).memory
    profile = running.add(f"Ada prefers short answers{tag}", scope=SCOPE, tier=pb.TIER_USER).memory
    running.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=SCOPE, id=note.id, content=f"The repo uses uv and ruff{tag}")
    )
    running.stub.DeleteMemory(pb.DeleteMemoryRequest(scope=SCOPE, id=profile.id))
    return [
        (K.KIND_ADD, note.id),
        (K.KIND_ADD, profile.id),
        (K.KIND_UPDATE, note.id),
        (K.KIND_DELETE, profile.id),
    ]


def test_changes_arrive_in_generation_order_with_what_they_changed(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar()
    running.add("written before the watch", scope=SCOPE)
    # Another scope's writes are not this watch's business.
    other = pb.Scope(agent_id="reviewer", user_id="bob")
    watcher, synced_at = synced(watchers, running.stub)
    running.add("someone else's note", scope=other)
    expected = write_some(running)
    events = watcher.take(len(expected))
    assert [(e.kind, e.id) for e in events] == expected
    generations = [e.generation for e in events]
    assert synced_at < generations[0]
    assert generations == sorted(set(generations))
    # An entry that changed again since is sent as it is now: the first
    # add may carry the update's content, which the update event repeats.
    assert events[0].memory.content in ("The repo uses uv", "The repo uses uv and ruff")
    assert events[0].tier == pb.TIER_MEMORY
    assert events[1].tier == pb.TIER_USER
    assert events[2].memory.content == "The repo uses uv and ruff"
    assert not events[3].HasField("memory")
    assert watcher.queue.empty()


def test_one_tier_only(make_sidecar: MakeSidecar, watchers: Watch) -> None:
    running = make_sidecar()
    watcher, _ = synced(watchers, running.stub, tier=pb.TIER_USER)
    written = write_some(running)
    expected = [written[1], written[3]]  # the profile's add and delete
    assert [(e.kind, e.id) for e in watcher.take(2)] == expected


def test_a_resume_misses_nothing_and_repeats_nothing(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar()
    # A database never written has generation 0, which means "from now on".
    running.add("written before the watch", scope=SCOPE)
    first, synced_at = synced(watchers, running.stub)
    assert synced_at > 0
    expected = write_some(running)
    received = first.take(2)
    first.close()
    # Written while nobody watched.
    expected += write_some(running, " (again)")
    again = watchers(running.stub, received[-1].generation)
    rest = again.take(len(expected) - 2)
    assert [(e.kind, e.id) for e in received + rest] == expected
    # From the SYNC's generation: everything since the first watch began.
    whole = watchers(running.stub, synced_at).take(len(expected))
    assert [(e.kind, e.id) for e in whole] == expected
    assert [e.generation for e in whole] == [e.generation for e in received + rest]


def test_from_now_sends_sync_then_only_what_follows(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar()
    write_some(running)
    watcher, synced_at = synced(watchers, running.stub)
    added = running.add("The deploy is on Fridays", scope=SCOPE)
    event = watcher.next()
    assert (event.kind, event.id) == (K.KIND_ADD, added.memory.id)
    assert event.generation > synced_at


def test_a_watcher_on_one_replica_sees_writes_made_on_another(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    a, b = make_sidecar(), make_sidecar()
    watcher, _ = synced(watchers, b.stub)
    expected = write_some(a)
    assert [(e.kind, e.id) for e in watcher.take(len(expected))] == expected


def test_a_watcher_sees_writes_another_process_made(
    make_sidecar: MakeSidecar, databases: Callable[[str], str], watchers: Watch
) -> None:
    db = databases("shared.db")
    watching = make_sidecar(db=db)
    watcher, _ = synced(watchers, watching.stub)
    writer = spawn_daemon("--db", db, "--listen", "127.0.0.1:0")
    try:
        channel = grpc.insecure_channel(writer.api)
        stub = pb_grpc.MemoryServiceStub(channel)
        added = stub.AddMemory(pb.AddMemoryRequest(scope=SCOPE, content="uv"), timeout=CALL_SECONDS)
        stub.DeleteMemory(
            pb.DeleteMemoryRequest(scope=SCOPE, id=added.memory.id), timeout=CALL_SECONDS
        )
        events = watcher.take(2)
        assert [(e.kind, e.id) for e in events] == [
            (K.KIND_ADD, added.memory.id),
            (K.KIND_DELETE, added.memory.id),
        ]
        channel.close()
    finally:
        writer.close()


def test_a_slow_consumer_is_ended_with_a_generation_that_resumes(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar(UNLIMITED, watch_buffer_events=5)
    # A stream nobody reads: once its flow-control window is full (64 KiB,
    # kept at that without BDP probing; these entries are 8,000 characters
    # each) the server's sends block, and the writes below pile up.
    channel = grpc.insecure_channel(running.addresses.api, options=[("grpc.http2.bdp_probe", 0)])
    watcher = watchers(pb_grpc.MemoryServiceStub(channel), read=False)
    # The stream has started: the writes below come after its SYNC.
    assert watcher.next().kind == K.KIND_SYNC
    ids = [running.add(f"{n} " + "x" * 8000, scope=SCOPE).memory.id for n in range(40)]
    watcher.resume_reading()
    events, error = watcher.drain()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    info = error_info(error)
    assert info.reason == "WATCH_TOO_SLOW"
    resume = int(info.metadata["resume_generation"])
    # The last generation it received, whole.
    assert resume == events[-1].generation
    received = [e.id for e in events if e.kind != K.KIND_SYNC]
    assert len(received) < len(ids)
    rest = watchers(running.stub, resume).take(len(ids) - len(received))
    assert received + [e.id for e in rest] == ids
    channel.close()


def test_a_resume_from_before_the_horizon_is_refused(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar()
    old = running.add("logged long ago", scope=SCOPE).memory
    first = watchers(running.stub, 0)
    synced_at = first.next().generation
    running.add("logged since", scope=SCOPE)
    # Eight days on, the week's retention prunes what was logged before.
    retention = running.sidecar.engine.inside().watches.retention
    assert retention.run_once(datetime.now(UTC) + timedelta(days=8)) == 2
    error = refused(lambda: watchers(running.stub, 1).next())
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(error)
    assert info.reason == "WATCH_GENERATION_PRUNED"
    horizon = int(info.metadata["oldest_resumable_generation"])
    assert horizon > synced_at
    assert "export" in (error.details() or "").lower()
    # From the horizon on, the stream goes on as usual.
    later = running.add("logged after the pruning", scope=SCOPE).memory
    event = watchers(running.stub, horizon).next()
    assert (event.kind, event.id) == (K.KIND_ADD, later.id)
    assert old.id != later.id


def test_an_idle_watch_keeps_a_resume_point_past_other_scopes_pruned_events(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    # The horizon follows the whole database: a scope idle while others are
    # written must not find its own last generation below it.
    running = make_sidecar(watch_bookmark_seconds=0.2)
    watcher, synced_at = synced(watchers, running.stub)
    other = pb.Scope(agent_id="reviewer", user_id="bob")
    for n in range(3):
        running.add(f"another scope's note {n}", scope=other)
    newest = running.sidecar.engine.inside().watches.log.newest()
    # The idle watch's bookmark: a SYNC past the other scope's generations.
    bookmark = watcher.next()
    while bookmark.generation < newest:
        bookmark = watcher.next()
    assert bookmark.kind == K.KIND_SYNC
    assert bookmark.generation > synced_at
    # Eight days on, the other scope's events are pruned.
    retention = running.sidecar.engine.inside().watches.retention
    assert retention.run_once(datetime.now(UTC) + timedelta(days=8)) == 3
    mine = running.add("this scope's next note", scope=SCOPE).memory
    event = watcher.next()
    while event.kind == K.KIND_SYNC:
        event = watcher.next()
    assert (event.kind, event.id) == (K.KIND_ADD, mine.id)
    # A client that reconnects with the bookmark resumes too.
    event = watchers(running.stub, bookmark.generation).next()
    assert (event.kind, event.id) == (K.KIND_ADD, mine.id)


def test_a_resume_from_another_databases_future_is_refused(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar()
    running.add("one entry", scope=SCOPE)
    error = refused(lambda: watchers(running.stub, 10**12).next())
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(error).reason == "WATCH_GENERATION_AHEAD"
    error = refused(lambda: watchers(running.stub, -1).next())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_watches_beyond_the_cap_are_refused_and_a_cancelled_one_frees_its_slot(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar(max_watches=1)
    first, _ = synced(watchers, running.stub)
    error = refused(lambda: watchers(running.stub).next())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(error)
    assert (info.reason, info.metadata["max_watches"]) == ("WATCHES_EXHAUSTED", "1")
    registry = running.sidecar.metrics.registry
    assert registry.get_sample_value("memory_watches_open") == 1
    first.close()
    eventually(
        lambda: not registry.get_sample_value("memory_watches_open"),
        "the cancelled watch lets go of its slot",
        within=WAIT_SECONDS,
    )
    synced(watchers, running.stub)


def test_the_servers_stop_ends_its_watches_with_where_to_resume(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar()
    running.add("one entry", scope=SCOPE)
    watcher, synced_at = synced(watchers, running.stub)
    # A grace long enough that only the watches' own ending lets it return.
    stopping = threading.Thread(target=running.sidecar.stop, kwargs={"grace": 600})
    stopping.start()
    events, error = watcher.drain()
    assert events == []
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    info = error_info(error)
    assert (info.reason, info.metadata["resume_generation"]) == ("SERVER_STOPPING", str(synced_at))
    stopping.join(WAIT_SECONDS)
    assert not stopping.is_alive()


def test_the_sweeps_and_erasures_events_reach_watchers_through_the_feed(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar()
    note = running.add("expires soon", scope=SCOPE).memory
    watcher, _ = synced(watchers, running.stub)
    # As the expiry sweep and an erasure log theirs: straight through the
    # store, past the engine, so only the change feed wakes the watch.
    store = running.store
    for owner, tier, kind, memory_id in (
        ("coder", Tier.MEMORY, "expire", note.id),
        ("ada", Tier.USER, "erase", ""),
    ):
        with store._db.connection_context(), store._backend.write_transaction():
            state = store._backend.lock_partition(owner, tier.value)
            generation = store._backend.advance(
                owner, tier.value, state.content_chars, state.entry_count
            )
            store.tables.logged(owner, tier, generation, kind, memory_id, 0)
    assert [(e.kind, e.tier, e.id, e.HasField("memory")) for e in watcher.take(2)] == [
        (K.KIND_EXPIRE, pb.TIER_MEMORY, note.id, False),
        (K.KIND_ERASE, pb.TIER_USER, "", False),
    ]


def test_a_resume_inside_a_generation_sends_the_rest_of_it(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar()
    ids = sorted(running.add(f"expires soon {n}", scope=SCOPE).memory.id for n in range(3))
    # As an expiry sweep's batch: three events under one generation.
    store = running.store
    with store._db.connection_context(), store._backend.write_transaction():
        state = store._backend.lock_partition("coder", Tier.MEMORY.value)
        generation = store._backend.advance(
            "coder", Tier.MEMORY.value, state.content_chars, state.entry_count
        )
        for memory_id in ids:
            store.tables.logged("coder", Tier.MEMORY, generation, "expire", memory_id, 0)
    later = running.add("written after the batch", scope=SCOPE).memory
    # A stream cut after the batch's first event resumes with the rest.
    watcher = watchers(running.stub, generation, after_tier=pb.TIER_MEMORY, after_id=ids[0])
    assert [(e.kind, e.generation, e.id) for e in watcher.take(3)] == [
        (K.KIND_EXPIRE, generation, ids[1]),
        (K.KIND_EXPIRE, generation, ids[2]),
        (K.KIND_ADD, generation + 1, later.id),
    ]
    for bad in ({"after_tier": pb.TIER_MEMORY}, {"after_id": ids[0]}):
        error = refused(lambda bad=bad: watchers(running.stub, generation, **bad).next())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(error).reason == "RESUME_POINT_INVALID"


def test_restored_and_imported_entries_reach_watchers(
    make_sidecar: MakeSidecar, watchers: Watch
) -> None:
    running = make_sidecar()
    watcher, _ = synced(watchers, running.stub)
    # `memory-sidecar import` and import-cagent, run beside the daemon:
    # straight through the store, so only the change feed wakes the watch.
    restored = Memory(
        id="restored-1",
        tier=Tier.MEMORY,
        content="restored from a dump",
        category="note",
        confidence=1.0,
        created_at=datetime.now(UTC),
        updated_at=datetime.now(UTC),
    )
    assert archive.restore(running.store, [("coder", restored)]) == (1, [])
    legacy = [LegacyEntry(f"cagent-{n}", f"imported from cagent {n}", "", 0) for n in range(2)]
    scope = Scope(agent_id="coder", user_id="ada")
    report = archive.import_entries(running.store, scope, Tier.USER, legacy, TierPolicy(0))
    assert len(report.imported) == 2
    events = watcher.take(3)
    assert [(e.kind, e.tier, e.id) for e in events] == [
        (K.KIND_ADD, pb.TIER_MEMORY, "restored-1"),
        (K.KIND_ADD, pb.TIER_USER, "cagent-0"),
        (K.KIND_ADD, pb.TIER_USER, "cagent-1"),
    ]
    assert events[0].memory.content == "restored from a dump"


class FreezingProxy:
    """A TCP proxy that, once frozen, forwards nothing more either way: a
    client that vanished without closing its connection."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.frozen = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            # Frozen: what arrives is swallowed, not answered, not closed.
            if not self.frozen.is_set():
                with contextlib.suppress(OSError):
                    sink.sendall(data)

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def test_a_vanished_clients_watch_ends_and_frees_its_slot(
    make_sidecar: MakeSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The daemon's keepalive, shortened: it pings the silent connection and
    # closes it when no answer comes (60 s and 20 s by default).
    monkeypatch.setattr(server, "KEEPALIVE_SECONDS", 0.5)
    monkeypatch.setattr(server, "KEEPALIVE_TIMEOUT_SECONDS", 0.5)
    running = make_sidecar()
    proxy = FreezingProxy(running.addresses.api)
    channel = grpc.insecure_channel(proxy.address)
    try:
        watcher = Watcher(pb_grpc.MemoryServiceStub(channel))
        assert watcher.next().kind == K.KIND_SYNC
        registry = running.sidecar.metrics.registry
        assert registry.get_sample_value("memory_watches_open") == 1
        proxy.frozen.set()
        # A liveness bound: the watch ends on its own, its slot free.
        eventually(
            lambda: not registry.get_sample_value("memory_watches_open"),
            "the vanished client's watch ends",
            within=WAIT_SECONDS,
            pause=0.05,
        )
    finally:
        channel.close()
        proxy.close()
