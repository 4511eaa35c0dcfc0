"""Who each entry was written for (schema 10): ForgetUser reports the agent
notes written in a user's scope and erases them only when asked, on every
replica; a for_user export includes them; rows written before schema 10
have no writer and are never anyone's.

Every test runs on both backends, over a real gRPC server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.ops import cli
from sidecar.storage.schema import SCHEMA_VERSION
from sidecar.storage.store import Store
from tests.api.test_access import with_token
from tests.api.test_access_tokens import sha256, write_tokens
from tests.conftest import CALL_SECONDS, MakeSidecar, Running, eventually, refused
from tests.test_erasure import HEARTBEAT_MS, rows, shown
from tests.test_export import export, parsed

pytestmark = pytest.mark.contract

ADA = pb.Scope(agent_id="coder", user_id="ada")
BOB = pb.Scope(agent_id="coder", user_id="bob")
ADA_NOTE = "Ada's staging key is in vault path secret/ada-staging"
BOB_NOTE = "Bob's staging key is in vault path secret/bob-staging"
# Sessions of this agent freeze their block until compaction.
FROZEN = "agents: {frozen: {snapshot_refresh: on_compaction}}\n"
QUERY = "staging key vault path"


@pytest.fixture
def make_sidecar(make_sidecar: MakeSidecar) -> MakeSidecar:
    def make(*args: Any, **server: Any) -> Running:
        server.setdefault("change_heartbeat_ms", HEARTBEAT_MS)
        return make_sidecar(*args, **server)

    return make


def forget(running: Running, user_id: str = "ada", erase: bool = False) -> pb.ForgetUserResponse:
    request = pb.ForgetUserRequest(user_id=user_id, erase_agent_notes_written_for_user=erase)
    response: pb.ForgetUserResponse = running.stub.ForgetUser(request, timeout=CALL_SECONDS)
    return response


def notes(running: Running, agent_id: str = "coder") -> list[str]:
    listed = running.list(scope=pb.Scope(agent_id=agent_id), tier=pb.TIER_MEMORY).memories
    return [memory.content for memory in listed]


def test_forget_user_reports_the_notes_written_for_the_user_and_keeps_them(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar()
    ada_note = running.add(ADA_NOTE, scope=ADA).memory.id
    running.add(BOB_NOTE, scope=BOB)
    running.add("Ada prefers short answers", scope=ADA, tier=pb.TIER_USER)
    response = forget(running)
    assert response.erasure.memories == 1  # the profile only
    assert response.agent_notes_written_for_user == 1
    assert list(response.agent_note_ids_written_for_user) == [ada_note]
    assert not response.agent_notes_erased
    assert notes(running) == [ADA_NOTE, BOB_NOTE]


def test_asked_to_it_erases_the_users_notes_on_every_replica(
    make_sidecar: MakeSidecar,
) -> None:
    a, b = make_sidecar(FROZEN), make_sidecar(FROZEN)
    a.add(ADA_NOTE, scope=ADA)
    a.add(BOB_NOTE, scope=BOB)
    a.add(ADA_NOTE.replace("Ada", "The team"), scope=pb.Scope(agent_id="frozen", user_id="ada"))
    carol = pb.Scope(agent_id="frozen", user_id="carol")
    eventually(lambda: shown(b, "live", ADA_NOTE, BOB), "B shows Ada's note to Bob's session")
    # A frozen session of another user shows the note written for Ada.
    assert shown(b, "carol", "The team's staging key", carol)
    assert b.turn("carol", scope=carol).cache_hit

    response = forget(a, erase=True)
    assert response.agent_notes_written_for_user == 2
    assert response.agent_notes_erased
    assert response.erasure.memories == 2
    for running in (a, b):
        assert not shown(running, "live", ADA_NOTE, BOB)
        assert shown(running, "live", BOB_NOTE, BOB), "Bob's note stays"
        assert not shown(running, "carol", "The team's staging key", carol)
        assert notes(running) == [BOB_NOTE]
        assert notes(running, "frozen") == []
    where = "WHERE written_for_user_id = ?"
    assert rows(a, f"SELECT COUNT(*) FROM memories {where}", "ada") == [(0,)]
    # Watchers hear each note deleted; a repeat finds nothing.
    kinds = rows(a, "SELECT kind FROM memory_events WHERE owner = 'frozen' ORDER BY generation")
    assert kinds[-1] == ("delete",)
    again = forget(a, erase=True)
    assert (again.agent_notes_written_for_user, again.erasure.memories) == (0, 0)


def test_the_audit_log_says_whether_the_notes_were_erased(
    make_sidecar: MakeSidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    running = make_sidecar()
    running.add(ADA_NOTE, scope=ADA)
    forget(running)
    forget(running, erase=True)
    capsys.readouterr()
    assert cli.main(["audit", "--db", running.db], environ={}) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["target"] for line in lines] == [
        {"user_id": "ada", "agent_notes": "reported"},
        {"user_id": "ada", "agent_notes": "erased"},
    ]
    assert [line["counts"]["agent_notes"] for line in lines] == [1, 1]
    assert [line["counts"]["memories"] for line in lines] == [0, 1]
    assert "vault" not in repr(lines)


def test_a_for_user_export_includes_the_notes_written_for_the_user(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar()
    profile = running.add("Ada prefers short answers", scope=ADA, tier=pb.TIER_USER).memory.id
    note = running.add(ADA_NOTE, scope=ADA).memory.id
    running.add(BOB_NOTE, scope=BOB)
    responses = export(running, scope=pb.Scope(user_id="ada"), for_user=True, batch_size=1)
    assert [(owner, memory.id) for owner, memory in parsed(responses)] == [
        ("ada", profile),
        ("coder", note),
    ]
    lines = [json.loads(line) for r in responses for line in r.jsonl.splitlines()]
    assert [line.get("written_for_user_id") for line in lines] == [None, "ada"]
    # A resume from the first response's cursor sends the note alone.
    rest = export(running, scope=pb.Scope(user_id="ada"), for_user=True, cursor=responses[0].cursor)
    assert [memory.id for _, memory in parsed(rest)] == [note]


def test_a_tool_call_records_its_session(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar()
    arguments = json.dumps({"action": "add", "content": "Staging uses vault path secret/stage"})
    request = pb.CallToolRequest(
        scope=ADA, session_id="s-1", name="memory", arguments_json=arguments
    )
    result = running.stub.CallTool(request, timeout=CALL_SECONDS)
    assert not result.is_error
    # Never shown to the model: neither the user nor the session.
    assert "ada" not in result.text + result.structured_json
    assert "s-1" not in result.text + result.structured_json
    written = rows(running, "SELECT written_for_user_id, written_in_session FROM memories")
    assert written == [("ada", "s-1")]
    assert "s-1" not in running.turn("s-1", QUERY, scope=ADA).system_block


def _schema_9_database(db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database at schema 9 holding an agent note and a profile entry, as
    the previous release wrote them."""
    store = Store(db)
    backend = store.tables.backend
    earlier = [step for step in backend.migrations if step[0] < SCHEMA_VERSION]
    # This store's migrations stop at the previous release's.
    monkeypatch.setattr(backend, "migrations", earlier)
    assert store.open() == SCHEMA_VERSION - 1 == 9
    p = backend.db.param
    with backend.db.connection_context():
        for memory_id, tier, owner, content in (
            ("old-note", "memory", "coder", ADA_NOTE),
            ("old-profile", "user", "ada", "Ada prefers short answers"),
        ):
            backend.db.execute_sql(
                "INSERT INTO memories (id, tier, owner, content, content_chars, content_sha256,"
                f" category, confidence, created_at, updated_at) VALUES ({p}, {p}, {p}, {p}, {p},"
                f" {p}, '', 1.0, 1, 1)",
                (memory_id, tier, owner, content, len(content), "digest-" + memory_id),
            )
            backend.db.execute_sql(
                "INSERT INTO tier_state (owner, tier, content_chars, entry_count, generation)"
                f" VALUES ({p}, {p}, {p}, 1, 1)",
                (owner, tier, len(content)),
            )
    store.close()


