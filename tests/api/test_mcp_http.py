"""The daemon's MCP listener (server.mcp_listen), driven by the official MCP
SDK's own client over streamable HTTP: the handshake era (`legacy`, with an
MCP session) and the 2026-07-28 era (`auto`, sessionless) alike.

Every tool and error, the scope bound by the connection (headers and the
token's grant, never an argument), the frozen block's refresh rules against
gRPC's InjectForTurn, the resource and the prompt, Host/Origin checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.types import TextContent, TextResourceContents

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.api.test_access import pki  # noqa: F401 (a fixture)
from tests.api.test_access_tokens import ADA, ADMIN, AGENT_A, tokens_file  # noqa: F401
from tests.conftest import (
    CALL_SECONDS,
    MakeSidecar,
    Running,
    contents,
    run_sidecar,
    spawn_daemon,
)

T = TypeVar("T")
MODES = ("legacy", "auto")
SCOPE = pb.Scope(agent_id="coder", user_id="ada")
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"},
    },
}
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())  # type: ignore[arg-type]


def text_of(content: object) -> str:
    """The text of a resource's or a message's content (these serve text only)."""
    assert isinstance(content, TextResourceContents | TextContent), content
    return content.text


def bound(
    agent: str = "coder", user: str = "ada", token: str = "", session: str = ""
) -> dict[str, str]:
    headers = {"X-Memory-Agent-Id": agent, "X-Memory-User-Id": user}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if session:
        headers["X-Memory-Session-Id"] = session
    return headers


@contextlib.asynccontextmanager
async def connect(
    url: str, mode: str = "auto", verify: Any = True, **binding: str
) -> AsyncIterator[Client]:
    """The SDK's Client over its streamable HTTP transport, bound by headers."""
    async with (
        httpx2.AsyncClient(headers=bound(**binding), verify=verify, timeout=CALL_SECONDS) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as client,
    ):
        yield client


def refused_connection(body: Callable[[], Awaitable[Any]]) -> MCPError:
    """The MCPError a client fails with (the SDK's Client raises it from
    inside its task groups, in an exception group)."""
    with pytest.RaisesGroup(MCPError, flatten_subgroups=True) as raised:
        run(body)
    group: BaseException = raised.value
    while isinstance(group, BaseExceptionGroup):
        (group,) = group.exceptions
    assert isinstance(group, MCPError)
    return group


def mcp_sidecar(make_sidecar: MakeSidecar, yaml_text: str = "", **server: Any) -> Running:
    return make_sidecar(yaml_text, mcp_listen="127.0.0.1:0", **server)


def url(running: Running) -> str:
    assert running.addresses.mcp is not None
    return running.addresses.mcp


def tool_calls(running: Running, tool: str, outcome: str) -> float:
    value = running.sidecar.metrics.registry.get_sample_value(
        "memory_mcp_tool_calls_total", {"tool": tool, "outcome": outcome}
    )
    return value or 0.0


# --- tools ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_the_tools_are_listed_and_none_can_name_a_scope(
    make_sidecar: MakeSidecar, mode: str
) -> None:
    running = mcp_sidecar(make_sidecar)

    async def body() -> Any:
        async with connect(url(running), mode) as client:
            return client.protocol_version, (await client.list_tools()).tools

    version, tools = run(body)
    assert version == ("2025-11-25" if mode == "legacy" else "2026-07-28")
    assert [t.name for t in tools] == ["memory", "memory_search", "memory_list"]
    for tool in tools:
        assert tool.input_schema["additionalProperties"] is False
        assert not {"agent_id", "user_id", "scope"} & set(tool.input_schema["properties"])
        assert tool.annotations is not None
    read_only = {t.name: t.annotations.read_only_hint for t in tools if t.annotations}
    assert read_only == {"memory": False, "memory_search": True, "memory_list": True}
    # The descriptions state this scope's budgets.
    assert "2,200 characters" in tools[0].description


