"""`memory-sidecar mcp`: MCP over stdio, bridged to a running daemon, driven
by the official MCP SDK's own stdio client spawning the command as an MCP
client application does.

The bridge answers as the daemon's own listener does (tests/api/test_mcp_http.py),
writes go through the daemon (its frozen-block rules, its token grants), and
the scope is the command line's.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, MCPError, StdioServerParameters

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.api.test_access_tokens import ADMIN, tokens_file  # noqa: F401 (a fixture)
from tests.api.test_mcp_http import (
    MODES,
    SCOPE,
    no_empty_text,
    refused_connection,
    run,
    text_of,
)
from tests.conftest import (
    ROOT,
    START_SECONDS,
    MakeSidecar,
    contents,
    run_sidecar,
)

FROZEN = "memory://frozen-block"


@contextlib.asynccontextmanager
async def bridge(
    api: str, *flags: str, mode: str = "auto", agent: str = "coder", user: str = "ada"
) -> AsyncIterator[Client]:
    """The SDK's Client over its stdio transport, spawning `python -m sidecar mcp`."""
    command = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "sidecar",
            "mcp",
            "--address",
            api,
            "--agent-id",
            agent,
            "--user-id",
            user,
            *flags,
        ],
        env={"PYTHONPATH": str(ROOT)},
    )
    async with Client(command, mode=mode) as client:
        yield client


@pytest.mark.parametrize("mode", MODES)
def test_the_tools_act_in_the_daemon_in_the_command_lines_scope(
    make_sidecar: MakeSidecar, mode: str
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 60}\n")
    other = pb.Scope(agent_id="other")

    async def body() -> list[Any]:
        async with bridge(running.addresses.api, mode=mode) as client:
            listed = (await client.list_tools()).tools
            return [
                listed,
                await client.call_tool("memory", {"action": "add", "content": "Builds use uv"}),
                await client.call_tool("memory_search", {"query": "builds"}),
                await client.call_tool(
                    "memory", {"action": "add", "content": "planted", "agent_id": "other"}
                ),
                await client.call_tool("memory", {"action": "add", "content": "x" * 50}),
            ]

    listed, added, search, planted, full = run(body)
    grpc_tools = running.stub.ListTools(pb.ListToolsRequest(scope=SCOPE)).tools
    assert [(t.name, t.description) for t in listed] == [
        (t.name, t.description) for t in grpc_tools
    ]
    assert not added.is_error
    assert added.structured_content["memory"]["content"] == "Builds use uv"
    assert [h["content"] for h in search.structured_content["hits"]] == ["Builds use uv"]
    assert planted.is_error
    assert "set by the connection, not by arguments" in planted.content[0].text
    assert full.is_error
    assert full.content[0].text.startswith("Not saved: agent notes (target=memory) is full [")
    assert "1. (13 chars) Builds use uv" in full.content[0].text
    assert contents(running, SCOPE) == ["Builds use uv"]
    assert contents(running, other) == []


