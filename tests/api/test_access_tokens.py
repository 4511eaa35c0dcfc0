"""Per-agent tokens: a token addresses only the agents and users it lists."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.api.access import Grant, TokensFile, parse_tokens
from sidecar.api.service import SERVICE_NAME
from sidecar.config import settings
from sidecar.core.errors import ConfigError
from sidecar.core.memory import Scope
from tests.api.test_access import TOKEN, with_token
from tests.conftest import (
    CALL_SECONDS,
    ROOT,
    MakeSidecar,
    Running,
    contents,
    error_info,
    eventually,
    refused,
    run_sidecar,
)

AGENT_A = "token-of-agent-a"
ADA = "token-of-coder-for-ada"
ADMIN = "token-of-the-operator"


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def write_tokens(path: Path, entries: list[dict[str, Any]]) -> None:
    path.write_text(yaml.safe_dump({"tokens": entries}))


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    """Three tokens, in each of the ways a tokens file can give one."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "agent-a").write_text(AGENT_A + "\n")
    (secrets / "admin").write_text(ADMIN)
    path = secrets / "tokens.yaml"
    write_tokens(
        path,
        [
            # Relative: next to the tokens file, as in one mounted Secret.
            {"token_file": "agent-a", "agents": ["agent-a"], "users": ["*"]},
            {"sha256": sha256(ADA), "agents": ["coder"], "users": ["ada"]},
            {"token_file": str(secrets / "admin"), "agents": ["*"], "users": ["*"]},
        ],
    )
    return path


def requests(scope: pb.Scope, memory_id: str) -> dict[str, Any]:
    """One request of every RPC, in `scope`."""
    return {
        "AddMemory": pb.AddMemoryRequest(scope=scope, content="sneaked in"),
        "UpdateMemory": pb.UpdateMemoryRequest(scope=scope, id=memory_id, content="overwritten"),
        "GetMemories": pb.GetMemoriesRequest(scope=scope),
        "SearchMemories": pb.SearchMemoriesRequest(scope=scope, query="secret"),
        "InjectForTurn": pb.InjectForTurnRequest(
            scope=scope, session_id="s1", user_message="secret"
        ),
        "NotifyCompaction": pb.NotifyCompactionRequest(scope=scope, session_id="s1"),
        "EndSession": pb.EndSessionRequest(scope=scope, session_id="s1"),
        "ListTools": pb.ListToolsRequest(scope=scope),
        "CallTool": pb.CallToolRequest(
            scope=scope,
            session_id="s1",
            name="memory",
            arguments_json='{"action": "add", "content": "sneaked in by a tool"}',
        ),
        "ExportMemories": pb.ExportMemoriesRequest(scope=scope),
        "WatchMemories": pb.WatchMemoriesRequest(scope=scope),
        "DeleteMemory": pb.DeleteMemoryRequest(scope=scope, id=memory_id),
        # Only grants with `erase` (tests/test_erasure.py); refused before the scope.
        "ForgetUser": pb.ForgetUserRequest(user_id=scope.user_id),
        "DeleteScope": pb.DeleteScopeRequest(scope=scope),
    }


_STREAMS = {
    m.name for m in pb.DESCRIPTOR.services_by_name["MemoryService"].methods if m.server_streaming
}

# RPCs only an erase grant may call: the tokens here have none.
ERASING = {"ForgetUser", "DeleteScope"}


def call(running: Running, method: str, request: Any, token: str) -> Any:
    response = getattr(running.stub, method)(
        request, metadata=with_token(token), timeout=CALL_SECONDS
    )
    if method not in _STREAMS:
        return response
    # A stream is refused (or not) at its first response.
    try:
        return next(response)
    finally:
        response.cancel()


def _code(function: Any, *args: Any) -> grpc.StatusCode | None:
    """The status code a call fails with, None when it succeeds."""
    try:
        function(*args)
    except grpc.RpcError as error:
        return error.code()
    return None


