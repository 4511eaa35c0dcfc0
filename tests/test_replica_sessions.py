"""Sessions and read-your-writes across replicas: two daemons on one database.

Every test runs against both backends (two daemons on one SQLite file, each
with its poller; two on one PostgreSQL database, each with its listener).

- NotifyCompaction and EndSession sent to one replica reach the session
  where another replica holds it.
- A write's generation, passed as min_generation to a read on the other
  replica, makes that read see the write even while the other replica's
  feed lags; without it the same read is stale; and when the feed cannot
  catch up within the deadline the read is refused (REPLICA_BEHIND), never
  answered stale.

The lag is made deterministic by stalling the reading replica's feed: its
delivery of other processes' writes waits on a gate the test opens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    MakeSidecar,
    Running,
    error_info,
    eventually,
    refused,
)

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
# A feed that stays verified for the whole test while stalled (SQLite: ten
# polls; PostgreSQL: three heartbeats), so the stalled replica trusts its
# caches and a read without a token is stale.
LAGGING = "server: {change_poll_ms: 2000, change_heartbeat_ms: 10000}\n"
FROZEN = "defaults: {snapshot_refresh: on_compaction}\n"


def found(running: Running, text: str, **fields: Any) -> bool:
    hits = running.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=SCOPE, query=text, **fields), timeout=CALL_SECONDS
    )
    return any(text in hit.memory.content for hit in hits.hits)


class Gate:
    """Holds a replica's change feed: news of other processes' writes waits
    in the feed's thread until the gate opens."""

    def __init__(self, running: Running) -> None:
        feed = running.sidecar.engine.inside().feed
        assert feed is not None
        self._feed = feed
        self._deliver = feed._on_change
        self.open = threading.Event()

        def stalled(*news: Any) -> None:
            self.open.wait()
            self._deliver(*news)

        feed._on_change = stalled

    def close(self) -> None:
        self.open.set()
        self._feed._on_change = self._deliver


@pytest.fixture
def gates() -> Iterator[Callable[[Running], Gate]]:
    made: list[Gate] = []

    def gate(running: Running) -> Gate:
        made.append(Gate(running))
        return made[-1]

    yield gate
    for g in made:
        g.close()


# --- session events ------------------------------------------------------------


def test_a_compaction_sent_to_one_replica_rebuilds_the_session_held_on_another(
    make_sidecar: MakeSidecar,
) -> None:
    a, b = make_sidecar(FROZEN), make_sidecar(FROZEN)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: found(b, "uses uv"), "B has A's first write")
    held = b.turn("s", scope=SCOPE)
    assert "uses uv" in held.system_block
    a.add("Deploys go through ArgoCD", scope=SCOPE)
    eventually(lambda: found(b, "ArgoCD"), "B has A's second write")
    # Frozen until compaction: B's session keeps its block.
    assert "ArgoCD" not in b.turn("s", scope=SCOPE).system_block

    # The compaction goes to A, which does not hold the session.
    answer = a.stub.NotifyCompaction(pb.NotifyCompactionRequest(session_id="s", scope=SCOPE))
    assert not answer.invalidated  # A held nothing to invalidate
    assert answer.broadcast
    eventually(
        lambda: "ArgoCD" in b.turn("s", scope=SCOPE).system_block,
        "B's session rebuilds after a compaction sent to A",
    )


def test_an_end_of_session_sent_to_one_replica_drops_the_session_held_on_another(
    make_sidecar: MakeSidecar,
) -> None:
    a, b = make_sidecar(FROZEN), make_sidecar(FROZEN)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: found(b, "uses uv"), "B has A's write")
    b.turn("s", scope=SCOPE)
    b.turn("other", scope=SCOPE)
    assert b.sidecar.engine.stats().sessions == 2

    # Another agent's session of the same id first: B holds none, so it
    # drops nothing (events arrive in the order they were sent).
    a.stub.EndSession(pb.EndSessionRequest(session_id="other", scope=pb.Scope(agent_id="x")))
    answer = a.stub.EndSession(pb.EndSessionRequest(session_id="s", scope=SCOPE))
    assert not answer.dropped
    assert answer.broadcast
    eventually(lambda: b.sidecar.engine.stats().sessions == 1, "B drops the ended session")
    assert b.turn("other", scope=SCOPE).cache_hit
    assert not b.turn("s", scope=SCOPE).cache_hit


