"""ForgetUser and DeleteScope: what they remove, on every replica, and who
may call them (a crash mid-erasure: tests/test_erasure_crash.py).

Every test runs on both backends. The replica tests check replica B right
after A's call returns, without waiting: the call itself waits until every
replica has delivered the erasure or stopped trusting its caches.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Scope, Tier
from sidecar.ops import cli
from sidecar.storage.erasure import Erased, Erasure
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry
from tests.api.test_access import with_token
from tests.api.test_access_tokens import sha256, write_tokens
from tests.conftest import (
    CALL_SECONDS,
    MakeEngine,
    MakeSidecar,
    Running,
    error_info,
    eventually,
    refused,
)
from tests.test_export import UNLIMITED, export
from tests.test_export import seed as seed_export

pytestmark = pytest.mark.contract

ADA = pb.Scope(agent_id="coder", user_id="ada")
SECRET = "Ada's locker code is swordfish"
NOTE = "The repo deploys with ArgoCD"
# B freezes its block until compaction for this agent.
FROZEN = "agents: {frozen: {snapshot_refresh: on_compaction}}\n"


# The daemons' PostgreSQL heartbeat (default 1000 ms). ForgetUser and
# DeleteScope wait out four heartbeats (a feed goes unverified after three)
# before they answer: 1.2 s instead of 4 s, about SQLite's poller (1 s
# unverified, 1.025 s wait), which every test here passes under too.
HEARTBEAT_MS = 300


@pytest.fixture
def make_sidecar(make_sidecar: MakeSidecar) -> MakeSidecar:
    """conftest's make_sidecar, with a shorter heartbeat unless a test sets one."""

    def make(*args: Any, **server: Any) -> Running:
        server.setdefault("change_heartbeat_ms", HEARTBEAT_MS)
        return make_sidecar(*args, **server)

    return make


def shown(running: Running, session: str, text: str, scope: pb.Scope = ADA) -> bool:
    turn = running.turn(session, "locker code swordfish deploys", scope=scope)
    return text in turn.system_block + turn.turn_context


def anywhere(running: Running, text: str, scope: pb.Scope = ADA) -> list[str]:
    """Where `text` still shows for `scope`: SearchMemories, GetMemories."""
    found = []
    search = pb.SearchMemoriesRequest(scope=scope, query="locker swordfish code")
    if any(text in hit.memory.content for hit in running.stub.SearchMemories(search).hits):
        found.append("SearchMemories")
    if any(text in m.content for m in running.list(scope=scope).memories):
        found.append("GetMemories")
    return found


