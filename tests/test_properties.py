"""Property-based hostile input over every RPC: a clear status, a stable reason,
never INTERNAL, and a failed call changes nothing."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import (
    CALL_SECONDS,
    Running,
    error_info,
    start_sidecar,
    stop_sidecar,
)

# Codes a bad request may get; INTERNAL or UNKNOWN would be a bug.
ACCEPTABLE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    # UpdateMemory to another entry's content (DUPLICATE_CONTENT).
    grpc.StatusCode.ALREADY_EXISTS,
}
# Enum fields too get any int32, as a client may send: the stubs allow only
# the named values, hence the arg-type ignores where one is set.
INT32 = st.integers(-(2**31), 2**31 - 1)

# Text that hurts: controls (NUL, ESC, DEL), bidi overrides, zero-width and tag
# characters, combining marks, emoji, astral planes, and plenty of ASCII.
NASTY = st.sampled_from(
    [
        "\x00",
        "\x1b",
        "\x7f",
        "\u202e",
        "\u2066",
        "\u200b",
        "\ufeff",
        "\U000e0041",
        "\u0301",
        "§",
        "═",
        "<",
        ">",
        "&",
        '"',
        "'",
        "\n",
        "\t",
        "\r",
        " ",
        "🙂",
        "\U0001f600",
        "日",
    ]
)
TEXT = st.one_of(
    st.text(max_size=40),
    st.lists(st.one_of(NASTY, st.text(max_size=3)), max_size=20).map("".join),
    st.integers(0, 70_000).map(lambda n: "x" * n),
)
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    path: Path = tmp_path_factory.mktemp("properties") / "memory.db"
    running = start_sidecar(path, "defaults: {memory_char_limit: 20000, user_char_limit: 20000}")
    yield running
    stop_sidecar(running)


def scope_of(agent: str, user: str) -> pb.Scope:
    return pb.Scope(agent_id=agent, user_id=user)


def snapshot(server: Running, scope: pb.Scope) -> Any:
    try:
        return server.list(scope=scope)
    except grpc.RpcError as error:
        return error.code()  # an invalid scope cannot be listed: nothing to compare


def attempt(server: Running, method: str, request: Any, scope: pb.Scope) -> None:
    before = snapshot(server, scope)
    failure: grpc.RpcError | None = None
    try:
        getattr(server.stub, method)(request, timeout=CALL_SECONDS)
    except grpc.RpcError as error:
        failure = error
    if failure is None:
        return
    assert failure.code() in ACCEPTABLE, (failure.code(), failure.details())
    assert failure.details()
    if failure.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # grpc's own, no details
        assert error_info(failure).reason
    assert snapshot(server, scope) == before


@SETTINGS
@given(
    agent=TEXT,
    user=TEXT,
    tier=INT32,
    content=TEXT,
    category=TEXT,
    confidence=st.one_of(st.none(), st.floats()),
    key=TEXT,
)
def test_add_memory(
    server: Running,
    agent: str,
    user: str,
    tier: int,
    content: str,
    category: str,
    confidence: float | None,
    key: str,
) -> None:
    request = pb.AddMemoryRequest(
        scope=scope_of(agent, user),
        tier=tier,  # type: ignore[arg-type]
        content=content,
        category=category,
        idempotency_key=key,
    )
    if confidence is not None:
        request.confidence = confidence
    attempt(server, "AddMemory", request, request.scope)


@SETTINGS
@given(
    agent=TEXT,
    memory_id=TEXT,
    content=st.one_of(st.none(), TEXT),
    category=st.one_of(st.none(), TEXT),
    confidence=st.one_of(st.none(), st.floats()),
)
def test_update_memory(
    server: Running,
    agent: str,
    memory_id: str,
    content: str | None,
    category: str | None,
    confidence: float | None,
) -> None:
    scope = scope_of(agent, "u")
    existing = None
    with contextlib.suppress(grpc.RpcError):  # the agent id itself may be invalid
        existing = server.add("a memory to update", scope=scope).memory.id
    request = pb.UpdateMemoryRequest(
        scope=scope, id=existing if existing and not memory_id else memory_id
    )
    if content is not None:
        request.content = content
    if category is not None:
        request.category = category
    if confidence is not None and not math.isnan(confidence):
        request.confidence = confidence
    attempt(server, "UpdateMemory", request, scope)


@SETTINGS
@given(agent=TEXT, memory_id=TEXT)
def test_delete_memory(server: Running, agent: str, memory_id: str) -> None:
    scope = scope_of(agent, "u")
    attempt(server, "DeleteMemory", pb.DeleteMemoryRequest(scope=scope, id=memory_id), scope)


@SETTINGS
@given(agent=TEXT, tier=INT32, category=TEXT, query=TEXT, limit=INT32, match_all=st.booleans())
def test_reads(
    server: Running, agent: str, tier: int, category: str, query: str, limit: int, match_all: bool
) -> None:
    scope = scope_of(agent, "u")
    attempt(
        server,
        "GetMemories",
        pb.GetMemoriesRequest(scope=scope, tier=tier, category=category),  # type: ignore[arg-type]
        scope,
    )
    attempt(
        server,
        "SearchMemories",
        pb.SearchMemoriesRequest(
            scope=scope,
            query=query,
            tier=tier,  # type: ignore[arg-type]
            category=category,
            limit=limit,
            match_all=match_all,
        ),
        scope,
    )


@SETTINGS
@given(
    agent=TEXT,
    session=TEXT,
    message=TEXT,
    recent=st.lists(TEXT, max_size=70),
    keywords=st.lists(TEXT, max_size=140),
    strategy=INT32,
    max_memories=INT32,
    max_tokens=INT32,
)
def test_turns(
    server: Running,
    agent: str,
    session: str,
    message: str,
    recent: list[str],
    keywords: list[str],
    strategy: int,
    max_memories: int,
    max_tokens: int,
) -> None:
    scope = scope_of(agent, "u")
    attempt(
        server,
        "InjectForTurn",
        pb.InjectForTurnRequest(
            scope=scope,
            session_id=session,
            user_message=message,
            recent_messages=recent,
            keywords=keywords,
            strategy=strategy,  # type: ignore[arg-type]
            max_memories=max_memories,
            max_tokens=max_tokens,
        ),
        scope,
    )
    attempt(
        server,
        "NotifyCompaction",
        pb.NotifyCompactionRequest(session_id=session, scope=scope),
        scope,
    )
    attempt(server, "EndSession", pb.EndSessionRequest(session_id=session, scope=scope), scope)