def test_a_replica_whose_feed_is_down_serves_a_frozen_block_only_while_current(
    make_sidecar: MakeSidecar, gates: Callable[[Running], Gate]
) -> None:
    """A compaction sent to another replica may go unheard while the feed is
    down: the frozen block is then trusted no more than the caches are."""
    a, b = make_sidecar(FROZEN), make_sidecar(FROZEN)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: found(b, "uses uv"), "B has A's write")
    assert not b.turn("s", scope=SCOPE).cache_hit
    assert b.turn("s", scope=SCOPE).cache_hit

    gates(b)  # B's feed stalls: unverified after a few missed cycles
    a.add("Deploys go through ArgoCD", scope=SCOPE)
    a.stub.NotifyCompaction(pb.NotifyCompactionRequest(session_id="s", scope=SCOPE))
    feed = b.sidecar.engine.inside().feed
    assert feed is not None
    eventually(lambda: not feed.verified, "B's feed turns unverified")
    assert "ArgoCD" in b.turn("s", scope=SCOPE).system_block


def test_a_malformed_session_event_is_ignored_and_the_feed_goes_on(
    make_sidecar: MakeSidecar,
) -> None:
    a, b = make_sidecar(), make_sidecar()
    feed = a.sidecar.engine.inside().feed
    assert feed is not None
    # Sent the way a session event is (SQLite: a row; PostgreSQL: a NOTIFY).
    for payload in ("not json", '["session"]', '["session", "x", "end", 1]', "{}"):
        feed._send(payload)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: found(b, "uses uv"), "B still hears A's writes")
    # A second write, delivered by a later cycle than the one that read the
    # bad events: by then a feed that choked on them has counted a failure.
    a.add("Deploys go through ArgoCD", scope=SCOPE)
    eventually(lambda: found(b, "ArgoCD"), "B still hears A's writes")
    b_feed = b.sidecar.engine.inside().feed
    assert b_feed is not None
    assert b_feed.failures == 0


# --- read-your-writes ------------------------------------------------------------


def test_a_read_with_the_writes_generation_sees_it_on_a_lagging_replica(
    make_sidecar: MakeSidecar, gates: Callable[[Running], Gate]
) -> None:
    a, b = make_sidecar(), make_sidecar(LAGGING)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: found(b, "uses uv"), "B has A's first write")
    assert "uses uv" in b.turn("s", scope=SCOPE).system_block

    gate = gates(b)
    ack = a.add("Deploys go through ArgoCD", scope=SCOPE)
    assert ack.generation > 0
    # Without the token B answers from its caches: stale.
    assert not found(b, "ArgoCD")
    assert "ArgoCD" not in b.turn("s", scope=SCOPE).system_block

    # With it, B waits until its feed has applied the write (the gate opens
    # while the read waits), then answers.
    threading.Timer(0.3, gate.open.set).start()
    assert found(b, "ArgoCD", min_generation=ack.generation)
    turn = b.turn("s", scope=SCOPE, min_generation=ack.generation)
    assert "ArgoCD" in turn.system_block
    listed = b.list(scope=SCOPE, min_generation=ack.generation)
    assert any("ArgoCD" in m.content for m in listed.memories)

    # Updates and deletes answer their generation too.
    changed = a.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=SCOPE, id=ack.memory.id, content="Deploys go through Flux")
    )
    assert changed.generation > ack.generation
    assert found(b, "Flux", min_generation=changed.generation)
    gone = a.stub.DeleteMemory(pb.DeleteMemoryRequest(scope=SCOPE, id=ack.memory.id))
    assert gone.generation > changed.generation
    assert not found(b, "Flux", min_generation=gone.generation)


