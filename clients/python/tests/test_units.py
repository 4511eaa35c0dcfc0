"""The rules both clients share, without a daemon: back-off, what is
retried, error decoding, tool shapes, and a stream resumed mid-way from the
last message received (a fake stub cuts it exactly there)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from memory_sidecar_client import AsyncClient, BudgetExceeded, Client, RetryPolicy, SidecarError, pb
from memory_sidecar_client._core import tool_name, tool_shapes
from memory_sidecar_client._policy import Safety, retryable, tool_arguments, tool_safety
from memory_sidecar_client._status import _ErrorInfo, _Status
from memory_sidecar_client.errors import from_rpc_error

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class FakeError(grpc.RpcError):
    """A failed call as grpc raises it: a code, details and trailers."""

    def __init__(self, code: grpc.StatusCode, reason: str = "", **metadata: str) -> None:
        super().__init__()
        self._code = code
        trailers: list[tuple[str, str | bytes]] = [("other", "x")]
        if reason:
            info = _ErrorInfo(reason=reason, domain="memory.v1", metadata=metadata)
            status = _Status(code=code.value[0], message="refused")
            status.details.add(
                type_url="type.googleapis.com/google.rpc.ErrorInfo", value=info.SerializeToString()
            )
            trailers.append(("grpc-status-details-bin", status.SerializeToString()))
        self._trailers = tuple(trailers)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "refused"

    def trailing_metadata(self) -> Any:  # grpc-stubs types the pairs as objects
        return self._trailers


def test_back_off_doubles_with_full_jitter_up_to_the_cap() -> None:
    policy = RetryPolicy()
    assert [policy.backoff(n, lambda: 1.0) for n in range(1, 8)] == [
        0.05,
        0.1,
        0.2,
        0.4,
        0.8,
        1.6,
        2.0,
    ]
    assert policy.backoff(3, lambda: 0.0) == 0.0


def test_unavailable_is_retried_until_the_attempts_run_out() -> None:
    policy = RetryPolicy(attempts=4)
    error = from_rpc_error(FakeError(UNAVAILABLE))
    assert [policy.pause(error, Safety.READ, n, None) is not None for n in (1, 2, 3, 4)] == [
        True,
        True,
        True,
        False,
    ]
    # Not when the pause would pass the deadline.
    assert policy.pause(error, Safety.READ, 1, 0.0) is None


def test_what_is_retried() -> None:
    cut = from_rpc_error(FakeError(UNAVAILABLE))
    busy = from_rpc_error(FakeError(UNAVAILABLE, "DATABASE_BUSY"))
    behind = from_rpc_error(FakeError(UNAVAILABLE, "REPLICA_BEHIND", min_generation="9"))
    refused = from_rpc_error(FakeError(grpc.StatusCode.FAILED_PRECONDITION, "TIER_DISABLED"))
    for error in (cut, busy, behind):
        assert retryable(error, Safety.READ)
        assert retryable(error, Safety.IDEMPOTENT)
    # A write without a key field is sent again only when the daemon said
    # it wrote nothing; never after a cut, when it may have committed.
    unreachable = from_rpc_error(FakeError(UNAVAILABLE, "DATABASE_UNAVAILABLE"))
    assert not any(retryable(error, Safety.WRITE) for error in (cut, behind))
    assert all(retryable(error, Safety.WRITE) for error in (busy, unreachable))
    assert not any(retryable(refused, safety) for safety in Safety)


def test_errors_decode_reason_metadata_and_budget_numbers() -> None:
    plain = from_rpc_error(FakeError(grpc.StatusCode.NOT_FOUND, "MEMORY_NOT_FOUND", id="m1"))
    assert type(plain) is SidecarError
    assert (plain.code, plain.reason, plain.metadata, plain.domain, plain.message) == (
        grpc.StatusCode.NOT_FOUND,
        "MEMORY_NOT_FOUND",
        {"id": "m1"},
        "memory.v1",
        "refused",
    )
    budget = from_rpc_error(
        FakeError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "TIER_BUDGET_EXCEEDED",
            tier="user",
            used_chars="1300",
            limit_chars="1375",
            requested_chars="80",
        )
    )
    assert isinstance(budget, BudgetExceeded)
    assert (budget.tier, budget.used_chars, budget.limit_chars, budget.requested_chars) == (
        "user",
        1300,
        1375,
        80,
    )
    cut = from_rpc_error(FakeError(UNAVAILABLE))
    assert (cut.reason, cut.metadata) == ("", {})


def test_tool_calls_name_their_tool_and_say_whether_they_write() -> None:
    assert tool_name("memory", {"command": "view", "path": "/memories"}) == "memory_20250818"
    assert tool_name("memory", {"action": "add", "content": "x"}) == "memory"
    assert tool_safety("memory_search", {}) is Safety.READ
    assert tool_safety("memory_20250818", {"command": "view"}) is Safety.READ
    assert tool_safety("memory_20250818", {"command": "create"}) is Safety.WRITE
    assert tool_safety("memory", {"action": "add"}) is Safety.WRITE
    assert tool_arguments('{"a": 1}') == ('{"a": 1}', {"a": 1})
    assert tool_arguments({"a": 1}) == ('{"a": 1}', {"a": 1})
    assert tool_arguments("") == ("{}", {})


def test_tool_shapes() -> None:
    def tool(name: str) -> pb.Tool:
        return pb.Tool(
            name=name,
            openai_json=json.dumps({"type": "function", "function": {"name": name}}),
            anthropic_json=json.dumps({"name": name, "input_schema": {}}),
        )

    listed = pb.ListToolsResponse(
        tools=[tool("memory"), tool("memory_list")],
        claude_memory_tool=pb.Tool(
            name="memory_20250818",
            anthropic_json=json.dumps({"type": "memory_20250818", "name": "memory"}),
        ),
    )
    assert [t["function"]["name"] for t in tool_shapes(listed, "openai", True)] == [
        "memory",
        "memory_list",
    ]
    assert tool_shapes(listed, "anthropic", True) == [
        {"type": "memory_20250818", "name": "memory"},
        {"name": "memory_list", "input_schema": {}},
    ]
    assert tool_shapes(listed, "anthropic", False)[0] == {"name": "memory", "input_schema": {}}
    with pytest.raises(ValueError, match="tool format"):
        tool_shapes(listed, "gemini", True)  # type: ignore[arg-type]


BATCHES = [
    pb.ExportMemoriesResponse(jsonl=f"{n}\n", count=1, cursor=f"c{n}", done=n == 3)
    for n in range(1, 4)
]


class FakeExport:
    """ExportMemories that breaks after its first batch, once; it records
    the cursor each opening asked for."""

    def __init__(self) -> None:
        self.cursors: list[str] = []

    def batches(self, request: pb.ExportMemoriesRequest) -> list[pb.ExportMemoriesResponse]:
        self.cursors.append(request.cursor)
        start = int(request.cursor[1:]) if request.cursor else 0
        return BATCHES[start:]

    def cut(self) -> bool:
        return len(self.cursors) == 1


class SyncCall:
    def __init__(self, batches: list[pb.ExportMemoriesResponse], cut: bool) -> None:
        self._batches, self._cut = batches, cut

    def __iter__(self) -> Iterator[pb.ExportMemoriesResponse]:
        yield self._batches[0]
        if self._cut:
            raise FakeError(UNAVAILABLE)
        yield from self._batches[1:]

    def cancel(self) -> None:
        pass


class AsyncCall(SyncCall):
    async def __aiter__(self) -> AsyncIterator[pb.ExportMemoriesResponse]:
        for batch in self:
            yield batch


def test_an_export_cut_mid_stream_resumes_from_the_last_cursor() -> None:
    fake = FakeExport()

    class Stub:
        def ExportMemories(self, request: Any, **options: Any) -> SyncCall:  # noqa: N802
            return SyncCall(fake.batches(request), fake.cut())

    with Client("127.0.0.1:1") as client:
        client._stub = Stub()
        got = list(client.export_memories())
    assert got == BATCHES
    assert fake.cursors == ["", "c1"]


def test_an_async_export_cut_mid_stream_resumes_from_the_last_cursor() -> None:
    fake = FakeExport()

    class Stub:
        def ExportMemories(self, request: Any, **options: Any) -> AsyncCall:  # noqa: N802
            return AsyncCall(fake.batches(request), fake.cut())

    async def body() -> list[pb.ExportMemoriesResponse]:
        async with AsyncClient("127.0.0.1:1") as client:
            client._stub = Stub()
            return [batch async for batch in client.export_memories()]

    assert asyncio.run(body()) == BATCHES
    assert fake.cursors == ["", "c1"]