def test_rows_from_before_schema_10_have_no_writer_and_are_never_erased(
    make_sidecar: MakeSidecar, databases: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _schema_9_database(databases("old.db"), monkeypatch)
    running = make_sidecar(name="old.db")
    assert running.store.schema_version() == SCHEMA_VERSION
    assert rows(running, "SELECT id, written_for_user_id FROM memories ORDER BY id") == [
        ("old-note", None),
        ("old-profile", None),
    ]
    response = forget(running, erase=True)
    assert response.agent_notes_written_for_user == 0
    assert response.erasure.memories == 1  # the profile, by its owner
    assert notes(running) == [ADA_NOTE]


def test_erasing_them_needs_a_grant_that_reaches_every_agent_holding_one(
    make_sidecar: MakeSidecar, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.yaml"
    coder_only = {"agents": ["coder"], "users": ["ada"], "erase": True}
    write_tokens(
        tokens,
        [
            {"name": "dpo", "sha256": sha256("dpo-token"), "agents": ["*"], "users": ["*"]}
            | {"erase": True},
            {"name": "coder-eraser", "sha256": sha256("coder-token"), **coder_only},
        ],
    )
    running = make_sidecar(auth_tokens_file=str(tokens))
    dpo, coder = with_token("dpo-token"), with_token("coder-token")
    for agent in ("coder", "reviewer"):
        request = pb.AddMemoryRequest(
            scope=pb.Scope(agent_id=agent, user_id="ada"), content=ADA_NOTE
        )
        running.stub.AddMemory(request, metadata=dpo)
    ask = pb.ForgetUserRequest(user_id="ada", erase_agent_notes_written_for_user=True)
    error = refused(running.stub.ForgetUser, ask, metadata=coder, timeout=CALL_SECONDS)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert rows(running, "SELECT COUNT(*) FROM memories") == [(2,)]
    reported = running.stub.ForgetUser(pb.ForgetUserRequest(user_id="ada"), metadata=coder)
    assert (reported.agent_notes_written_for_user, reported.agent_notes_erased) == (2, False)
    erased = running.stub.ForgetUser(ask, metadata=dpo, timeout=CALL_SECONDS)
    assert (erased.agent_notes_written_for_user, erased.erasure.memories) == (2, 2)