@pytest.mark.parametrize("mode", MODES)
def test_add_replace_remove_search_and_list(make_sidecar: MakeSidecar, mode: str) -> None:
    running = mcp_sidecar(make_sidecar)

    async def body() -> list[Any]:
        async with connect(url(running), mode) as client:
            return [
                await client.call_tool("memory", {"action": "add", "content": "Deploys use uv"}),
                await client.call_tool(
                    "memory", {"action": "add", "target": "user", "content": "Ada likes tea"}
                ),
                await client.call_tool("memory_search", {"query": "deploys"}),
                await client.call_tool(
                    "memory",
                    {"action": "replace", "old_text": "use uv", "new_text": "use uv 0.5"},
                ),
                await client.call_tool(
                    "memory", {"action": "remove", "target": "user", "old_text": "likes tea"}
                ),
                await client.call_tool("memory_list", {}),
            ]

    added, profile, search, replaced, removed, listed = run(body)
    for result in (added, profile, search, replaced, removed, listed):
        assert not result.is_error, result.content[0].text
    assert added.content[0].text.startswith("Saved to agent notes (target=memory) [")
    assert added.structured_content["memory"]["content"] == "Deploys use uv"
    assert profile.structured_content["memory"]["target"] == "user"
    assert [h["content"] for h in search.structured_content["hits"]] == ["Deploys use uv"]
    assert replaced.structured_content["memory"]["content"] == "Deploys use uv 0.5"
    assert removed.structured_content["memory"]["content"] == "Ada likes tea"
    assert [m["content"] for m in listed.structured_content["memories"]] == ["Deploys use uv 0.5"]
    # The daemon's store saw exactly that, in the scope the headers named.
    assert contents(running, SCOPE) == ["Deploys use uv 0.5"]
    assert tool_calls(running, "memory", "ok") == 4


SHORT_NOTES = (
    "Python deps are managed with uv; never pip install into the venv",
    "Open pull requests with gh pr create, not the web form",
    "CI runs the tests on Python 3.11 and 3.12",
    "svc-8 serves the billing API on port 5433",
    "Logs are pretty-printed with jq before pasting them into tickets",
)


def test_short_words_numbers_and_identifiers_are_found_through_mcp(
    make_sidecar: MakeSidecar,
) -> None:
    """Issue 33, item 3, through the SDK's client: a query of one short
    token ranks its note first; a query sharing no term finds nothing; a
    note differing by a number is no near-duplicate under `refuse`."""
    running = mcp_sidecar(make_sidecar, "agents: {coder: {similar_writes: refuse}}")
    queries = {"uv": 0, "gh": 1, "3.11": 2, "svc-8": 3, "5433": 3, "jq": 4}

    async def body() -> tuple[dict[str, Any], Any, Any]:
        async with connect(url(running)) as client:
            for note in SHORT_NOTES:
                added = await client.call_tool("memory", {"action": "add", "content": note})
                assert not added.is_error, text_of(added.content[0])
            firsts = {}
            for query in queries:
                found = await client.call_tool("memory_search", {"query": query})
                assert not found.is_error, text_of(found.content[0])
                firsts[query] = found.structured_content["hits"]
            nothing = await client.call_tool("memory_search", {"query": "what is it?"})
            sibling = await client.call_tool(
                "memory",
                {"action": "add", "content": "svc-7 serves the billing API on port 5434"},
            )
            return firsts, nothing, sibling

    firsts, nothing, sibling = run(body)
    for query, note in queries.items():
        assert firsts[query], query
        assert firsts[query][0]["content"] == SHORT_NOTES[note], query
    assert not nothing.is_error
    assert nothing.structured_content["hits"] == []
    assert not sibling.is_error, text_of(sibling.content[0])
    assert len(contents(running, SCOPE)) == len(SHORT_NOTES) + 1


def test_a_full_tier_is_a_tool_error_listing_its_entries(make_sidecar: MakeSidecar) -> None:
    running = mcp_sidecar(make_sidecar, "defaults: {memory_char_limit: 60}\n")
    first, second = "The build runs on Linux only", "Releases are tagged by CI"

    async def body() -> Any:
        async with connect(url(running)) as client:
            for content in (first, second):
                result = await client.call_tool("memory", {"action": "add", "content": content})
                assert not result.is_error
            return await client.call_tool(
                "memory", {"action": "add", "content": "One more fact that does not fit"}
            )

    full = run(body)
    assert full.is_error
    text = full.content[0].text
    assert text.startswith("Not saved: agent notes (target=memory) is full [")
    assert f"1. (28 chars) {first}" in text
    assert f"2. (25 chars) {second}" in text
    assert full.structured_content["error"]["reason"] == "TIER_BUDGET_EXCEEDED"
    assert sorted(contents(running, SCOPE)) == sorted([first, second])
    assert tool_calls(running, "memory", "error") == 1