# The server-streaming RPCs: the interceptors carry the grant into each step
# of the stream (sidecar.api.interceptors._granting). Every other RPC is unary.
STREAMING = {"ExportMemories", "WatchMemories"}


def test_every_rpc_is_covered_and_unary_or_server_streaming() -> None:
    # The interceptors hand the grant to unary and server-streaming handlers
    # only: a client-streaming RPC would need it too, and this test (and
    # `requests`) to cover it.
    service = pb.DESCRIPTOR.services_by_name["MemoryService"]
    assert service.full_name == SERVICE_NAME
    assert {m.name for m in service.methods} == set(requests(pb.Scope(), "")) | STREAMING
    for method in service.methods:
        assert not method.client_streaming, method.name
        assert method.server_streaming == (method.name in STREAMING), method.name


def test_a_token_addresses_its_own_agents_scopes(
    make_sidecar: MakeSidecar, tokens_file: Path
) -> None:
    running = make_sidecar(auth_tokens_file=str(tokens_file))
    scope = pb.Scope(agent_id="agent-a", user_id="anyone")
    added = call(
        running,
        "AddMemory",
        pb.AddMemoryRequest(scope=scope, content="The secret deploy is on Fridays"),
        AGENT_A,
    )
    assert added.created
    turn = call(
        running,
        "InjectForTurn",
        pb.InjectForTurnRequest(scope=scope, session_id="s2", user_message="deploy"),
        AGENT_A,
    )
    assert "The secret deploy is on Fridays" in turn.system_block
    for method, request in requests(scope, added.memory.id).items():
        if method in ERASING:
            error = refused(call, running, method, request, AGENT_A)
            assert error_info(error).reason == "ERASE_NOT_GRANTED", method
            continue
        call(running, method, request, AGENT_A)  # none refused, the delete last
    assert sorted(contents(running, scope, token=ADMIN)) == ["sneaked in", "sneaked in by a tool"]
    # Any user: "*".
    call(running, "GetMemories", pb.GetMemoriesRequest(scope=pb.Scope(agent_id="agent-a")), AGENT_A)


