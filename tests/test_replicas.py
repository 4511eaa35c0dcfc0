"""Several daemons on one database: what one writes, the others serve.

Every test runs against both backends: two daemons on one SQLite file (the
change poller), and two daemons on one PostgreSQL database (LISTEN/NOTIFY).
A write is acknowledged by one daemon; the other hears of it through its
change feed, asynchronously, so the tests wait (boundedly) for the news to
arrive and then check that it is never lost or undone. How fast the news
travels is measured by `make bench`, not here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import SEPARATOR
from tests.conftest import (
    CALL_SECONDS,
    MakeSidecar,
    Running,
    eventually,
    refused,
    run_sidecar,
    spawn_daemon,
)

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")


def pair(make_sidecar: MakeSidecar, yaml_text: str = "") -> tuple[Running, Running]:
    return make_sidecar(yaml_text), make_sidecar(yaml_text)


def shown(running: Running, session: str, text: str) -> bool:
    turn = running.turn(session, "anything", scope=SCOPE)
    return text in turn.system_block + turn.turn_context


def test_a_write_on_one_shows_on_the_others_next_turns(make_sidecar: MakeSidecar) -> None:
    a, b = pair(make_sidecar)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: shown(b, "s", "uses uv"), "B shows A's first write")
    cached = b.turn("s", scope=SCOPE)
    assert cached.cache_hit

    a.add("Deploys go through ArgoCD", scope=SCOPE)
    eventually(lambda: "ArgoCD" in b.turn("s", scope=SCOPE).system_block, "B shows A's write")
    # Once B has it, its cached turns serve it without touching the database.
    b.turn("s", scope=SCOPE)
    before = b.db_queries()
    for _ in range(5):
        turn = b.turn("s", scope=SCOPE)
        assert turn.cache_hit
        assert "ArgoCD" in turn.system_block
    assert b.db_queries() == before
    # Both daemons render the same bytes for the same data.
    assert b.turn("s", scope=SCOPE).system_block == a.turn("s", scope=SCOPE).system_block


def test_a_delete_on_one_is_never_served_by_the_other_afterwards(
    make_sidecar: MakeSidecar,
) -> None:
    a, b = pair(make_sidecar)
    doomed = a.add("The staging password is hunter2", scope=SCOPE).memory
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: shown(b, "s", "hunter2"), "B shows the entry")
    hits = b.stub.SearchMemories(pb.SearchMemoriesRequest(scope=SCOPE, query="staging password"))
    assert [h.memory.id for h in hits.hits] == [doomed.id]

    a.stub.DeleteMemory(pb.DeleteMemoryRequest(scope=SCOPE, id=doomed.id))
    eventually(lambda: not shown(b, "s", "hunter2"), "B drops the deleted entry")
    for n in range(30):
        for session in ("s", f"new-{n}"):
            turn = b.turn(session, "what is the staging password?", scope=SCOPE)
            assert "hunter2" not in turn.system_block + turn.turn_context
    hits = b.stub.SearchMemories(pb.SearchMemoriesRequest(scope=SCOPE, query="staging password"))
    assert doomed.id not in [h.memory.id for h in hits.hits]
    # B's own write to the tier does not resurrect it either.
    b.add("Staging lives in eu-west-1", scope=SCOPE)
    assert "hunter2" not in b.turn("s", scope=SCOPE).system_block


def test_an_update_on_one_replaces_the_text_on_the_other(make_sidecar: MakeSidecar) -> None:
    a, b = pair(make_sidecar)
    memory = a.add("Ada prefers tabs", scope=SCOPE, tier=pb.TIER_USER).memory
    eventually(lambda: shown(b, "s", "prefers tabs"), "B shows the entry")
    a.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=SCOPE, id=memory.id, content="Ada prefers spaces")
    )
    eventually(lambda: shown(b, "s", "prefers spaces"), "B shows the new text")
    assert not shown(b, "s", "prefers tabs")
    usage = {u.tier: u for u in b.list(scope=SCOPE).usage}[pb.TIER_USER]
    assert usage.used_chars == len("Ada prefers spaces")


def test_budgets_hold_across_daemons_and_no_acknowledged_write_is_lost(
    make_sidecar: MakeSidecar,
) -> None:
    """40 writers, half on each daemon, race for one 600-character tier."""
    limit = 600
    a, b = pair(make_sidecar, f"defaults: {{memory_char_limit: {limit}}}")
    acknowledged: list[str] = []
    refusals: list[grpc.StatusCode] = []
    lock = threading.Lock()
    start = threading.Barrier(40)

    def writer(n: int) -> None:
        target = (a, b)[n % 2]
        start.wait()
        for k in range(6):
            try:
                response = target.add(f"writer {n:02d} note {k}: " + "x" * 20, scope=SCOPE)
            except grpc.RpcError as error:
                with lock:
                    refusals.append(error.code())
                continue
            assert response.created
            with lock:
                acknowledged.append(response.memory.id)

    with ThreadPoolExecutor(max_workers=40) as pool:
        list(pool.map(writer, range(40)))

    assert set(refusals) == {grpc.StatusCode.FAILED_PRECONDITION}
    for running in (a, b):
        listed = running.list(scope=SCOPE, tier=pb.TIER_MEMORY)
        assert sorted(m.id for m in listed.memories) == sorted(acknowledged)
        rendered = SEPARATOR.join(m.content for m in listed.memories)
        assert listed.usage[0].used_chars == len(rendered) <= limit
    # The tier is full to within one entry's worth.
    assert len(rendered) > limit - len("writer 00 note 0: " + "x" * 20) - len(SEPARATOR)
    eventually(
        lambda: b.turn("s", scope=SCOPE).system_block == a.turn("s", scope=SCOPE).system_block,
        "both daemons render the same block",
    )


def test_identical_adds_on_two_daemons_store_one_entry(make_sidecar: MakeSidecar) -> None:
    a, b = pair(make_sidecar)
    start = threading.Barrier(8)

    def add(n: int) -> pb.AddMemoryResponse:
        start.wait()
        return (a, b)[n % 2].add("The repo uses uv", scope=SCOPE)

    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(pool.map(add, range(8)))
    assert len({r.memory.id for r in responses}) == 1
    assert sum(r.created for r in responses) == 1
    assert len(a.list(scope=SCOPE).memories) == 1


def test_import_into_a_live_database_reaches_the_daemon(
    make_sidecar: MakeSidecar, tmp_path: Path
) -> None:
    running = make_sidecar()
    running.add("The repo uses uv", scope=SCOPE)
    before = running.turn("s", "deploy", scope=SCOPE)
    assert "ArgoCD" not in before.system_block
    search = pb.SearchMemoriesRequest(scope=SCOPE, query="how do we deploy")
    assert not running.stub.SearchMemories(search).hits

    other = pb.Scope(agent_id="coder")
    dump = tmp_path / "dump.jsonl"
    source = make_sidecar(name="source.db")
    source.add("Deploys go through ArgoCD", scope=other)
    from sidecar.storage import archive
    from sidecar.storage.store import Store

    store = Store(source.db)
    store.open()
    dump.write_text(
        "".join(archive.export_line(owner, memory) + "\n" for owner, memory in archive.dump(store))
    )
    store.close()

    result = run_sidecar("import", str(dump), "--db", running.db)
    assert result.returncode == 0, result.stderr
    eventually(lambda: shown(running, "s", "ArgoCD"), "the daemon shows the import")
    hits = running.stub.SearchMemories(search).hits
    assert [h.memory.content for h in hits] == ["Deploys go through ArgoCD"]


def test_import_cagent_into_a_live_database_reaches_the_daemon(
    make_sidecar: MakeSidecar, tmp_path: Path
) -> None:
    from tests.ops.test_cagent import CAGENT_ROWS, make_cagent_db

    running = make_sidecar("defaults: {memory_char_limit: 0}")
    scope = pb.Scope(agent_id="coder")
    running.add("The repo uses uv", scope=scope)
    assert running.turn("s", scope=scope).cache_hit is False
    source = make_cagent_db(tmp_path / "cagent.db")
    result = run_sidecar("import-cagent", str(source), "--agent-id", "coder", "--db", running.db)
    assert result.returncode == 0, result.stderr
    imported = [row[2] for row in CAGENT_ROWS if row[2].strip()]
    eventually(
        lambda: all(text in running.turn("s", scope=scope).system_block for text in imported),
        "the daemon shows every imported entry",
    )
    usage = running.list(scope=scope, tier=pb.TIER_MEMORY).usage[0]
    assert usage.entry_count == 1 + len(imported)


def test_two_daemon_processes_share_one_database(
    make_sidecar: MakeSidecar, databases: Callable[[str], str]
) -> None:
    db = databases("shared.db")
    daemons = [spawn_daemon("--db", db, "--listen", "127.0.0.1:0") for _ in range(2)]
    try:
        channels = [grpc.insecure_channel(d.api) for d in daemons]
        a, b = (pb_grpc.MemoryServiceStub(c) for c in channels)
        a.AddMemory(
            pb.AddMemoryRequest(scope=SCOPE, content="The repo uses uv"), timeout=CALL_SECONDS
        )

        def b_shows(text: str) -> bool:
            turn = b.InjectForTurn(
                pb.InjectForTurnRequest(scope=SCOPE, session_id="s"), timeout=CALL_SECONDS
            )
            return text in turn.system_block

        eventually(lambda: b_shows("uses uv"), "the second process shows the first's write")
        listed = a.GetMemories(pb.GetMemoriesRequest(scope=SCOPE), timeout=CALL_SECONDS)
        a.DeleteMemory(
            pb.DeleteMemoryRequest(scope=SCOPE, id=listed.memories[0].id), timeout=CALL_SECONDS
        )
        eventually(lambda: not b_shows("uses uv"), "the second process drops the deleted entry")
        error = refused(
            b.DeleteMemory, pb.DeleteMemoryRequest(scope=SCOPE, id=listed.memories[0].id)
        )
        assert error.code() == grpc.StatusCode.NOT_FOUND
        for channel in channels:
            channel.close()
    finally:
        for daemon in daemons:
            daemon.close()