def test_old_text_that_matches_no_entry_or_several_is_a_tool_error(
    make_sidecar: MakeSidecar,
) -> None:
    running = mcp_sidecar(make_sidecar)
    for content in ("Staging deploys at noon", "Production deploys on Friday"):
        running.add(content, scope=SCOPE)

    async def body() -> tuple[Any, Any, Any]:
        async with connect(url(running)) as client:
            return (
                await client.call_tool("memory", {"action": "remove", "old_text": "Kubernetes"}),
                await client.call_tool("memory", {"action": "remove", "old_text": "deploys"}),
                await client.call_tool("memory", {"action": "replace", "content": "x"}),
            )

    missing, ambiguous, no_old_text = run(body)
    assert missing.is_error
    assert missing.structured_content["error"]["reason"] == "MATCH_NOT_FOUND"
    assert missing.content[0].text.startswith("Not changed: ")
    assert "'Kubernetes'" in missing.content[0].text
    assert ambiguous.is_error
    assert ambiguous.structured_content["error"]["reason"] == "AMBIGUOUS_MATCH"
    assert ambiguous.content[0].text.startswith("Not changed: ")
    assert "'Staging deploys at noon'" in ambiguous.content[0].text
    assert "'Production deploys on Friday'" in ambiguous.content[0].text
    assert no_old_text.is_error
    assert "`old_text` is required" in no_old_text.content[0].text
    assert sorted(contents(running, SCOPE)) == [
        "Production deploys on Friday",
        "Staging deploys at noon",
    ]


@pytest.mark.parametrize("mode", MODES)
def test_an_argument_naming_another_scope_is_refused_and_changes_nothing(
    make_sidecar: MakeSidecar, mode: str
) -> None:
    running = mcp_sidecar(make_sidecar)
    other = pb.Scope(agent_id="other", user_id="bob")
    running.add("Other's note", scope=other)

    async def body() -> list[Any]:
        async with connect(url(running), mode) as client:
            return [
                await client.call_tool(
                    "memory", {"action": "add", "content": "planted", "agent_id": "other"}
                ),
                await client.call_tool(
                    "memory",
                    {"action": "remove", "old_text": "Other", "scope": {"agent_id": "other"}},
                ),
                await client.call_tool("memory_list", {"user_id": "bob"}),
            ]

    for result in run(body):
        assert result.is_error
        assert "set by the connection, not by arguments" in result.content[0].text
        assert result.structured_content["error"]["reason"] == "ARGUMENTS_INVALID"
    assert contents(running, other) == ["Other's note"]
    assert contents(running, SCOPE) == []


def test_an_unknown_tool_is_an_mcp_error(make_sidecar: MakeSidecar) -> None:
    running = mcp_sidecar(make_sidecar)

    async def body() -> MCPError:
        async with connect(url(running)) as client:
            with pytest.raises(MCPError) as raised:
                await client.call_tool("memory_delete_everything", {})
            return raised.value

    error = run(body)
    assert error.code == -32602  # INVALID_PARAMS, as the spec has unknown tools
    assert error.data == {
        "code": "INVALID_ARGUMENT",
        "reason": "TOOL_UNKNOWN",
        "metadata": {"name": "memory_delete_everything"},
    }
    # A client's name never becomes a label.
    assert tool_calls(running, "unknown", "failed") == 1


# --- the frozen block, the resource and the prompt --------------------------------


def test_writes_through_mcp_refresh_the_frozen_block_as_grpc_writes_do(
    make_sidecar: MakeSidecar,
) -> None:
    running = mcp_sidecar(make_sidecar)
    running.add("The API is gRPC", scope=SCOPE)
    before = running.turn("s1", scope=SCOPE)
    again = running.turn("s1", scope=SCOPE)
    assert again.cache_hit
    assert again.system_block == before.system_block

    async def read(client: Client) -> str:
        resource = await client.read_resource("memory://frozen-block")
        return text_of(resource.contents[0])

    async def body() -> tuple[str, str]:
        async with connect(url(running), session="s1") as client:
            shown = await read(client)
            await client.call_tool("memory", {"action": "add", "content": "MCP is served too"})
            return shown, await read(client)

    shown, refreshed = run(body)
    # The resource is the session's frozen block, byte for byte.
    assert shown == before.system_block
    after = running.turn("s1", scope=SCOPE)
    assert "MCP is served too" in after.system_block
    assert refreshed == after.system_block


