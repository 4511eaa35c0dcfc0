"""Edits by text: UpdateMemory and DeleteMemory name their entry by `match`,
text that occurs in exactly one entry of the scope's tier, in place of an id.

Over a real daemon, on both backends. The lookup happens inside the write's
transaction, after the partition's state row is locked, so two edits by the
same text (on one daemon or two) never both act on the entry as it was.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    MakeSidecar,
    Running,
    contents,
    error_info,
    refused,
)

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")


def update(running: Running, **fields: Any) -> pb.UpdateMemoryResponse:
    fields.setdefault("scope", SCOPE)
    response: pb.UpdateMemoryResponse = running.stub.UpdateMemory(
        pb.UpdateMemoryRequest(**fields), timeout=CALL_SECONDS
    )
    return response


def delete(running: Running, **fields: Any) -> pb.DeleteMemoryResponse:
    fields.setdefault("scope", SCOPE)
    response: pb.DeleteMemoryResponse = running.stub.DeleteMemory(
        pb.DeleteMemoryRequest(**fields), timeout=CALL_SECONDS
    )
    return response


@contextlib.contextmanager
def unchanged(running: Running, *scopes: pb.Scope) -> Iterator[None]:
    """The block refuses to change anything: every scope's entries and usage
    are as they were, and its next turn is still served from the snapshot
    (no partition's generation moved)."""
    scopes = scopes or (SCOPE,)
    for scope in scopes:
        running.turn("watch", scope=scope)
    before = [running.list(scope=scope) for scope in scopes]
    yield
    assert [running.list(scope=scope) for scope in scopes] == before
    for scope in scopes:
        assert running.turn("watch", scope=scope).cache_hit


def test_update_by_match_changes_the_one_entry_holding_the_text(sidecar: Running) -> None:
    uv = sidecar.add("The repo uses uv, not pip", scope=SCOPE).memory
    ci = sidecar.add("CI runs on Debian bookworm", scope=SCOPE).memory

    response = update(sidecar, match="Debian", content="CI runs on Alpine", confidence=0.5)

    assert response.memory.id == ci.id
    assert response.memory.content == "CI runs on Alpine"
    assert response.memory.confidence == 0.5
    assert response.memory.created_at == ci.created_at
    assert response.usage.tier == pb.TIER_MEMORY
    assert response.usage.entry_count == 2
    assert response.usage.used_chars == len(uv.content) + 3 + len("CI runs on Alpine")
    assert contents(sidecar, SCOPE) == ["The repo uses uv, not pip", "CI runs on Alpine"]


def test_update_by_match_changes_only_the_fields_given(sidecar: Running) -> None:
    sidecar.add("Deploys go through ArgoCD", scope=SCOPE, category="ops")
    response = update(sidecar, match="ArgoCD", category="deploy")
    assert response.memory.content == "Deploys go through ArgoCD"
    assert response.memory.category == "deploy"
    assert response.memory.confidence == 1.0


def test_delete_by_match_removes_the_entry_and_frees_its_budget(sidecar: Running) -> None:
    sidecar.add("keep me", scope=SCOPE)
    gone = sidecar.add("The staging password is hunter2", scope=SCOPE).memory

    response = delete(sidecar, match="hunter2")

    assert response.memory == gone
    assert response.usage.entry_count == 1
    assert response.usage.used_chars == len("keep me")
    assert contents(sidecar, SCOPE) == ["keep me"]
    # Once gone, the same text names nothing.
    again = refused(delete, sidecar, match="hunter2")
    assert again.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(again).reason == "MATCH_NOT_FOUND"


def test_the_match_is_looked_up_in_the_named_tier_only(sidecar: Running) -> None:
    note = sidecar.add("Ada prefers tabs", scope=SCOPE).memory
    fact = sidecar.add("Ada prefers tabs", scope=SCOPE, tier=pb.TIER_USER).memory

    # TIER_UNSPECIFIED looks in the agent notes.
    assert update(sidecar, match="tabs", content="Ada prefers spaces").memory.id == note.id
    assert contents(sidecar, SCOPE, tier=pb.TIER_USER) == ["Ada prefers tabs"]

    response = delete(sidecar, match="tabs", tier=pb.TIER_USER)
    assert response.memory.id == fact.id
    assert response.usage.tier == pb.TIER_USER
    assert contents(sidecar, SCOPE, tier=pb.TIER_USER) == []
    assert contents(sidecar, SCOPE, tier=pb.TIER_MEMORY) == ["Ada prefers spaces"]

    with unchanged(sidecar):
        missing = refused(delete, sidecar, match="spaces", tier=pb.TIER_USER)
    assert missing.code() == grpc.StatusCode.NOT_FOUND
    assert dict(error_info(missing).metadata) == {"field": "match", "tier": "user"}


def test_another_scope_is_never_matched_nor_named(sidecar: Running) -> None:
    writer = pb.Scope(agent_id="writer", user_id="ada")
    grace = pb.Scope(agent_id="coder", user_id="grace")
    theirs = sidecar.add("Release notes go in CHANGELOG.md", scope=writer).memory
    sidecar.add("Grace reviews the CHANGELOG.md", scope=grace, tier=pb.TIER_USER)
    mine = sidecar.add("Keep CHANGELOG.md bullets short", scope=SCOPE).memory

    # Another agent's note with the same text is no candidate: one match.
    response = update(sidecar, match="CHANGELOG.md", content="Keep changelog bullets terse")
    assert response.memory.id == mine.id
    assert contents(sidecar, writer, tier=pb.TIER_MEMORY) == [theirs.content]
    assert contents(sidecar, grace, tier=pb.TIER_USER) == ["Grace reviews the CHANGELOG.md"]

    # Nor is another user's profile, nor are other agents' notes when two of
    # this scope's entries match: only this scope's entries are named.
    sidecar.add("Ada reads the CHANGELOG.md", scope=SCOPE, tier=pb.TIER_USER)
    sidecar.add("Ada writes the CHANGELOG.md", scope=SCOPE, tier=pb.TIER_USER)
    with unchanged(sidecar, SCOPE, writer, grace):
        error = refused(delete, sidecar, match="CHANGELOG.md", tier=pb.TIER_USER)
    metadata = error_info(error).metadata
    ours = {m.id for m in sidecar.list(scope=SCOPE, tier=pb.TIER_USER).memories}
    assert set(metadata["candidate_ids"].split(",")) == ours

    # A scope that holds nothing of it gets NOT_FOUND, as for an id.
    stranger = pb.Scope(agent_id="x", user_id="y")
    with unchanged(sidecar, SCOPE, writer, grace):
        error = refused(update, sidecar, scope=stranger, match="CHANGELOG", content="hijacked")
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_no_match_is_not_found_and_changes_nothing(sidecar: Running) -> None:
    sidecar.add("The repo uses uv", scope=SCOPE)
    sidecar.add("Ada likes short answers", scope=SCOPE, tier=pb.TIER_USER)

    cases: list[tuple[Callable[..., Any], dict[str, Any]]] = [
        (update, {"match": "poetry", "content": "The repo uses poetry"}),
        (delete, {"match": "poetry"}),
        # An empty partition: nothing was ever written there for this agent.
        (delete, {"match": "uv", "scope": pb.Scope(agent_id="fresh", user_id="ada")}),
    ]
    for call, fields in cases:
        with unchanged(sidecar):
            error = refused(call, sidecar, **fields)
        assert error.code() == grpc.StatusCode.NOT_FOUND
        info = error_info(error)
        assert info.reason == "MATCH_NOT_FOUND"
        assert dict(info.metadata) == {"field": "match", "tier": "memory"}
        assert "poetry" in (error.details() or "") or "'uv'" in (error.details() or "")


def test_several_matches_are_refused_naming_the_candidates(sidecar: Running) -> None:
    first = sidecar.add("Deploy staging with make deploy-staging", scope=SCOPE).memory
    second = sidecar.add("Deploy production only on weekdays", scope=SCOPE).memory
    sidecar.add("Nothing to see here", scope=SCOPE)

    for call, fields in [(update, {"content": "Deploy nothing"}), (delete, {})]:
        with unchanged(sidecar):
            error = refused(call, sidecar, match="Deploy", **fields)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        info = error_info(error)
        assert info.reason == "AMBIGUOUS_MATCH"
        assert info.metadata["tier"] == "memory"
        assert info.metadata["candidates"] == "2"
        assert info.metadata["more"] == "false"
        assert info.metadata["candidate_ids"] == f"{first.id},{second.id}"
        assert info.metadata["candidate_1"] == f"{first.id} {first.content}"
        assert info.metadata["candidate_2"] == f"{second.id} {second.content}"
        assert first.id in (error.details() or "")
        assert second.id in (error.details() or "")
        assert "'Deploy' occurs in 2 entries" in (error.details() or "")

    # More text names one of them.
    assert delete(sidecar, match="Deploy production").memory.id == second.id


def test_many_matches_name_the_first_five_and_say_there_are_more(sidecar: Running) -> None:
    notes = [
        sidecar.add(f"Port {8000 + n} serves service {n}", scope=SCOPE).memory for n in range(8)
    ]
    long = sidecar.add("Port list: " + "x" * 200, scope=SCOPE).memory

    with unchanged(sidecar):
        error = refused(update, sidecar, match="Port", content="Ports are in ports.md")
    info = error_info(error)
    assert info.reason == "AMBIGUOUS_MATCH"
    assert info.metadata["candidates"] == "5"
    assert info.metadata["more"] == "true"
    assert info.metadata["candidate_ids"].split(",") == [m.id for m in notes[:5]]
    assert "candidate_6" not in info.metadata
    assert "more than 5 entries" in (error.details() or "")
    assert "and more" in (error.details() or "")
    assert long.id not in (error.details() or "")

    # A candidate's content is quoted by its start only.
    sidecar.add("Port list: short", scope=SCOPE)
    error = refused(delete, sidecar, match="Port list")
    quoted = error_info(error).metadata["candidate_1"]
    assert quoted == f"{long.id} " + ("Port list: " + "x" * 200)[:60]


def test_matching_is_case_sensitive_and_literal(sidecar: Running) -> None:
    sidecar.add("Use HTTPS for the API", scope=SCOPE)
    sidecar.add("Coverage must stay above 90% on main", scope=SCOPE)
    sidecar.add("Coverage must stay above 90 on dev", scope=SCOPE)
    sidecar.add("Env var MAX_RETRIES sets the retries", scope=SCOPE)
    sidecar.add("Env var MAXARETRIES is a typo", scope=SCOPE)
    sidecar.add("Lint src/*.py before pushing", scope=SCOPE)

    with unchanged(sidecar):
        for text in ("https", "use HTTPS", "90 %", "Coverage%main", "MAX_RETRIES is", "src*py"):
            error = refused(delete, sidecar, match=text)
            assert error_info(error).reason == "MATCH_NOT_FOUND", text

    # %, _ and * stand for themselves, not for any text or any character.
    assert delete(sidecar, match="90%").memory.content == "Coverage must stay above 90% on main"
    assert delete(sidecar, match="X_R").memory.content == "Env var MAX_RETRIES sets the retries"
    assert delete(sidecar, match="src/*.py").memory.content == "Lint src/*.py before pushing"
    assert update(sidecar, match="HTTPS", content="Use HTTPS only").memory.content == (
        "Use HTTPS only"
    )
    assert contents(sidecar, SCOPE) == [
        "Use HTTPS only",
        "Coverage must stay above 90 on dev",
        "Env var MAXARETRIES is a typo",
    ]


def test_a_match_may_span_lines_and_hold_any_character(sidecar: Running) -> None:
    sidecar.add("Steps:\n1. build\n2. ship", scope=SCOPE)
    sidecar.add("Café «naïve» résumé 😀", scope=SCOPE)
    assert delete(sidecar, match="build\n2.").memory.content == "Steps:\n1. build\n2. ship"
    assert delete(sidecar, match="«naïve» résumé 😀").memory.content == "Café «naïve» résumé 😀"
    assert contents(sidecar, SCOPE) == []


@pytest.mark.parametrize("call", [update, delete], ids=["update", "delete"])
def test_id_and_match_exactly_one_of_them(sidecar: Running, call: Callable[..., Any]) -> None:
    memory = sidecar.add("The repo uses uv", scope=SCOPE).memory
    extra = {"content": "The repo uses pip"} if call is update else {}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"id": memory.id, "match": "uv"}, "ID_AND_MATCH"),
        ({}, "ID_EMPTY"),
        ({"match": "   "}, "MATCH_EMPTY"),
        ({"match": "uv\x00"}, "CONTROL_CHARACTER"),
        ({"match": "u" * 8193}, "FIELD_TOO_LONG"),
        ({"match": "uv", "tier": 9}, "TIER_UNKNOWN"),
    ]
    for fields, reason in cases:
        with unchanged(sidecar):
            error = refused(call, sidecar, **fields, **extra)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, reason
        assert error_info(error).reason == reason
    both = refused(call, sidecar, id=memory.id, match="uv", **extra)
    assert "both id and match" in (both.details() or "")
    neither = refused(call, sidecar, **extra)
    assert "id and match are both empty" in (neither.details() or "")