def rows(running: Running, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """A query on the daemon's database (`?` placeholders, either backend)."""
    db = running.store.tables.db
    with db.connection_context():
        return list(db.execute_sql(sql.replace("?", db.param), params).fetchall())


def forget(running: Running, user_id: str = "ada", **kwargs: Any) -> pb.Erasure:
    request = pb.ForgetUserRequest(user_id=user_id)
    erasure: pb.Erasure = running.stub.ForgetUser(request, timeout=CALL_SECONDS, **kwargs).erasure
    return erasure


# --- every replica ------------------------------------------------------------


def seed_and_show(a: Running, b: Running) -> pb.Scope:
    """Ada's secret (user tier, written through two agents) and a note of
    the coder, shown by B in a live session and in a frozen one."""
    a.add(SECRET, scope=ADA, tier=pb.TIER_USER)
    a.add("Ada prefers short answers", scope=pb.Scope(agent_id="reviewer", user_id="ada"), tier=2)
    a.add(NOTE, scope=ADA)
    eventually(lambda: shown(b, "live", SECRET), "B shows the secret")
    frozen = pb.Scope(agent_id="frozen", user_id="ada")
    assert shown(b, "frozen", SECRET, frozen)
    assert b.turn("frozen", scope=frozen).cache_hit
    assert anywhere(b, SECRET) == ["SearchMemories", "GetMemories"]
    return frozen


def assert_forgotten_on(b: Running, frozen: pb.Scope) -> None:
    for session, scope in (("live", ADA), ("frozen", frozen), ("new", ADA)):
        assert not shown(b, session, SECRET, scope), session
        assert not shown(b, session, "short answers", scope), session
    assert anywhere(b, SECRET) == []
    assert shown(b, "live", NOTE), "the agent's own notes stay"


def test_after_forget_user_returns_no_replica_shows_the_user(make_sidecar: MakeSidecar) -> None:
    a, b = make_sidecar(FROZEN), make_sidecar(FROZEN)
    frozen = seed_and_show(a, b)
    erasure = forget(a)
    assert (erasure.memories, erasure.sessions) == (2, 0)
    assert_forgotten_on(b, frozen)
    assert_forgotten_on(a, frozen)


def test_a_replica_whose_feed_stalled_stops_trusting_its_caches_before_the_call_returns(
    make_sidecar: MakeSidecar,
) -> None:
    # The default heartbeat: B must still trust its caches right after its
    # feed stops, however loaded the machine.
    a, b = (make_sidecar(FROZEN, change_heartbeat_ms=1000) for _ in range(2))
    frozen = seed_and_show(a, b)
    feed = b.sidecar.engine.inside().feed
    assert feed is not None
    # B hears nothing from here on, but still trusts its caches for a while.
    feed.stop()
    assert feed.verified
    forget(a)
    assert_forgotten_on(b, frozen)


def test_delete_scope_erases_one_tier_or_both(make_sidecar: MakeSidecar) -> None:
    a, b = make_sidecar(FROZEN), make_sidecar(FROZEN)
    frozen = seed_and_show(a, b)
    notes = a.stub.DeleteScope(pb.DeleteScopeRequest(scope=ADA, tier=pb.TIER_MEMORY)).erasure
    assert notes.memories == 1
    assert not shown(b, "live", NOTE)
    assert shown(b, "live", SECRET), "the user tier stays"
    both = a.stub.DeleteScope(pb.DeleteScopeRequest(scope=ADA), timeout=CALL_SECONDS).erasure
    assert both.memories == 2
    assert anywhere(b, SECRET) == []
    assert not shown(b, "frozen", SECRET, frozen)


def test_sessions_of_this_replica_that_showed_the_user_are_dropped(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar(FROZEN)
    running.add(SECRET, scope=ADA, tier=pb.TIER_USER)
    for session in ("one", "two"):
        assert shown(running, session, SECRET)
    assert shown(running, "f", SECRET, pb.Scope(agent_id="frozen", user_id="ada"))
    running.turn("bob", scope=pb.Scope(agent_id="coder", user_id="bob"))
    assert forget(running).sessions == 3
    assert running.sidecar.engine.stats().sessions == 1  # bob's
    registry = running.sidecar.metrics.registry
    sample = ("memory_snapshot_invalidations_total", {"reason": "erasure"})
    assert registry.get_sample_value(*sample) == 3


def test_a_frozen_view_that_outlived_the_drop_is_not_served(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A turn that built its view from partitions read before the erasure may
    # attach it after the sessions were dropped: the frozen block must not
    # be served from it (nothing here drops sessions, to isolate that check).
    engine, _, _ = make_engine("defaults: {snapshot_refresh: on_compaction}")
    scope = Scope("coder", "ada")
    engine.add(NewEntry(scope, Tier.USER, SECRET))
    assert SECRET in engine.inject(scope, "s").system_block
    assert engine.inject(scope, "s").cache_hit
    monkeypatch.setattr(engine.inside().partitions, "on_erased", ())
    erasure = engine.forget_user("ada", actor="test")
    assert erasure.sessions == 0  # its session kept its view
    turn = engine.inject(scope, "s")
    assert not turn.cache_hit
    assert SECRET not in turn.system_block


def test_a_retry_that_finds_nothing_left_still_lets_go_on_its_replica(
    make_sidecar: MakeSidecar,
) -> None:
    # A's daemon committed the erasure and died before it answered: the
    # client retries on B, whose feed has not delivered it yet.
    a, b = make_sidecar(FROZEN), make_sidecar(FROZEN)
    frozen = seed_and_show(a, b)
    feed = b.sidecar.engine.inside().feed
    assert feed is not None
    feed.stop()
    keys = [(Tier.USER, "ada")]
    a.store.erasure.erase(keys, actor="test", action="ForgetUser", target={"user_id": "ada"})
    retried = forget(b)
    assert (retried.memories, retried.generation) == (0, 0)
    assert retried.sessions == 2  # B's live and frozen sessions showed Ada
    assert_forgotten_on(b, frozen)


def test_a_repeat_waits_for_the_other_replicas_too(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first call may have died before its wait: the repeat waits instead.
    engine, _, _ = make_engine(changes=True)
    assert engine.inside().feed is not None
    waits: list[float] = []
    monkeypatch.setattr(engine.inside().forgetting, "_sleep", waits.append)
    engine.add(NewEntry(Scope("coder", "ada"), Tier.USER, SECRET))
    engine.forget_user("ada", actor="test")
    repeat = engine.forget_user("ada", actor="test")
    assert repeat.erased.memories == 0
    feed = engine.inside().feed
    assert feed is not None
    assert waits == [feed.settle_seconds] * 2
    # Nothing was ever erased there: nothing to wait for.
    engine.forget_user("nobody", actor="test")
    assert len(waits) == 2


def test_an_erasure_heard_of_while_erasing_the_same_partition_is_applied(
    make_engine: MakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _, _ = make_engine("defaults: {snapshot_refresh: on_compaction}")
    scope = Scope("coder", "ada")
    engine.add(NewEntry(scope, Tier.USER, SECRET))
    assert SECRET in engine.inject(scope, "s").system_block
    assert engine.inject(scope, "s").cache_hit
    # Another replica erases Ada first; its feed's news arrives while this
    # replica's own erasure of her runs (which then finds nothing left).
    other = Store(str(tmp_path / "m.db"))
    other.open()
    try:
        keys = [(Tier.USER, "ada")]
        first = other.erasure.erase(keys, actor="other", action="ForgetUser", target={})
    finally:
        other.close()
    erase = Erasure.erase

    def hearing_the_news(self: Erasure, *args: Any, **kwargs: Any) -> Erased:
        engine.inside().partitions.heard("ada", "user", first.generation, first.generation)
        # Only the news tells of it here (not what the erasure read: see
        # test_a_retry_that_finds_nothing_left_still_lets_go_on_its_replica).
        return dataclasses.replace(erase(self, *args, **kwargs), earlier=())

    monkeypatch.setattr(Erasure, "erase", hearing_the_news)
    forgotten = engine.forget_user("ada", actor="test")
    assert forgotten.erased.memories == 0
    assert forgotten.sessions == 1
    turn = engine.inject(scope, "s")
    assert not turn.cache_hit
    assert SECRET not in turn.system_block


def test_a_frozen_view_of_a_partition_no_longer_followed_is_not_served(
    make_engine: MakeEngine,
) -> None:
    engine, _, _ = make_engine("defaults: {snapshot_refresh: on_compaction}")
    scope = Scope("coder", "ada")
    engine.add(NewEntry(scope, Tier.USER, SECRET))
    assert SECRET in engine.inject(scope, "s").system_block
    assert engine.inject(scope, "s").cache_hit
    # The janitor let go of the partition (its erasure record goes with it),
    # and the erasure then finds nothing here to drop.
    engine.inside().partitions.expire(float("inf"), held=())
    assert engine.forget_user("ada", actor="test").sessions == 0
    turn = engine.inject(scope, "s")
    assert not turn.cache_hit
    assert SECRET not in turn.system_block
    assert engine.inject(scope, "s").cache_hit  # followed again


def test_a_replayed_erasure_of_a_partition_not_followed_is_handled_once(
    make_engine: MakeEngine,
) -> None:
    emptied: list[int] = []
    engine, _, _ = make_engine(on_erasure=[lambda: emptied.append(1)])
    # The feed replays the erasure: a PostgreSQL listener that reconnects
    # reads every state row again.
    for _ in range(3):
        engine.inside().partitions.heard("ada", "user", 7, 7)
    assert len(emptied) == 1
    engine.inside().partitions.heard("ada", "user", 9, 9)  # a newer erasure
    assert len(emptied) == 2


def test_a_cached_turn_after_an_erasure_runs_no_query(make_sidecar: MakeSidecar) -> None:
    a, b = make_sidecar(FROZEN), make_sidecar(FROZEN)
    seed_and_show(a, b)
    frozen = pb.Scope(agent_id="frozen", user_id="ada")
    forget(a)
    assert not shown(b, "live", SECRET)
    assert not shown(b, "frozen", SECRET, frozen)
    before = b.db_queries()
    assert b.turn("live", scope=ADA).cache_hit
    assert b.turn("frozen", scope=frozen).cache_hit
    assert b.db_queries() == before


@pytest.mark.parametrize("where", ["same replica", "other replica"])
def test_an_export_running_over_an_erased_scope_ends_aborted(
    make_sidecar: MakeSidecar, where: str
) -> None:
    # The default heartbeat: on the other replica the stream ends once its
    # feed delivers the erasure, which a loaded machine may delay past a
    # short heartbeat's settle time (an export's snapshot is not checked
    # against the generations while its feed is unverified).
    running = make_sidecar(UNLIMITED, change_heartbeat_ms=1000)
    eraser = (
        running if where == "same replica" else make_sidecar(UNLIMITED, change_heartbeat_ms=1000)
    )
    seed_export(running, 1200, 4000)
    # Megabytes, read through a channel whose flow-control window stays at
    # its initial 64 KiB (no BDP probing, which grew it past the whole
    # export on a loaded machine): the daemon cannot have sent it all
    # before the erasure.
    with grpc.insecure_channel(
        running.addresses.api, options=[("grpc.http2.bdp_probe", 0)]
    ) as channel:
        request = pb.ExportMemoriesRequest(scope=ADA, tier=pb.TIER_USER, batch_size=10)
        stream = pb_grpc.MemoryServiceStub(channel).ExportMemories(request, timeout=CALL_SECONDS)
        first = next(stream)
        assert not first.done
        forget(eraser)
        with pytest.raises(grpc.RpcError) as raised:
            for _ in stream:
                pass
    assert raised.value.code() == grpc.StatusCode.ABORTED
    assert error_info(raised.value).reason == "SCOPE_ERASED"
    assert "export again" in (raised.value.details() or "")
    # A stream begun after it is not aborted (and finds nothing).
    assert export(running, scope=ADA, tier=pb.TIER_USER)[-1].done


# --- what is removed ----------------------------------------------------------


def test_rows_vectors_keys_index_and_events_are_gone(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {user_char_limit: 0}\nserver: {compact_tier_entries: 10}")
    for k in range(12):
        running.add(f"{SECRET} #{k}", scope=ADA, tier=pb.TIER_USER, idempotency_key=f"key-{k}")
    bob = pb.Scope(agent_id="coder", user_id="bob")
    running.add("Bob's locker code is marlin", scope=bob, tier=pb.TIER_USER, idempotency_key="b")
    # Held compactly: the turn loads it and persists its index.
    assert shown(running, "s", SECRET)
    eventually(lambda: not running.sidecar.engine.indexing(), "the index is saved")
    running.add(f"{SECRET} #12", scope=ADA, tier=pb.TIER_USER)  # logged since the index
    seqs = [seq for (seq,) in rows(running, "SELECT seq FROM memories WHERE owner = 'ada'")]
    with running.store.tables.db.connection_context():
        for seq in seqs[:5]:
            running.store.tables.backend.put_vector(seq, "test", "digest", b"\x00\x01")
    ada = ("ada", "user")
    where = "WHERE owner = ? AND tier = ?"
    assert rows(running, f"SELECT COUNT(*) FROM tier_index {where}", *ada)[0][0] > 0
    assert rows(running, f"SELECT COUNT(*) FROM tier_changes {where}", *ada)[0][0] == 1

    erasure = forget(running)
    assert erasure.memories == 13
    assert erasure.vectors == 5
    assert erasure.idempotency_keys == 12
    assert erasure.change_rows == 1 + 13  # the change log, the events
    for table in ("memories", "idempotency_keys", "tier_index", "tier_changes"):
        assert rows(running, f"SELECT COUNT(*) FROM {table} {where}", *ada) == [(0,)], table
    assert rows(running, "SELECT COUNT(*) FROM memory_vectors") == [(0,)]
    assert rows(running, f"SELECT kind, memory_id FROM memory_events {where}", *ada) == [
        ("erase", "")
    ]
    state = rows(
        running,
        f"SELECT content_chars, entry_count, indexed, generation, erased FROM tier_state {where}",
        *ada,
    )
    assert state == [(0, 0, 0, erasure.generation, erasure.generation)]
    # Bob is untouched.
    assert rows(running, "SELECT COUNT(*) FROM memories WHERE owner = 'bob'") == [(1,)]
    assert rows(running, "SELECT COUNT(*) FROM idempotency_keys WHERE owner = 'bob'") == [(1,)]
    # Written again from scratch, under the same key.
    again = running.add("Ada is back", scope=ADA, tier=pb.TIER_USER, idempotency_key="key-0")
    assert again.created
    assert shown(running, "s", "Ada is back")
    assert not shown(running, "s", SECRET)


def test_a_repeat_erases_nothing_answers_zeros_and_is_audited(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar()
    running.add(SECRET, scope=ADA, tier=pb.TIER_USER)
    first = forget(running)
    generation = rows(running, "SELECT generation FROM tier_state WHERE owner = 'ada'")
    second = forget(running)
    assert first.memories == 1
    assert first.generation > 0
    assert (second.memories, second.change_rows, second.generation) == (0, 0, 0)
    assert second.audit_id == first.audit_id + 1
    assert rows(running, "SELECT generation FROM tier_state WHERE owner = 'ada'") == generation
    # Never written at all: zeros too, and no state row is made for it.
    assert forget(running, "nobody").memories == 0
    assert rows(running, "SELECT COUNT(*) FROM tier_state WHERE owner = 'nobody'") == [(0,)]


def test_the_audit_log_says_who_what_when_and_how_many_never_content(
    make_sidecar: MakeSidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    running = make_sidecar()
    running.add(SECRET, scope=ADA, tier=pb.TIER_USER)
    running.add(NOTE, scope=ADA)
    forget(running)
    running.stub.DeleteScope(
        pb.DeleteScopeRequest(scope=ADA, tier=pb.TIER_MEMORY), timeout=CALL_SECONDS
    )
    logged = rows(running, "SELECT * FROM audit_log ORDER BY id")
    assert "swordfish" not in repr(logged)
    assert "ArgoCD" not in repr(logged)
    # `memory-sidecar audit`, in this process (a subprocess per command
    # cost a second of start-up each).
    capsys.readouterr()
    assert cli.main(["audit", "--db", running.db], environ={}) == 0
    result = capsys.readouterr()
    lines = [json.loads(line) for line in result.out.splitlines()]
    assert [line["action"] for line in lines] == ["ForgetUser", "DeleteScope"]
    assert lines[0]["actor"] == "unauthenticated"
    assert lines[0]["target"] == {"user_id": "ada", "agent_notes": "reported"}
    assert lines[0]["counts"]["memories"] == 1
    assert lines[1]["target"] == {"agent_id": "coder", "user_id": "ada", "tiers": "memory"}
    assert datetime.fromisoformat(lines[0]["at"]).tzinfo is not None
    assert "swordfish" not in result.out
    assert cli.main(["audit", "--db", running.db, "--limit", "1"], environ={}) == 0
    limited = capsys.readouterr().out
    assert [json.loads(line)["action"] for line in limited.splitlines()] == ["DeleteScope"]
    later = datetime.now(UTC).isoformat()
    assert cli.main(["audit", "--db", running.db, "--since", later], environ={}) == 0
    assert capsys.readouterr().out == ""


# --- who may erase ----------------------------------------------------------------

OPERATOR = "token-of-the-erasing-operator"
AGENT = "token-of-an-agent"
ADA_ERASER = "token-that-may-erase-ada-only"
SINGLE = "the-single-token"


@pytest.fixture
def guarded(make_sidecar: MakeSidecar, tmp_path: Path) -> Running:
    tokens = tmp_path / "tokens.yaml"
    write_tokens(
        tokens,
        [
            {"name": "dpo", "sha256": sha256(OPERATOR), "agents": ["*"], "users": ["*"]}
            | {"erase": True},
            {"sha256": sha256(AGENT), "agents": ["*"], "users": ["*"]},
            {
                "name": "ada-eraser",
                "sha256": sha256(ADA_ERASER),
                "agents": ["coder"],
                "users": ["ada"],
                "erase": True,
            },
        ],
    )
    single = tmp_path / "single"
    single.write_text(SINGLE)
    running = make_sidecar(auth_tokens_file=str(tokens), auth_token_file=str(single))
    for user in ("ada", "bob"):
        scope = pb.Scope(agent_id="coder", user_id=user)
        running.stub.AddMemory(
            pb.AddMemoryRequest(scope=scope, tier=pb.TIER_USER, content=f"{user}'s secret"),
            metadata=with_token(OPERATOR),
        )
    return running


def test_only_an_erase_grant_may_erase(guarded: Running) -> None:
    calls = [
        (guarded.stub.ForgetUser, pb.ForgetUserRequest(user_id="ada")),
        (guarded.stub.DeleteScope, pb.DeleteScopeRequest(scope=ADA)),
    ]
    for call, request in calls:
        for token in (AGENT, SINGLE):
            error = refused(call, request, metadata=with_token(token), timeout=CALL_SECONDS)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert error_info(error).reason == "ERASE_NOT_GRANTED"
    assert rows(guarded, "SELECT COUNT(*) FROM memories") == [(2,)]
    assert rows(guarded, "SELECT COUNT(*) FROM audit_log") == [(0,)]
    erasure = forget(guarded, metadata=with_token(OPERATOR))
    assert erasure.memories == 1
    assert rows(guarded, "SELECT actor FROM audit_log") == [("dpo",)]


def test_a_restricted_erase_grant_erases_only_what_it_lists(guarded: Running) -> None:
    bob = pb.Scope(agent_id="coder", user_id="bob")
    for call, request in (
        (guarded.stub.ForgetUser, pb.ForgetUserRequest(user_id="bob")),
        (guarded.stub.DeleteScope, pb.DeleteScopeRequest(scope=bob)),
        (guarded.stub.DeleteScope, pb.DeleteScopeRequest(scope=pb.Scope(agent_id="other"))),
    ):
        error = refused(call, request, metadata=with_token(ADA_ERASER), timeout=CALL_SECONDS)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_info(error).reason == "SCOPE_FORBIDDEN"
    assert forget(guarded, metadata=with_token(ADA_ERASER)).memories == 1
    assert rows(guarded, "SELECT owner FROM memories") == [("bob",)]
    assert rows(guarded, "SELECT actor FROM audit_log") == [("ada-eraser",)]


def test_forget_user_needs_a_user_id(make_sidecar: MakeSidecar) -> None:
    sidecar = make_sidecar("defaults:\n  shared_user_profile: true\n")
    error = refused(sidecar.stub.ForgetUser, pb.ForgetUserRequest(), timeout=CALL_SECONDS)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(error).reason == "USER_ID_EMPTY"
    assert "DeleteScope" in (error.details() or "")
    # The shared empty-user profile goes with DeleteScope.
    sidecar.add("shared profile fact", scope=pb.Scope(agent_id="coder"), tier=pb.TIER_USER)
    request = pb.DeleteScopeRequest(scope=pb.Scope(agent_id="coder"), tier=pb.TIER_USER)
    assert sidecar.stub.DeleteScope(request, timeout=CALL_SECONDS).erasure.memories == 1