def test_under_on_compaction_the_block_waits_for_notify_compaction(
    make_sidecar: MakeSidecar,
) -> None:
    running = mcp_sidecar(make_sidecar, "defaults: {snapshot_refresh: on_compaction}\n")
    running.add("The API is gRPC", scope=SCOPE)
    before = running.turn("s1", scope=SCOPE)

    async def body() -> str:
        async with connect(url(running), session="s1") as client:
            await client.call_tool("memory", {"action": "add", "content": "MCP is served too"})
            resource = await client.read_resource("memory://frozen-block")
            return text_of(resource.contents[0])

    assert run(body) == before.system_block
    assert running.turn("s1", scope=SCOPE).system_block == before.system_block
    running.stub.NotifyCompaction(pb.NotifyCompactionRequest(scope=SCOPE, session_id="s1"))
    assert "MCP is served too" in running.turn("s1", scope=SCOPE).system_block


def test_an_mcp_session_is_the_runtime_session(make_sidecar: MakeSidecar) -> None:
    # Without X-Memory-Session-Id, one MCP session (legacy) is one runtime
    # session: frozen within it, and a new one sees the write.
    running = mcp_sidecar(make_sidecar, "defaults: {snapshot_refresh: on_compaction}\n")
    running.add("The API is gRPC", scope=SCOPE)

    async def read(client: Client) -> str:
        return text_of((await client.read_resource("memory://frozen-block")).contents[0])

    async def body() -> tuple[str, str, str]:
        async with connect(url(running), "legacy") as client:
            first = await read(client)
            await client.call_tool("memory", {"action": "add", "content": "MCP is served too"})
            same = await read(client)
        async with connect(url(running), "legacy") as client:
            return first, same, await read(client)

    first, same, fresh = run(body)
    assert "The API is gRPC" in first
    assert same == first
    assert "MCP is served too" in fresh
    # Each session was ended with its MCP session (the client's DELETE).
    ended = running.sidecar.metrics.registry.get_sample_value(
        "memory_snapshot_invalidations_total", {"reason": "session_end"}
    )
    assert ended == 2


def test_the_prompt_is_the_turn_block_of_the_session(make_sidecar: MakeSidecar) -> None:
    # No frozen block: the turn block carries what is relevant.
    running = mcp_sidecar(make_sidecar, "defaults: {inject_system_block: false}\n")
    for content in ("Deploys run from ops/deploy.sh", "The office plant is a fern"):
        running.add(content, scope=SCOPE)
    message = "How do I run a deploy?"

    async def body() -> tuple[Any, Any]:
        async with connect(url(running), session="s1") as client:
            prompts = (await client.list_prompts()).prompts
            return prompts, await client.get_prompt("memory_context", {"user_message": message})

    prompts, prompt = run(body)
    assert [(p.name, [a.name for a in p.arguments or []]) for p in prompts] == [
        ("memory_context", ["user_message"])
    ]
    (text,) = no_empty_text(prompt)
    assert "ops/deploy.sh" in text
    assert "fern" not in text
    assert text == running.turn("s1", message, scope=SCOPE).turn_context


def no_empty_text(prompt: Any) -> list[str]:
    """The texts of a prompt's messages, none of them empty: a model's API
    may refuse an empty text block (Anthropic's does)."""
    texts = [text_of(m.content) for m in prompt.messages]
    assert all(t.strip() for t in texts), texts
    return texts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("config", "stored"),
    [
        ("", []),
        ("", ["Deploys run from ops/deploy.sh"]),
        ("defaults: {inject_system_block: false}\n", ["Deploys run from ops/deploy.sh"]),
    ],
    ids=["empty-store", "all-in-the-frozen-block", "no-match"],
)
def test_with_nothing_to_add_the_prompt_has_no_message(
    make_sidecar: MakeSidecar, mode: str, config: str, stored: list[str]
) -> None:
    running = mcp_sidecar(make_sidecar, config)
    for content in stored:
        running.add(content, scope=SCOPE)
    message = "What is the weather like?"

    async def body() -> Any:
        async with connect(url(running), mode, session="s1") as client:
            return await client.get_prompt("memory_context", {"user_message": message})

    prompt = run(body)
    assert running.turn("s1", message, scope=SCOPE).turn_context == ""
    assert no_empty_text(prompt) == []
    assert prompt.description == "No memories to add for this message"