def test_the_match_may_be_as_long_as_content(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 0}")
    running.add("y" * 8192, scope=SCOPE)
    running.add("y" * 8191, scope=SCOPE)
    assert delete(running, match="y" * 8192).memory.content == "y" * 8192
    # A refusal quotes the match by its start only: the status travels in a
    # trailer, which must stay small.
    error = refused(delete, running, match="y" * 8192)
    assert error_info(error).reason == "MATCH_NOT_FOUND"
    assert len(error.details() or "") < 200


def test_a_refused_update_by_match_leaves_the_store_unchanged(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 30}")
    running.add("short note", scope=SCOPE)
    running.add("another note", scope=SCOPE)

    with unchanged(running):
        error = refused(update, running, match="short", content="a much longer note")
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(error)
    assert info.reason == "TIER_BUDGET_EXCEEDED"
    assert info.metadata["requested_chars"] == str(len("a much longer note") - len("short note"))

    # Content another entry already says: refused, naming the entry found.
    with unchanged(running):
        twin = refused(update, running, match="short", content="another note")
    assert error_info(twin).reason == "DUPLICATE_CONTENT"
    short = running.list(scope=SCOPE).memories[0]
    assert error_info(twin).metadata["id"] == short.id

    # Shrinking is always accepted.
    assert update(running, match="short", content="short").usage.used_chars == 5 + 3 + 12