def test_a_tool_calls_generation_makes_a_lagging_replica_show_its_write(
    make_sidecar: MakeSidecar, gates: Callable[[Running], Gate]
) -> None:
    """CallTool answers its writes' generation as AddMemory does: a model's
    own write, read on another replica with it, is there."""
    a, b = make_sidecar(), make_sidecar(LAGGING)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: found(b, "uses uv"), "B has A's first write")
    gate = gates(b)
    request = pb.CallToolRequest(
        scope=SCOPE,
        session_id="s",
        name="memory",
        arguments_json='{"action": "add", "content": "Deploys go through ArgoCD"}',
    )
    ack = a.stub.CallTool(request, timeout=CALL_SECONDS)
    assert not ack.is_error
    assert ack.generation > 0
    assert not found(b, "ArgoCD")
    threading.Timer(0.3, gate.open.set).start()
    assert found(b, "ArgoCD", min_generation=ack.generation)


def test_a_token_of_this_replicas_own_write_covers_a_write_acknowledged_before_it_elsewhere(
    make_sidecar: MakeSidecar, gates: Callable[[Running], Gate]
) -> None:
    """min_generation promises every write acknowledged before the read, not
    only the one that answered the token: a client writes on A, then on B,
    then reads on B with B's (larger) generation."""
    a, b = make_sidecar(), make_sidecar(LAGGING)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: found(b, "uses uv"), "B has A's first write")

    gate = gates(b)
    first = a.add("Deploys go through ArgoCD", scope=SCOPE)
    other = pb.Scope(agent_id="reviewer", user_id="bob")
    second = b.add("Bob prefers tabs", scope=other)
    assert second.generation > first.generation
    assert not found(b, "ArgoCD")  # B has not heard of A's write
    threading.Timer(0.3, gate.open.set).start()
    assert found(b, "ArgoCD", min_generation=second.generation)


def test_a_replica_that_cannot_catch_up_in_time_refuses_instead_of_answering_stale(
    make_sidecar: MakeSidecar, gates: Callable[[Running], Gate]
) -> None:
    a, b = make_sidecar(), make_sidecar(LAGGING)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: found(b, "uses uv"), "B has A's first write")
    b.turn("s", scope=SCOPE)
    gates(b)  # never opened
    ack = a.add("Deploys go through ArgoCD", scope=SCOPE)

    for call in (
        lambda: b.stub.SearchMemories(
            pb.SearchMemoriesRequest(scope=SCOPE, query="ArgoCD", min_generation=ack.generation),
            timeout=1,
        ),
        lambda: b.stub.InjectForTurn(
            pb.InjectForTurnRequest(scope=SCOPE, session_id="s", min_generation=ack.generation),
            timeout=1,
        ),
    ):
        error = refused(call)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        info = error_info(error)
        assert info.reason == "REPLICA_BEHIND"
        assert int(info.metadata["min_generation"]) == ack.generation
        assert int(info.metadata["applied_generation"]) < ack.generation
    # min_generation 0 is today's behaviour: answered at once, from the caches.
    assert not found(b, "ArgoCD", min_generation=0)


def test_a_generation_no_write_has_reached_is_waited_for_until_the_deadline(
    make_sidecar: MakeSidecar,
) -> None:
    a, b = make_sidecar(), make_sidecar()
    ack = a.add("The repo uses uv", scope=SCOPE)
    assert found(b, "uses uv", min_generation=ack.generation)
    error = refused(
        b.stub.SearchMemories,
        pb.SearchMemoriesRequest(scope=SCOPE, query="uv", min_generation=ack.generation + 1000),
        timeout=0.5,
    )
    assert error_info(error).reason == "REPLICA_BEHIND"