def test_writes_through_the_bridge_refresh_frozen_blocks_as_grpc_writes_do(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar()
    running.add("The API is gRPC", scope=SCOPE)
    before = running.turn("s1", scope=SCOPE)

    async def body() -> tuple[str, str, str]:
        async with bridge(running.addresses.api, "--session-id", "s1") as client:
            shown = text_of((await client.read_resource(FROZEN)).contents[0])
            await client.call_tool("memory", {"action": "add", "content": "MCP is served too"})
            refreshed = text_of((await client.read_resource(FROZEN)).contents[0])
            prompt = await client.get_prompt("memory_context", {"user_message": "which API?"})
            return shown, refreshed, "".join(no_empty_text(prompt))

    shown, refreshed, turn = run(body)
    assert shown == before.system_block
    after = running.turn("s1", "which API?", scope=SCOPE)
    assert "MCP is served too" in after.system_block
    assert refreshed == after.system_block
    assert turn == after.turn_context


@pytest.mark.parametrize(
    "stored", [[], ["Deploys run from ops/deploy.sh"]], ids=["empty", "stored"]
)
def test_with_nothing_to_add_the_prompt_has_no_message(
    make_sidecar: MakeSidecar, stored: list[str]
) -> None:
    # As the daemon's own listener answers (tests/api/test_mcp_http.py).
    running = make_sidecar("defaults: {inject_system_block: false}\n")
    for content in stored:
        running.add(content, scope=SCOPE)
    message = "What is the weather like?"

    async def body() -> Any:
        async with bridge(running.addresses.api, "--session-id", "s1") as client:
            return await client.get_prompt("memory_context", {"user_message": message})

    prompt = run(body)
    assert running.turn("s1", message, scope=SCOPE).turn_context == ""
    assert no_empty_text(prompt) == []
    assert prompt.description == "No memories to add for this message"


def test_under_on_compaction_the_block_waits_for_notify_compaction(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {snapshot_refresh: on_compaction}\n")
    running.add("The API is gRPC", scope=SCOPE)
    before = running.turn("s1", scope=SCOPE)

    async def body() -> str:
        async with bridge(running.addresses.api, "--session-id", "s1") as client:
            await client.call_tool("memory", {"action": "add", "content": "MCP is served too"})
            return text_of((await client.read_resource(FROZEN)).contents[0])

    assert run(body) == before.system_block
    assert running.turn("s1", scope=SCOPE).system_block == before.system_block
    running.stub.NotifyCompaction(pb.NotifyCompactionRequest(scope=SCOPE, session_id="s1"))
    assert "MCP is served too" in running.turn("s1", scope=SCOPE).system_block


def test_the_bridge_ends_its_own_session(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar()

    async def body() -> None:
        async with bridge(running.addresses.api) as client:
            await client.read_resource(FROZEN)

    run(body)
    ended = running.sidecar.metrics.registry.get_sample_value(
        "memory_snapshot_invalidations_total", {"reason": "session_end"}
    )
    assert ended == 1


def test_the_tokens_grant_applies_unchanged(
    make_sidecar: MakeSidecar,
    tokens_file: Path,  # noqa: F811
) -> None:
    running = make_sidecar(auth_tokens_file=str(tokens_file))
    agent_a = str(tokens_file.parent / "agent-a")

    async def forbidden() -> None:
        async with bridge(running.addresses.api, "--token-file", agent_a) as client:
            await client.call_tool("memory", {"action": "add", "content": "planted"})

    async def anonymous() -> None:
        async with bridge(running.addresses.api, agent="agent-a") as client:
            await client.list_tools()

    async def allowed() -> Any:
        async with bridge(
            running.addresses.api, "--token-file", agent_a, agent="agent-a"
        ) as client:
            return await client.call_tool("memory", {"action": "add", "content": "A's note"})

    for body, code, reason in (
        (forbidden, "PERMISSION_DENIED", "SCOPE_FORBIDDEN"),
        (anonymous, "UNAUTHENTICATED", "TOKEN_MISSING"),
    ):
        error = refused_connection(body)
        assert error.code == -32600
        assert (error.data["code"], error.data["reason"]) == (code, reason)
    assert not run(allowed).is_error
    assert contents(running, SCOPE, token=ADMIN) == []
    assert contents(running, pb.Scope(agent_id="agent-a", user_id="ada"), token=ADMIN) == [
        "A's note"
    ]


def test_errors_are_the_http_listeners(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar()

    async def body() -> MCPError:
        async with bridge(running.addresses.api) as client:
            with pytest.raises(MCPError) as raised:
                await client.call_tool("memory_delete_everything", {})
            return raised.value

    error = run(body)
    assert error.code == -32602
    assert error.data == {
        "code": "INVALID_ARGUMENT",
        "reason": "TOOL_UNKNOWN",
        "metadata": {"name": "memory_delete_everything"},
    }


def test_a_daemon_that_is_not_there_is_a_clear_error(tmp_path: Path) -> None:
    gone = f"unix:{tmp_path / 'none.sock'}"

    async def body() -> None:
        async with bridge(gone, "--timeout", "0.5") as client:
            await client.list_tools()

    error = refused_connection(body)
    assert error.data["reason"] == "DAEMON_UNREACHABLE"
    assert "cannot reach memory-sidecar at unix:" in error.message
    assert "is the daemon running?" in error.message


def test_the_command_takes_the_online_commands_options() -> None:
    shown = run_sidecar("mcp", "--help")
    assert shown.returncode == 0
    for flag in ("--address", "--agent-id", "--user-id", "--token-file", "--tls-ca-file"):
        assert flag in shown.stdout
    assert "--session-id" in shown.stdout
    assert "--json" not in shown.stdout


def test_a_token_file_it_cannot_read_is_the_hosts_error_and_one_line_of_log(
    tmp_path: Path,
) -> None:
    missing = str(tmp_path / "gone.token")
    api = f"unix:{tmp_path / 'daemon.sock'}"

    async def body() -> None:
        async with bridge(api, "--token-file", missing) as client:
            await client.list_tools()

    error = refused_connection(body)
    assert error.code == -32600
    assert (error.data["code"], error.data["reason"]) == (
        "UNAUTHENTICATED",
        "TOKEN_FILE_UNREADABLE",
    )
    assert missing in error.message
    # What the host's log shows: one line on stderr, no traceback; the
    # bridge ends when the host closes its stdin.
    spawned = subprocess.run(
        [sys.executable, "-m", "sidecar", "mcp", "--address", api, "--token-file", missing],
        input="",
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert spawned.returncode == 1
    (line,) = spawned.stderr.splitlines()
    assert line.startswith("memory-sidecar: TOKEN_FILE_UNREADABLE: the bearer token (--token-file)")