@pytest.mark.parametrize("change", ["update", "delete"])
@pytest.mark.parametrize("refresh", ["on_write", "on_compaction"])
def test_the_frozen_block_follows_an_edit_by_match_as_one_by_id(
    make_sidecar: MakeSidecar, change: str, refresh: str
) -> None:
    """The same edit, by id in one scope and by match in another: every turn
    after it sees the same blocks, cache hits and generation moves."""
    running = make_sidecar(f"defaults: {{snapshot_refresh: {refresh}}}")
    by_id = pb.Scope(agent_id="by-id", user_id="ada")
    by_match = pb.Scope(agent_id="by-match", user_id="bob")
    turns: dict[str, list[pb.InjectForTurnResponse]] = {}
    for how, scope in (("id", by_id), ("match", by_match)):
        running.add("Repo uses uv for Python packaging", scope=scope)
        target = running.add("CI runs on Debian bookworm", scope=scope).memory
        before = running.turn("s", scope=scope)
        naming = {"id": target.id} if how == "id" else {"match": "Debian"}
        if change == "update":
            update(running, scope=scope, content="CI runs on Alpine", **naming)
        else:
            delete(running, scope=scope, **naming)
        after = running.turn("s", "where does CI run?", scope=scope)
        running.stub.NotifyCompaction(pb.NotifyCompactionRequest(session_id="s", scope=scope))
        compacted = running.turn("s", "where does CI run?", scope=scope)
        turns[how] = [before, after, compacted]

    def shape(turn: pb.InjectForTurnResponse, first: pb.InjectForTurnResponse) -> tuple[Any, ...]:
        return (
            turn.system_block,
            turn.turn_context,
            turn.cache_hit,
            turn.snapshot_generation > first.snapshot_generation,
        )

    assert [shape(t, turns["id"][0]) for t in turns["id"]] == [
        shape(t, turns["match"][0]) for t in turns["match"]
    ]
    before, after, compacted = turns["match"]
    assert "Debian" in before.system_block
    assert "Debian" not in compacted.system_block
    if refresh == "on_write":
        assert not after.cache_hit
        assert "Debian" not in after.system_block
    else:
        assert after.cache_hit
        assert after.system_block == before.system_block