def test_unknown_resources_and_prompts_are_mcp_errors(make_sidecar: MakeSidecar) -> None:
    running = mcp_sidecar(make_sidecar)

    async def body() -> tuple[Any, list[MCPError]]:
        async with connect(url(running)) as client:
            listed = (await client.list_resources()).resources
            errors: list[MCPError] = []
            for attempt in (
                client.read_resource("memory://other-agent"),
                client.get_prompt("another", {}),
                client.get_prompt("memory_context", {}),
            ):
                with pytest.raises(MCPError) as raised:
                    await attempt
                errors.append(raised.value)
            return listed, errors

    listed, (resource, prompt, argument) = run(body)
    assert [(r.uri, r.mime_type) for r in listed] == [("memory://frozen-block", "text/plain")]
    assert (resource.code, prompt.code, argument.code) == (-32602, -32602, -32602)
    assert "memory://frozen-block" in resource.message
    assert "needs the argument user_message" in argument.message


# --- who may call, and where from ---------------------------------------------------


def post(
    address: str, headers: dict[str, str], body: dict[str, Any] | None = None, **kwargs: Any
) -> httpx2.Response:
    """One raw HTTP request, as a client that is not an MCP SDK sends it."""
    with httpx2.Client(timeout=CALL_SECONDS, **kwargs) as http:
        return http.post(address, headers={**ACCEPT, **headers}, json=body or INITIALIZE)


def refusal(response: httpx2.Response) -> dict[str, Any]:
    answer = response.json()
    assert answer["jsonrpc"] == "2.0"
    return dict(answer["error"])


def test_a_token_is_required_where_auth_is_configured(
    make_sidecar: MakeSidecar,
    tokens_file: Path,  # noqa: F811
) -> None:
    running = mcp_sidecar(make_sidecar, auth_tokens_file=str(tokens_file))
    missing = post(url(running), bound())
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert refusal(missing)["data"]["reason"] == "TOKEN_MISSING"
    for token in ("not-a-token", AGENT_A[:-1]):
        wrong = post(url(running), bound("agent-a", token=token))
        assert wrong.status_code == 401
        assert refusal(wrong)["data"]["reason"] == "TOKEN_INVALID"

    async def body() -> None:
        async with connect(url(running)):
            pass

    error = refused_connection(body)
    assert error.data["reason"] == "TOKEN_MISSING"
    assert "Authorization: Bearer" in error.message


@pytest.mark.parametrize("mode", MODES)
def test_a_restricted_token_cannot_widen_its_scope_by_headers(
    make_sidecar: MakeSidecar,
    tokens_file: Path,  # noqa: F811
    mode: str,
) -> None:
    running = mcp_sidecar(make_sidecar, auth_tokens_file=str(tokens_file))
    for token, agent, user in ((AGENT_A, "coder", "ada"), (ADA, "coder", "bob"), (ADA, "x", "ada")):
        forbidden = post(url(running), bound(agent, user, token=token))
        assert forbidden.status_code == 403, (token, agent, user)
        answer = refusal(forbidden)
        assert answer["data"]["reason"] == "SCOPE_FORBIDDEN"
        assert "X-Memory-Agent-Id".lower() in answer["message"].lower()

    async def forbidden_client() -> None:
        async with connect(url(running), mode, agent="coder", token=AGENT_A):
            pass

    error = refused_connection(forbidden_client)
    assert error.data == {
        "code": "PERMISSION_DENIED",
        "reason": "SCOPE_FORBIDDEN",
        "metadata": {"field": "scope.agent_id", "agent_id": "coder", "user_id": "ada"},
    }

    async def allowed() -> Any:
        async with connect(url(running), mode, agent="agent-a", user="ada", token=AGENT_A) as c:
            return await c.call_tool("memory", {"action": "add", "content": "Agent A's note"})

    assert not run(allowed).is_error
    own = pb.Scope(agent_id="agent-a", user_id="ada")
    assert contents(running, own, token=ADMIN) == ["Agent A's note"]
    assert contents(running, SCOPE, token=ADMIN) == []


def test_an_mcp_session_stays_with_its_token_and_scope(
    make_sidecar: MakeSidecar,
    tokens_file: Path,  # noqa: F811
) -> None:
    running = mcp_sidecar(make_sidecar, auth_tokens_file=str(tokens_file))
    opened = post(url(running), bound(token=ADMIN))
    assert opened.status_code == 200
    session = opened.headers["mcp-session-id"]
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    for headers in (bound("other", token=ADMIN), bound("agent-a", token=AGENT_A)):
        taken = post(
            url(running),
            {**headers, "Mcp-Session-Id": session, "MCP-Protocol-Version": "2025-11-25"},
            listing,
        )
        assert taken.status_code == 404