def test_another_agents_scope_is_forbidden_and_nothing_changes(
    make_sidecar: MakeSidecar, tokens_file: Path
) -> None:
    running = make_sidecar(auth_tokens_file=str(tokens_file))
    theirs = pb.Scope(agent_id="agent-b", user_id="bob")
    seeded = call(
        running, "AddMemory", pb.AddMemoryRequest(scope=theirs, content="agent-b's secret"), ADMIN
    )
    call(
        running,
        "AddMemory",
        pb.AddMemoryRequest(scope=theirs, tier=pb.TIER_USER, content="Bob's secret"),
        ADMIN,
    )
    before = contents(running, theirs, token=ADMIN)
    for method, request in requests(theirs, seeded.memory.id).items():
        error = refused(call, running, method, request, AGENT_A)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, method
        info = error_info(error)
        if method in ERASING:
            assert info.reason == "ERASE_NOT_GRANTED", method
            continue
        assert info.reason == "SCOPE_FORBIDDEN", method
        assert dict(info.metadata) == {
            "field": "scope.agent_id",
            "agent_id": "agent-b",
            "user_id": "bob",
        }
        assert "agent_id 'agent-b'" in (error.details() or "")
    assert contents(running, theirs, token=ADMIN) == before
    # Its id used from an allowed scope is still only "not found".
    mine = pb.Scope(agent_id="agent-a", user_id="bob")
    error = refused(
        call, running, "DeleteMemory", requests(mine, seeded.memory.id)["DeleteMemory"], AGENT_A
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_a_token_limited_to_users_addresses_only_them(
    make_sidecar: MakeSidecar, tokens_file: Path
) -> None:
    running = make_sidecar(auth_tokens_file=str(tokens_file))
    ada = pb.Scope(agent_id="coder", user_id="ada")
    call(
        running,
        "AddMemory",
        pb.AddMemoryRequest(scope=ada, tier=pb.TIER_USER, content="Ada prefers short answers"),
        ADA,
    )
    assert contents(running, ada, token=ADMIN) == ["Ada prefers short answers"]
    bob = pb.Scope(agent_id="coder", user_id="bob")
    # The default (empty) user is a user like any other: not listed, not allowed.
    for scope in (bob, pb.Scope(agent_id="coder")):
        error = refused(
            call,
            running,
            "AddMemory",
            pb.AddMemoryRequest(scope=scope, tier=pb.TIER_USER, content="x"),
            ADA,
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        info = error_info(error)
        assert (info.reason, info.metadata["field"]) == ("SCOPE_FORBIDDEN", "scope.user_id")
        assert info.metadata["user_id"] == scope.user_id
        assert contents(running, scope, token=ADMIN) == []
    other_agent = pb.Scope(agent_id="reviewer", user_id="ada")
    error = refused(call, running, "GetMemories", pb.GetMemoriesRequest(scope=other_agent), ADA)
    assert error_info(error).metadata["field"] == "scope.agent_id"


def test_unknown_tokens_are_unauthenticated(make_sidecar: MakeSidecar, tokens_file: Path) -> None:
    running = make_sidecar(auth_tokens_file=str(tokens_file))
    request = pb.GetMemoriesRequest(scope=pb.Scope(agent_id="agent-a"))
    for token in ("not-a-token", AGENT_A[:-1], sha256(ADA), TOKEN):
        error = refused(call, running, "GetMemories", request, token)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error_info(error).reason == "TOKEN_INVALID"
    missing = refused(running.stub.GetMemories, request, timeout=CALL_SECONDS)
    assert error_info(missing).reason == "TOKEN_MISSING"


def test_the_single_token_file_still_addresses_every_scope(
    make_sidecar: MakeSidecar, tokens_file: Path, tmp_path: Path
) -> None:
    single = tmp_path / "token"
    single.write_text(TOKEN + "\n")
    running = make_sidecar(auth_token_file=str(single), auth_tokens_file=str(tokens_file))
    for agent in ("agent-a", "agent-b"):
        scope = pb.Scope(agent_id=agent, user_id="bob")
        call(running, "AddMemory", pb.AddMemoryRequest(scope=scope, content=f"{agent} note"), TOKEN)
    assert contents(running, pb.Scope(agent_id="agent-b"), token=ADMIN) == ["agent-b note"]
    error = refused(
        call,
        running,
        "GetMemories",
        pb.GetMemoriesRequest(scope=pb.Scope(agent_id="agent-b")),
        AGENT_A,
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_rewritten_tokens_file_takes_effect_and_a_broken_one_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar")
    path = tmp_path / "tokens.yaml"
    (tmp_path / "agent-a").write_text("first")
    write_tokens(path, [{"token_file": "agent-a", "agents": ["agent-a"], "users": ["*"]}])
    tokens = TokensFile(str(path))
    only_a = Grant(agents=frozenset({"agent-a"}))
    assert tokens.grant(b"first") == only_a
    assert tokens.grant(b"second") is None

    # The Secret behind token_file rotated (a new file behind the name).
    replacement = tmp_path / "agent-a.new"
    replacement.write_text("second\n")
    os.replace(replacement, tmp_path / "agent-a")
    assert tokens.grant(b"first") == only_a  # read only by reload (the watcher's)
    tokens.reload()
    assert (tokens.grant(b"first"), tokens.grant(b"second")) == (None, only_a)

    # The grant changed: now agent-b too, and only for ada.
    write_tokens(
        path,
        [{"token_file": "agent-a", "agents": ["agent-a", "agent-b"], "users": ["ada"]}],
    )
    tokens.reload()
    assert tokens.grant(b"second") == Grant(frozenset({"agent-a", "agent-b"}), frozenset({"ada"}))
    assert "auth tokens file changed; using its 1 token" in caplog.text

    # Caught mid-rewrite, or broken: the last good set stays, logged once.
    caplog.clear()
    path.write_text("tokens: [")
    for _ in range(3):
        tokens.reload()
        assert tokens.grant(b"second") is not None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "not valid YAML" in warnings[0].getMessage()
    assert "keeping the last good tokens" in warnings[0].getMessage()
    path.unlink()
    tokens.reload()
    assert tokens.grant(b"second") is not None
    assert "cannot read" in caplog.text


def test_a_running_daemon_follows_its_tokens_file(
    make_sidecar: MakeSidecar, tokens_file: Path
) -> None:
    running = make_sidecar(auth_tokens_file=str(tokens_file))
    theirs = pb.GetMemoriesRequest(scope=pb.Scope(agent_id="agent-b"))
    assert refused(call, running, "GetMemories", theirs, AGENT_A).code() == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    write_tokens(
        tokens_file,
        [
            {"token_file": "agent-a", "agents": ["agent-a", "agent-b"], "users": ["*"]},
            {"token_file": "admin", "agents": ["*"], "users": ["*"]},
        ],
    )
    # Re-read every auth_reload_seconds (1 s) by the watcher.

    def granted() -> bool:
        code = _code(call, running, "GetMemories", theirs, AGENT_A)
        assert code in (None, grpc.StatusCode.PERMISSION_DENIED)
        return code is None

    eventually(granted, "the rewritten tokens file is re-read", pause=0.1)
    # The token it dropped is gone.
    error = refused(call, running, "GetMemories", theirs, ADA)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ("", "tokens: the file holds one key"),
        ("tokens: [", "not valid YAML"),
        ("tokens: []", "tokens: must be a non-empty list"),
        ("tokens: [{sha256: 'ab', agents: [a], users: ['*']}]", "tokens[0].sha256: must be 64"),
        ("tokens: [{token_file: t, agents: [a]}]", "tokens[0].users: required"),
        ("tokens: [{token_file: t, users: ['*']}]", "tokens[0].agents: required"),
        ("tokens: [{token_file: t, agents: a, users: ['*']}]", "tokens[0].agents: must be a"),
        ("tokens: [{token_file: t, agents: [], users: ['*']}]", "tokens[0].agents: must be a"),
        ("tokens: [{token_file: t, agents: [7], users: ['*']}]", "ids are strings"),
        ("tokens: [{token_file: t, agents: ['*', a], users: ['*']}]", "stands alone"),
        ("tokens: [{token_file: t, agent: [a], users: ['*']}]", "tokens[0].agent: unknown key"),
        ("tokens: [{agents: [a], users: ['*']}]", "tokens[0]: give the token as exactly one"),
        (
            "tokens: [{token_file: absent, agents: [a], users: ['*']}]",
            "tokens[0].token_file: cannot",
        ),
        ("tokens: [{token_file: empty, agents: [a], users: ['*']}]", "tokens[0].token_file: "),
        (
            "tokens: [{token_file: t, agents: [a], users: ['*']},"
            " {sha256: '" + sha256("tok") + "', agents: [b], users: ['*']}]",
            "tokens[1]: the same token as tokens[0]",
        ),
    ],
)
def test_an_invalid_tokens_file_is_a_config_error_naming_the_field(
    tmp_path: Path, document: str, named: str
) -> None:
    (tmp_path / "t").write_text("tok\n")
    (tmp_path / "empty").write_text("\n")
    path = tmp_path / "tokens.yaml"
    path.write_text(document)
    with pytest.raises(ConfigError) as raised:
        TokensFile(str(path))
    assert raised.value.key == "server.auth_tokens_file"
    assert named in raised.value.message


def test_the_daemon_does_not_start_on_an_invalid_tokens_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("tokens: [{sha256: nope, agents: [a], users: ['*']}]")
    result = run_sidecar(
        "serve",
        "--db",
        str(tmp_path / "m.db"),
        "--listen",
        "127.0.0.1:0",
        "--auth-tokens-file",
        str(path),
    )
    assert result.returncode == 1
    assert "server.auth_tokens_file:" in result.stderr
    assert "tokens[0].sha256: must be 64 hex digits" in result.stderr


def test_a_tokens_file_alone_guards_a_non_loopback_listener() -> None:
    flags = {"listen": "0.0.0.0:50051", "auth_tokens_file": "tokens.yaml"}
    assert settings.load(environ={}, flags=flags).server.auth_tokens_file == "tokens.yaml"
    with pytest.raises(ConfigError, match="auth_tokens_file"):
        settings.load(environ={}, flags={"listen": "0.0.0.0:50051"})


def test_grants_check_both_ids() -> None:
    grant = Grant(frozenset({"coder"}), frozenset({"ada", ""}))
    assert grant.refusal(Scope("coder", "ada")) is None
    assert grant.refusal(Scope("coder")) is None
    assert grant.refusal(Scope("coder", "bob")) is not None
    assert grant.refusal(Scope("", "ada")) is not None
    assert Grant().refusal(Scope("anyone", "anybody")) is None


def test_the_readme_example_is_a_valid_tokens_file() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.partition("### Per-agent tokens")[2]
    example = section.partition("```yaml\n")[2].partition("```")[0]
    entries = parse_tokens(example, Path("/run/secrets"))
    assert [entry.grant for entry in entries] == [
        Grant(agents=frozenset({"agent-a"})),
        Grant(frozenset({"reviewer"}), frozenset({"ada", ""})),
    ]


def test_removing_one_tokens_file_revokes_it_and_the_others_still_rotate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens.yaml"
    (tmp_path / "a").write_text("token-a")
    (tmp_path / "b").write_text("token-b")
    write_tokens(
        path,
        [
            {"token_file": "a", "agents": ["agent-a"], "users": ["*"]},
            {"token_file": "b", "agents": ["agent-b"], "users": ["*"]},
        ],
    )
    tokens = TokensFile(str(path))
    assert tokens.grant(b"token-b") is not None
    (tmp_path / "b").unlink()  # revoked
    (tmp_path / "a").write_text("token-a2")  # rotated
    tokens.reload()
    assert tokens.grant(b"token-b") is None
    assert tokens.grant(b"token-a2") == Grant(agents=frozenset({"agent-a"}))
    assert tokens.grant(b"token-a") is None
    assert "tokens[1].token_file" in caplog.text


def test_a_token_in_both_files_keeps_the_tokens_files_limits(
    make_sidecar: MakeSidecar, tmp_path: Path
) -> None:
    single = tmp_path / "token"
    single.write_text(AGENT_A)
    path = tmp_path / "both.yaml"
    write_tokens(path, [{"sha256": sha256(AGENT_A), "agents": ["agent-a"], "users": ["*"]}])
    running = make_sidecar(auth_token_file=str(single), auth_tokens_file=str(path))
    other = pb.Scope(agent_id="agent-b")
    request = pb.AddMemoryRequest(scope=other, content="not yours")
    assert _code(call, running, "AddMemory", request, AGENT_A) == grpc.StatusCode.PERMISSION_DENIED


def test_sessions_are_per_user_too(sidecar: Running) -> None:
    ada = pb.Scope(agent_id="coder", user_id="ada")
    bob = pb.Scope(agent_id="coder", user_id="bob")
    sidecar.turn("s", "hello", scope=ada)
    assert sidecar.turn("s", "hello", scope=ada).cache_hit
    # bob's token may address (coder, bob): the same session id names bob's
    # session, never ada's.
    invalidated = sidecar.stub.NotifyCompaction(
        pb.NotifyCompactionRequest(session_id="s", scope=bob), timeout=CALL_SECONDS
    )
    assert not invalidated.invalidated
    ended = sidecar.stub.EndSession(
        pb.EndSessionRequest(session_id="s", scope=bob), timeout=CALL_SECONDS
    )
    assert not ended.dropped
    assert sidecar.turn("s", "hello", scope=ada).cache_hit