def test_semantic_vectors_follow_an_edit_by_match(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("server: {semantic_encoder: local}")
    food = running.add("Her favourite food is sushi", scope=SCOPE).memory
    running.add("Melanie plays the clarinet", scope=SCOPE)

    def found(query: str) -> list[str]:
        request = pb.SearchMemoriesRequest(scope=SCOPE, query=query)
        return [
            h.memory.id for h in running.stub.SearchMemories(request, timeout=CALL_SECONDS).hits
        ]

    def vectors() -> int:
        cursor = running.store._db.execute_sql("SELECT COUNT(*) FROM memory_vectors")
        return int(cursor.fetchone()[0])

    update(running, match="sushi", content="The office wifi password rotates monthly")
    assert found("what does she like to eat") == []
    assert found("network credentials change") == [food.id]
    assert vectors() == 2

    delete(running, match="clarinet")
    assert found("which musical instrument") == []
    assert vectors() == 1


# --- races ------------------------------------------------------------------


def test_racing_edits_by_the_same_text_act_once(make_sidecar: MakeSidecar) -> None:
    """Writers on two daemons over one database edit by the same text at
    once; each edit removes the text. Exactly one wins each round; every
    other finds nothing, never the entry as it was."""
    a = make_sidecar(max_workers=8)
    b = make_sidecar(db=a.db, max_workers=8)
    writers = 8

    def edit(n: int, round_: int, start: threading.Barrier) -> str:
        target = (a, b)[n % 2]
        start.wait(WAIT_SECONDS)
        text = f"ticket {round_} is open"
        try:
            if round_ % 2:
                delete(target, match=text)
            else:
                update(target, match=text, content=f"ticket {round_} closed by writer {n}")
        except grpc.RpcError as error:
            return str(error_info(error).reason)
        return f"OK {n}"

    for round_ in range(6):
        a.add(f"ticket {round_} is open", scope=SCOPE)
        start = threading.Barrier(writers)
        with ThreadPoolExecutor(max_workers=writers) as pool:
            outcomes = list(pool.map(edit, range(writers), [round_] * writers, [start] * writers))
        won = [o for o in outcomes if o.startswith("OK")]
        assert len(won) == 1, outcomes
        assert sorted(set(outcomes) - set(won)) == ["MATCH_NOT_FOUND"], outcomes
        left = [c for c in contents(a, SCOPE) if c.startswith(f"ticket {round_} ")]
        if round_ % 2:
            assert left == []
        else:
            assert left == [f"ticket {round_} closed by writer {won[0].split()[1]}"]


class Gate:
    """A statement span (Store.trace) through which a test sees, and stops,
    a daemon's write at a chosen statement.

    `began` is set as the first statement `at` picks begins; with `hold`,
    that statement, once run, sets `ran` and waits for `release`, its
    transaction still open. `read` is set once a statement on `memories`
    has run since `began`.
    """

    def __init__(self, at: Callable[[str], bool], *, hold: bool = False) -> None:
        self.at = at
        self.hold = hold
        self.began = threading.Event()
        self.ran = threading.Event()
        self.read = threading.Event()
        self.release = threading.Event()

    @contextlib.contextmanager
    def __call__(self, sql: str) -> Iterator[None]:
        first = self.at(sql) and not self.began.is_set()
        if first:
            self.began.set()
        yield
        if first and self.hold:
            self.ran.set()
            self.release.wait(WAIT_SECONDS)
        if self.began.is_set() and '"memories"' in sql:
            self.read.set()


# How long B may take to read, on SQLite, before A is let go (see below).
READ_GRACE_SECONDS = 1.0


def test_an_edit_waiting_on_another_acts_on_what_that_one_left(
    make_sidecar: MakeSidecar, backend: str
) -> None:
    """A's edit by text is held inside its transaction, having changed the
    entry; B's edit by the same text starts, and A is let go as B takes the
    partition's lock. B must find the text gone: it looks only once it holds
    the lock, so it cannot act on anything it read before A committed."""
    a = make_sidecar()
    b = make_sidecar(db=a.db)
    a.add("ticket 7 is open", scope=SCOPE)
    held = Gate(lambda sql: sql.startswith('UPDATE "memories"'), hold=True)
    # Where B starts to take the lock: PostgreSQL's SELECT ... FOR UPDATE of
    # the state row; SQLite's BEGIN IMMEDIATE, which the span names "BEGIN".
    if backend == "sqlite":
        locking = Gate(lambda sql: sql == "BEGIN")
    else:
        locking = Gate(lambda sql: "FOR UPDATE" in sql)
    a.store.trace(held)
    b.store.trace(locking)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(update, a, match="ticket 7 is open", content="ticket 7 closed by A")
            assert held.ran.wait(WAIT_SECONDS), "A never changed the entry"
            second = pool.submit(
                update, b, match="ticket 7 is open", content="ticket 7 closed by B"
            )
            assert locking.began.wait(WAIT_SECONDS), "B never began to take the lock"
            if backend == "sqlite":
                # A span sees BEGIN IMMEDIATE and a plain read's BEGIN alike.
                # Should B read the entry before it takes the lock, that read
                # is let finish (and finds the text A is removing) before A
                # commits; B done right is blocked in BEGIN, and A goes on
                # after the grace. Either way the outcome below must hold.
                locking.read.wait(READ_GRACE_SECONDS)
            held.release.set()
            assert first.result().memory.content == "ticket 7 closed by A"
            error = second.exception()
    finally:
        held.release.set()
        a.store.trace(None)
        b.store.trace(None)
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(error).reason == "MATCH_NOT_FOUND"
    assert contents(a, SCOPE) == contents(b, SCOPE) == ["ticket 7 closed by A"]