def test_scope_headers_are_checked(make_sidecar: MakeSidecar) -> None:
    running = mcp_sidecar(make_sidecar)
    long = post(url(running), bound("a" * 300))
    assert long.status_code == 400
    assert refusal(long)["data"]["reason"] == "FIELD_TOO_LONG"
    # Bytes throughout: the headers below are not ASCII text.
    accept = [(name.encode(), value.encode()) for name, value in ACCEPT.items()]
    with httpx2.Client(timeout=CALL_SECONDS) as http:
        latin = http.post(
            url(running),
            headers=[*accept, (b"X-Memory-Agent-Id", b"\xff\xfe")],
            json=INITIALIZE,
        )
    assert latin.status_code == 400
    assert refusal(latin)["data"]["reason"] == "HEADER_INVALID"
    # UTF-8 ids are ids like any other.
    with httpx2.Client(timeout=CALL_SECONDS) as http:
        fine = http.post(
            url(running),
            headers=[*accept, (b"X-Memory-Agent-Id", "café".encode())],
            json=INITIALIZE,
        )
    assert fine.status_code == 200


def test_host_and_origin_must_name_the_loopback_listener(make_sidecar: MakeSidecar) -> None:
    running = mcp_sidecar(make_sidecar)
    port = url(running).split(":")[2].split("/")[0]
    assert post(url(running), bound()).status_code == 200
    assert post(url(running), {**bound(), "Origin": f"http://localhost:{port}"}).status_code == 200
    rebound = post(url(running), {**bound(), "Host": f"attacker.example:{port}"})
    assert rebound.status_code == 421
    foreign = post(url(running), {**bound(), "Origin": "http://attacker.example"})
    assert foreign.status_code == 403


def test_the_listener_serves_tls_when_the_api_does(
    make_sidecar: MakeSidecar,
    pki: Path,  # noqa: F811
) -> None:
    running = mcp_sidecar(
        make_sidecar, tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key")
    )
    assert url(running).startswith("https://127.0.0.1:")
    trust = ssl.create_default_context(cafile=str(pki / "ca.pem"))

    async def body() -> list[str]:
        async with connect(url(running), verify=trust) as client:
            return [t.name for t in (await client.list_tools()).tools]

    assert run(body) == ["memory", "memory_search", "memory_list"]
    with pytest.raises(httpx2.HTTPError):
        post(url(running).replace("https:", "http:"), bound())


# --- the daemon ----------------------------------------------------------------------


def test_the_daemon_serves_mcp_and_stops_on_sigterm(tmp_path: Path) -> None:
    daemon = spawn_daemon(
        "--db", str(tmp_path / "m.db"), "--listen", "127.0.0.1:0", "--mcp-listen", "127.0.0.1:0"
    )
    try:
        assert daemon.mcp.startswith("http://127.0.0.1:")
        assert daemon.mcp.endswith("/mcp")

        async def body() -> Any:
            async with connect(daemon.mcp) as client:
                return await client.call_tool("memory", {"action": "add", "content": "Noted"})

        assert not run(body).is_error
        daemon.process.terminate()
        assert daemon.wait() == 0
        assert any("stopped" in line for line in daemon.log)
        with pytest.raises(httpx2.ConnectError):
            post(daemon.mcp, bound())
    finally:
        daemon.close()


def test_mcp_is_off_by_default(tmp_path: Path) -> None:
    daemon = spawn_daemon("--db", str(tmp_path / "m.db"), "--listen", "127.0.0.1:0")
    try:
        assert daemon.mcp == "-"
        assert any(" mcp=- db=" in line for line in daemon.log)
    finally:
        daemon.close()


def test_a_port_in_use_is_an_error(make_sidecar: MakeSidecar, tmp_path: Path) -> None:
    taken = mcp_sidecar(make_sidecar)
    address = url(taken).removeprefix("http://").removesuffix("/mcp")
    result = run_sidecar(
        "serve",
        "--db",
        str(tmp_path / "other.db"),
        "--listen",
        "127.0.0.1:0",
        "--mcp-listen",
        address,
    )
    assert result.returncode == 1
    assert f"cannot listen for MCP on {address}" in result.stderr
    # The first daemon still answers.
    assert post(url(taken), bound()).status_code == 200