def test_sqlite_poller_delivers_a_write_before_the_compaction_committed_after_it(
    tmp_path: Path,
) -> None:
    """SQLite's poller reads state rows and session events in one snapshot:
    a write and then a compaction event committing between its two reads
    must not have the event applied before the write (a turn in between
    would freeze a block without it). Driven by hand: the two commits land
    just as the poller starts reading the events."""
    import sqlite3

    from prometheus_client import CollectorRegistry

    from sidecar.config import settings as config_mod
    from sidecar.core.metrics import Metrics
    from sidecar.ops import daemon
    from sidecar.storage._backend import SESSION_EVENTS_TABLE, STATE_TABLE
    from sidecar.storage._sqlite_poller import DataVersionPoller
    from sidecar.storage.changes import session_payload

    path = str(tmp_path / "memory.db")
    cfg = config_mod.load(None, environ={}, flags={"db": path, "listen": "127.0.0.1:0"})
    store = daemon.open_store(cfg, Metrics(CollectorRegistry()))
    store.open()
    store.close()

    news: list[str] = []
    poller = DataVersionPoller(
        path,
        lambda owner, tier, generation, erased: news.append(f"write {generation}"),
        interval=1.0,
        busy_timeout_ms=5000,
        publish=lambda payload: None,
        on_session=lambda kind, *scope: news.append(kind),
    )
    poller.run_once()  # first contact: the watermarks
    assert poller._connection is not None

    other = sqlite3.connect(path, isolation_level=None)
    fired: list[str] = []

    def between(sql: str) -> None:
        if f"FROM {SESSION_EVENTS_TABLE} WHERE" in sql and not fired:
            fired.append(sql)
            # Another replica's write, then its NotifyCompaction.
            other.execute(
                f"INSERT INTO {STATE_TABLE} (owner, tier, content_chars, entry_count, generation)"
                " VALUES ('ada', 'memory', 1, 1, 1000)"
            )
            other.execute(
                f"INSERT INTO {SESSION_EVENTS_TABLE} (payload, at) VALUES (?, 0)",
                (session_payload("elsewhere", "compaction", "coder", "ada", "s"),),
            )

    poller._connection.set_trace_callback(between)
    # A first write, for the poller to notice a commit and read.
    other.execute(
        f"INSERT INTO {STATE_TABLE} (owner, tier, content_chars, entry_count, generation)"
        " VALUES ('bob', 'memory', 1, 1, 999)"
    )
    try:
        poller.run_once()  # reads the first write; the others commit meanwhile
        poller.run_once()
    finally:
        poller.stop()
        other.close()
    assert fired
    assert news == ["write 999", "write 1000", "compaction"]


def test_a_read_without_a_deadline_waits_at_most_the_configured_bound(
    make_sidecar: MakeSidecar,
) -> None:
    """Without a gRPC deadline a min_generation no write has reached ends in
    REPLICA_BEHIND after server.min_generation_wait_seconds, instead of
    holding a worker thread for ever (issue 34)."""
    a = make_sidecar()
    b = make_sidecar("server: {min_generation_wait_seconds: 0.2}\n")
    ack = a.add("The repo uses uv", scope=SCOPE)
    ahead = ack.generation + 1000
    reads: list[Callable[[], Any]] = [
        lambda: b.stub.SearchMemories(
            pb.SearchMemoriesRequest(scope=SCOPE, query="uv", min_generation=ahead)
        ),
        lambda: b.stub.GetMemories(pb.GetMemoriesRequest(scope=SCOPE, min_generation=ahead)),
        lambda: b.stub.InjectForTurn(
            pb.InjectForTurnRequest(scope=SCOPE, session_id="s", min_generation=ahead)
        ),
    ]
    # No deadline on the calls themselves; the outer bound only makes a
    # regression fail instead of hanging the suite.
    answered: list[grpc.RpcError | None] = []

    def call() -> None:
        for read in reads:
            try:
                read()
                answered.append(None)
            except grpc.RpcError as error:
                answered.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(WAIT_SECONDS)
    assert len(answered) == len(reads), "a read without a deadline never answered"
    for error in answered:
        assert error is not None
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(error).reason == "REPLICA_BEHIND"
