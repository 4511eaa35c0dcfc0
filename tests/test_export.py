"""ExportMemories: a scope's (or a user's) entries streamed as import's JSONL,
from one snapshot, resumable from a cursor, and `memory-sidecar export
--address` over it."""

from __future__ import annotations

import base64
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.core.memory import Memory, Scope, Tier
from sidecar.ops import cli
from sidecar.storage import archive
from sidecar.storage._backend import ROWS_PER_INSERT
from tests.conftest import (
    CALL_SECONDS,
    START_SECONDS,
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
UNLIMITED = "defaults: {memory_char_limit: 0, user_char_limit: 0}"


def exporting(running: Running, timeout: float = 60, **fields: Any) -> Any:
    """The stream of responses (read it, or cancel it)."""
    return running.stub.ExportMemories(pb.ExportMemoriesRequest(**fields), timeout=timeout)


def export(running: Running, **fields: Any) -> list[pb.ExportMemoriesResponse]:
    return list(exporting(running, **fields))


def parsed(responses: Iterable[pb.ExportMemoriesResponse]) -> list[tuple[str, Memory]]:
    text = "".join(response.jsonl for response in responses)
    return [archive.parse_line(n, line) for n, line in enumerate(text.splitlines(), start=1)]


def ids(responses: Iterable[pb.ExportMemoriesResponse]) -> list[str]:
    return [memory.id for _, memory in parsed(responses)]


def listed(
    running: Running, scope: pb.Scope, tier: pb.Tier = pb.TIER_UNSPECIFIED
) -> list[pb.Memory]:
    """Every entry GetMemories lists, page after page."""
    memories: list[pb.Memory] = []
    request = pb.GetMemoriesRequest(scope=scope, tier=tier, page_size=7)
    while True:
        page = running.stub.GetMemories(request, timeout=CALL_SECONDS)
        memories.extend(page.memories)
        if not page.next_page_token:
            return memories
        request.page_token = page.next_page_token


def seed(running: Running, count: int, chars: int, agent: str = "coder", user: str = "ada") -> None:
    """`count` entries of about `chars` characters, alternating the scope's
    two tiers, written in one bulk transaction (archive.restore)."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    entries = []
    for n in range(count):
        tier = Tier.MEMORY if n % 2 else Tier.USER
        moment = start + timedelta(seconds=n)
        content = f"entry {n} " + "lorem ipsum dolor " * (chars // 18)
        memory = Memory(str(uuid.uuid4()), tier, content, f"c{n % 3}", 0.5, moment, moment)
        entries.append((agent if tier is Tier.MEMORY else user, memory))
    inserted, _ = archive.restore(running.store, entries)
    assert inserted == count


def test_a_restore_leaves_out_ids_already_present_and_repeated(make_sidecar: MakeSidecar) -> None:
    # More entries than one batch of the restore's multi-row inserts.
    running = make_sidecar(UNLIMITED)
    kept = running.add("written before the restore", scope=SCOPE).memory
    moment = datetime(2026, 1, 1, tzinfo=UTC)
    count = 2 * ROWS_PER_INSERT + 3
    entries = [
        ("ada", Memory(f"r{n}", Tier.USER, f"restored {n}", "", 1.0, moment, moment))
        for n in range(count)
    ]
    again = Memory(kept.id, Tier.MEMORY, "a different content", "", 1.0, moment, moment)
    repeat = Memory("r7", Tier.USER, "r7 given twice", "", 1.0, moment, moment)
    entries[ROWS_PER_INSERT + 1 : ROWS_PER_INSERT + 1] = [("coder", again), ("ada", repeat)]
    # And one repeated within its batch.
    twice = Memory("r3", Tier.USER, "r3 given twice", "", 1.0, moment, moment)
    entries.insert(5, ("ada", twice))
    inserted, present = archive.restore(running.store, entries)
    assert (inserted, present) == (count, ["r3", kept.id, "r7"])
    stored = running.store.list_memories(Scope("coder", "ada"), [Tier.USER, Tier.MEMORY])[0]
    by_tier = {t: [m for m in stored if m.tier is t] for t in Tier}
    assert [m.id for m in by_tier[Tier.USER]] == [f"r{n}" for n in range(count)]
    assert [m.content for m in by_tier[Tier.USER] if m.id in ("r3", "r7")] == [
        "restored 3",
        "restored 7",
    ]
    assert [m.content for m in by_tier[Tier.MEMORY]] == [kept.content]
    usage = running.store.usage(Scope("coder", "ada"), [Tier.USER])[Tier.USER]
    assert usage.entry_count == count


def test_the_export_is_what_get_memories_lists(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    for n in range(9):
        running.add(f"note {n} with ünïcödé\nand a newline", scope=SCOPE, category=f"k{n % 2}")
        running.add(f"profile fact {n}", scope=SCOPE, tier=pb.TIER_USER, confidence=0.25)
    running.add("another agent's note", scope=pb.Scope(agent_id="writer", user_id="ada"))
    running.add(
        "another user's profile", scope=pb.Scope(agent_id="coder", user_id="bob"), tier=pb.TIER_USER
    )
    for tier in (pb.TIER_UNSPECIFIED, pb.TIER_MEMORY, pb.TIER_USER):
        responses = export(running, scope=SCOPE, tier=tier, batch_size=4)
        expected = listed(running, SCOPE, tier)
        exported = parsed(responses)
        assert len(exported) == len(expected) == {0: 18}.get(tier, 9)
        for (owner, memory), item in zip(exported, expected, strict=True):
            assert memory.id == item.id
            assert owner == (SCOPE.agent_id if item.tier == pb.TIER_MEMORY else SCOPE.user_id)
            assert (memory.content, memory.category) == (item.content, item.category)
            assert memory.confidence == pytest.approx(item.confidence)
            assert memory.created_at == item.created_at.ToDatetime(tzinfo=UTC)
            assert memory.updated_at == item.updated_at.ToDatetime(tzinfo=UTC)
        # Batches of at most batch_size; only the last says done.
        assert [r.count for r in responses] == [len(r.jsonl.splitlines()) for r in responses]
        assert all(0 < r.count <= 4 for r in responses)
        assert [r.done for r in responses] == [False] * (len(responses) - 1) + [True]
    # A scope with nothing: one empty, final response.
    (empty,) = export(running, scope=pb.Scope(agent_id="nobody", user_id="no one"))
    assert (empty.count, empty.jsonl, empty.done) == (0, "", True)


def test_the_jsonl_imports_into_a_fresh_database_unchanged(
    make_sidecar: MakeSidecar, databases: Callable[[str], str], tmp_path: Path
) -> None:
    running = make_sidecar(UNLIMITED)
    for n in range(5):
        running.add(f"note {n} ✓", scope=SCOPE, category="tooling", confidence=0.75)
        running.add(f"profile {n}", scope=SCOPE, tier=pb.TIER_USER)
    first = listed(running, SCOPE)[0]
    running.stub.UpdateMemory(pb.UpdateMemoryRequest(scope=SCOPE, id=first.id, content="edited"))
    dump = tmp_path / "scope.jsonl"
    dump.write_text("".join(r.jsonl for r in export(running, scope=SCOPE)))
    fresh = databases("fresh.db")
    assert cli.main(["import", str(dump), "--db", fresh], environ={}) == 0
    restored = make_sidecar(UNLIMITED, name="fresh.db")
    assert listed(restored, SCOPE) == listed(running, SCOPE)
    # And out again, byte for byte.
    assert "".join(r.jsonl for r in export(restored, scope=SCOPE)) == dump.read_text()


def test_for_user_exports_the_profile_whatever_the_agent(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    profile = [
        running.add("Ada prefers short answers", scope=SCOPE, tier=pb.TIER_USER).memory.id,
        running.add(
            "Ada writes Rust", scope=pb.Scope(agent_id="reviewer", user_id="ada"), tier=pb.TIER_USER
        ).memory.id,
    ]
    # Agent notes written while serving Ada: the agents', but Ada's data too.
    notes = [
        running.add("coder's note while serving Ada", scope=SCOPE).memory.id,
        running.add("the default agent's note", scope=pb.Scope(user_id="ada")).memory.id,
    ]
    running.add("coder's note while serving Bob", scope=pb.Scope(agent_id="coder", user_id="bob"))
    running.add("Bob's profile", scope=pb.Scope(agent_id="coder", user_id="bob"), tier=pb.TIER_USER)
    mine = pb.Scope(user_id="ada")
    for tier in (pb.TIER_UNSPECIFIED, pb.TIER_USER):
        responses = export(running, scope=mine, tier=tier, for_user=True)
        assert ids(responses) == profile + notes
        assert [owner for owner, _ in parsed(responses)] == ["ada", "ada", "coder", ""]
    error = refused(export, running, scope=SCOPE, for_user=True)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(error).reason == "FOR_USER_WITH_AGENT"
    error = refused(export, running, scope=mine, tier=pb.TIER_MEMORY, for_user=True)
    assert error_info(error).reason == "FOR_USER_TIER"


def test_writes_made_during_a_stream_are_not_in_it(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    # Megabytes: far more than the transport buffers, so the daemon cannot
    # have read ahead to the end when the writes below land.
    seed(running, 1200, 4000)
    before = listed(running, SCOPE)
    last, second_last = before[-1], before[-2]
    stream = exporting(running, scope=SCOPE, batch_size=10)
    first = next(stream)
    assert first.count == 10
    assert not first.done
    added = running.add("written mid-export", scope=SCOPE).memory.id
    running.stub.DeleteMemory(pb.DeleteMemoryRequest(scope=SCOPE, id=last.id), timeout=CALL_SECONDS)
    running.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=SCOPE, id=second_last.id, content="changed mid-export"),
        timeout=CALL_SECONDS,
    )
    exported = parsed([first, *stream])
    assert [m.id for _, m in exported] == [m.id for m in before]
    assert [m.content for _, m in exported[-2:]] == [second_last.content, last.content]
    # A resume is a new snapshot from the cursor on: it sees the writes.
    resumed = parsed(export(running, scope=SCOPE, cursor=first.cursor))
    assert [m.id for _, m in resumed][-1] == added
    assert last.id not in {m.id for _, m in resumed}
    assert resumed[-2][1].content == "changed mid-export"


def test_a_resumed_export_has_no_duplicate_and_misses_nothing(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    seed(running, 40, 50)
    whole = ids(export(running, scope=SCOPE))
    assert len(whole) == len(set(whole)) == 40
    stream = exporting(running, scope=SCOPE, batch_size=3)
    received = [next(stream), next(stream)]
    stream.cancel()  # a cut connection
    rest = export(running, scope=SCOPE, batch_size=5, cursor=received[-1].cursor)
    assert ids(received) + ids(rest) == whole
    # A cursor from the very last response: nothing more, and done.
    (end,) = export(running, scope=SCOPE, cursor=rest[-1].cursor)
    assert (end.count, end.done) == (0, True)


def test_a_bad_cursor_or_batch_size_is_refused(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    seed(running, 6, 50)
    cursor = export(running, scope=SCOPE, batch_size=2)[0].cursor
    other = pb.Scope(agent_id="writer", user_id="ada")
    for fields in (
        {"scope": SCOPE, "cursor": "not a cursor"},
        {"scope": SCOPE, "cursor": cursor[:-2]},
        {"scope": SCOPE, "cursor": "x" * 5000},
        {"scope": other, "cursor": cursor},
        {"scope": SCOPE, "tier": pb.TIER_USER, "cursor": cursor},
        {"scope": pb.Scope(user_id="ada"), "for_user": True, "cursor": cursor},
    ):
        error = refused(export, running, **fields)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert error_info(error).reason == "CURSOR_INVALID", fields
        assert "cursor" in (error.details() or "")
    # A cursor with its position changed (decoded, edited, encoded again).
    fields = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    fields[3] = 1
    edited = base64.urlsafe_b64encode(json.dumps(fields).encode()).decode()
    error = refused(export, running, scope=SCOPE, cursor=edited)
    assert error_info(error).reason == "CURSOR_INVALID"
    assert "did not issue" in (error.details() or "") or "issued" in (error.details() or "")
    error = refused(export, running, scope=SCOPE, batch_size=-1)
    assert error_info(error).reason == "BATCH_SIZE_OUT_OF_RANGE"
    error = refused(export, running, scope=SCOPE, tier=7)
    assert error_info(error).reason == "TIER_UNKNOWN"
    # Over the cap is the cap, not an error.
    assert len(export(running, scope=SCOPE, batch_size=10**6)) == 1


def test_responses_stay_under_the_response_limit(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED, max_response_bytes=64 * 1024)
    seed(running, 60, 4000)
    responses = export(running, scope=SCOPE, batch_size=1000)
    assert all(r.ByteSize() <= 64 * 1024 for r in responses)
    assert len(responses) > 1
    assert len(ids(responses)) == 60


def _connections_in_use(running: Running) -> int:
    return len(running.store.tables.backend.db._in_use)


def test_a_cancelled_export_lets_go_of_its_slot_and_connection(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED, max_concurrent_exports=1)
    seed(running, 1200, 4000)
    stream = exporting(running, scope=SCOPE, batch_size=10)
    next(stream)
    exports = running.sidecar.engine.inside().exports
    assert exports.running == 1
    assert _connections_in_use(running) == 1
    error = refused(export, running, scope=SCOPE)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (error_info(error).reason, error_info(error).metadata["max"]) == ("EXPORTS_BUSY", "1")
    stream.cancel()
    # The daemon notices the cancel at its next send; wait for it, bounded.
    eventually(
        lambda: (exports.running, _connections_in_use(running)) == (0, 0),
        "the export lets go of its slot and connection",
        pause=0.02,
    )
    assert len(ids(export(running, scope=SCOPE))) == 1200


def test_stopping_the_daemon_mid_export_ends_the_stream_first(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    seed(running, 1200, 4000)
    stream = exporting(running, scope=SCOPE, batch_size=10)
    received = [next(stream)]
    running.sidecar.stop(grace=0.2)
    # stop() returned: no export reads any more, so the store may close.
    assert running.sidecar.engine.inside().exports.running == 0
    assert _connections_in_use(running) == 0
    with pytest.raises(grpc.RpcError) as cut:
        received.extend(stream)
    assert cut.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert 10 <= len(ids(received)) < 1200


def test_stopping_says_when_an_export_outlives_the_drain(
    make_sidecar: MakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    running = make_sidecar(UNLIMITED)
    # A stream stuck in a read: its slot is never let go of.
    with running.sidecar.engine.inside().exports.slot(), caplog.at_level(logging.WARNING):
        running.sidecar.stop(grace=0)
    assert "1 ExportMemories streams still read the store" in caplog.text


def test_permission_follows_the_grant(make_sidecar: MakeSidecar, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    (tmp_path / "ada").write_text("token-of-coder-for-ada")
    (tmp_path / "admin").write_text("token-of-the-operator")
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {"token_file": "ada", "agents": ["coder"], "users": ["ada"]},
                    {"token_file": "admin", "agents": ["*"], "users": ["*"]},
                ]
            }
        )
    )
    running = make_sidecar(UNLIMITED, auth_tokens_file=str(tokens))

    def as_(token: str, **fields: Any) -> list[pb.ExportMemoriesResponse]:
        metadata = (("authorization", f"Bearer {token}"),)
        request = pb.ExportMemoriesRequest(**fields)
        return list(running.stub.ExportMemories(request, metadata=metadata, timeout=CALL_SECONDS))

    admin, ada = "token-of-the-operator", "token-of-coder-for-ada"
    as_(admin)  # the operator may export anything
    for scope in (pb.Scope(agent_id="reviewer", user_id="ada"), pb.Scope(agent_id="coder")):
        error = refused(as_, ada, scope=scope)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_info(error).reason == "SCOPE_FORBIDDEN"
    assert as_(ada, scope=SCOPE)[-1].done
    # for_user checks the users a token lists: its agents may read that
    # profile already, whichever agent wrote to it.
    assert as_(ada, scope=pb.Scope(user_id="ada"), for_user=True)[-1].done
    error = refused(as_, ada, scope=pb.Scope(user_id="bob"), for_user=True)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert dict(error_info(error).metadata)["field"] == "scope.user_id"
    error = refused(as_, "no such token", scope=SCOPE)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_cli_exports_through_the_daemon(
    make_sidecar: MakeSidecar, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    running = make_sidecar(UNLIMITED)
    seed(running, 30, 100)
    running.add("another agent's note", scope=pb.Scope(agent_id="writer"))
    address = ["--address", running.addresses.api]
    online = tmp_path / "online.jsonl"
    scope = ["--agent-id", "coder", "--user-id", "ada"]
    assert cli.main(["export", str(online), *address, *scope], environ={}) == 0
    assert "exported 30 memories" in capsys.readouterr().out
    assert online.read_text() == "".join(r.jsonl for r in export(running, scope=SCOPE))
    offline = tmp_path / "offline.jsonl"
    assert cli.main(["export", str(offline), "--db", running.db], environ={}) == 0
    assert offline.read_text().startswith(online.read_text())
    # To standard output, one user's profile.
    capsys.readouterr()
    assert cli.main(["export", *address, "--for-user", "ada"], environ={}) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 15
    assert {owner for owner, _ in parsed([pb.ExportMemoriesResponse(jsonl=out)])} == {"ada"}
    # A refusal is the daemon's answer, said once.
    code = cli.main(["export", *address, "--for-user", "ada", "--agent-id", "x"], environ={})
    assert code == 1
    assert "FOR_USER_WITH_AGENT" in capsys.readouterr().err


def test_the_cli_waits_for_a_busy_slot_and_resumes(
    make_sidecar: MakeSidecar, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Right after a cut the old stream may still hold its slot: the CLI
    # backs off and tries again instead of failing with EXPORTS_BUSY.
    running = make_sidecar(UNLIMITED, max_concurrent_exports=1)
    seed(running, 30, 100)
    holder = exporting(running, scope=SCOPE, batch_size=1)
    next(holder)
    registry = running.sidecar.metrics.registry
    busy = {
        "grpc_type": "server_stream",
        "grpc_service": "memory.v1.MemoryService",
        "grpc_method": "ExportMemories",
        "grpc_code": "ResourceExhausted",
    }
    out = tmp_path / "out.jsonl"
    address = ["--address", running.addresses.api, "--agent-id", "coder", "--user-id", "ada"]
    codes: list[int] = []
    command = threading.Thread(
        target=lambda: codes.append(cli.main(["export", str(out), *address], environ={}))
    )
    command.start()
    # Released only once the CLI was refused (a liveness bound).

    def refused_once() -> bool:
        if registry.get_sample_value("grpc_server_handled_total", busy):
            return True
        assert command.is_alive(), capsys.readouterr().err
        return False

    eventually(refused_once, "the CLI meets the busy slot", pause=0.02)
    holder.cancel()
    command.join(timeout=WAIT_SECONDS)
    assert codes == [0], capsys.readouterr().err
    assert out.read_text() == "".join(r.jsonl for r in export(running, scope=SCOPE))


def test_the_cli_sends_its_token_on_the_stream(
    make_sidecar: MakeSidecar, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-of-the-operator\n")
    running = make_sidecar(UNLIMITED, auth_token_file=str(token))
    metadata = (("authorization", "Bearer a-token-of-the-operator"),)
    request = pb.AddMemoryRequest(scope=SCOPE, content="behind a token")
    running.stub.AddMemory(request, metadata=metadata, timeout=CALL_SECONDS)
    address = ["--address", running.addresses.api, "--agent-id", "coder", "--user-id", "ada"]
    assert cli.main(["export", *address, "--token-file", str(token)], environ={}) == 0
    assert "behind a token" in capsys.readouterr().out
    assert cli.main(["export", *address], environ={}) == 1
    assert "TOKEN_MISSING" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_cli_resumes_after_the_daemon_is_killed_mid_export(
    databases: Callable[[str], str], tmp_path: Path
) -> None:
    db = databases("memory.db")
    start = datetime(2026, 1, 1, tzinfo=UTC)
    source = tmp_path / "seed.jsonl"
    with source.open("w") as out:
        for n in range(3000):
            tier = Tier.MEMORY if n % 2 else Tier.USER
            moment = start + timedelta(seconds=n)
            memory = Memory(f"m{n}", tier, f"entry {n} " + "x" * 2000, "", 1.0, moment, moment)
            out.write(archive.export_line("coder" if n % 2 else "ada", memory) + "\n")
    assert cli.main(["import", str(source), "--db", db], environ={}) == 0
    listen = f"127.0.0.1:{_free_port()}"
    args = ("--db", db, "--listen", listen, "--grace-seconds", "0")
    daemon = spawn_daemon(*args)
    restarted = None
    try:
        command = [sys.executable, "-m", "sidecar", "export", "--address", listen]
        command += ["--agent-id", "coder", "--user-id", "ada", "--timeout", "30"]
        errors = (tmp_path / "stderr").open("w")
        export_cli = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
        assert export_cli.stdout is not None
        # Reading nothing more, the pipe (and then the stream) fills: the
        # CLI is mid-export when the daemon dies.
        head = export_cli.stdout.readline()
        assert head.startswith('{"id": "m0"')
        daemon.process.send_signal(signal.SIGKILL)
        daemon.wait()
        restarted = spawn_daemon(*args)
        # Not communicate(): it reads the pipe's descriptor, past what
        # readline() buffered.
        tail = export_cli.stdout.read()
        export_cli.stdout.close()
        assert export_cli.wait(timeout=START_SECONDS) == 0, (tmp_path / "stderr").read_text()
    finally:
        errors.close()
        daemon.close()
        if restarted is not None:
            restarted.close()
    lines = (head + tail).splitlines()
    assert len(lines) == len(set(lines)) == 3000
    assert (head + tail) == source.read_text()
