"""AsyncClient against a real daemon: the key behaviours of test_client.py
over asyncio. Each test runs its coroutine in an event loop of its own."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from client_testing import Cuts, async_client
from memory_sidecar_client import BudgetExceeded, SidecarError, pb


class Recorder(grpc.aio.UnaryUnaryClientInterceptor):
    """Every unary request the client sends, by method."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method
        name = (method.decode() if isinstance(method, bytes) else method).rpartition("/")[2]
        self.requests.append((name, request))
        return await continuation(details, request)

    def sent(self, method: str) -> list[Any]:
        return [request for name, request in self.requests if name == method]


def test_a_write_retried_after_a_cut_is_stored_once(
    address: str, cuts: Cuts, scope: tuple[str, str]
) -> None:
    async def body() -> tuple[pb.AddMemoryResponse, list[str]]:
        async with async_client(cuts.target, scope) as cut:
            cuts.arm("headers")
            added = await cut.add_memory("The repo uses uv, not pip")
        async with async_client(address, scope) as direct:
            return added, [m.content async for m in direct.list_memories()]

    before = cuts.count()
    added, stored = asyncio.run(body())
    assert cuts.count() == before + 1
    assert not added.created
    assert stored == ["The repo uses uv, not pip"]


def test_reads_carry_the_highest_generation_written(address: str, scope: tuple[str, str]) -> None:
    recorder = Recorder()

    async def body() -> tuple[int, list[str], str]:
        channel = grpc.aio.insecure_channel(address, interceptors=[recorder])
        async with channel, async_client("", scope, channel=channel) as client:
            await client.add_memory("uses uv")
            await client.add_memory("Ada prefers short answers", tier=pb.TIER_USER)
            listed = await client.get_memories()
            await client.search_memories("uv")
            turn = await client.turn("s1", "which package manager?")
            return client.generation, [m.content for m in listed.memories], turn.system_block

    generation, listed, block = asyncio.run(body())
    sent = [*recorder.sent("GetMemories"), *recorder.sent("SearchMemories")]
    sent += recorder.sent("InjectForTurn")
    assert generation > 0
    assert [request.min_generation for request in sent] == [generation] * 3
    assert listed == ["uses uv", "Ada prefers short answers"]
    assert "uses uv" in block


def test_a_tool_calls_writes_count_for_read_your_writes(
    address: str, scope: tuple[str, str]
) -> None:
    recorder = Recorder()

    async def body() -> tuple[int, int, list[str]]:
        channel = grpc.aio.insecure_channel(address, interceptors=[recorder])
        async with channel, async_client("", scope, channel=channel) as client:
            added = await client.add_memory("uses uv")
            saved = await client.call_tool(
                "s1", "memory", {"action": "add", "content": "deploys on Fridays"}
            )
            assert not saved.is_error, saved.text
            assert saved.generation > added.generation
            listed = await client.get_memories()
            return saved.generation, client.generation, [m.content for m in listed.memories]

    saved, highest, listed = asyncio.run(body())
    assert highest == saved
    (request,) = recorder.sent("GetMemories")
    assert request.min_generation == saved
    assert listed == ["uses uv", "deploys on Fridays"]


def test_a_budget_refusal_carries_the_usage_as_numbers(
    address: str, scope: tuple[str, str]
) -> None:
    async def body() -> None:
        async with async_client(address, scope) as client:
            await client.add_memory("a" * 100)
            await client.add_memory("b" * 2150)

    with pytest.raises(BudgetExceeded) as full:
        asyncio.run(body())
    assert full.value.reason == "TIER_BUDGET_EXCEEDED"
    assert (full.value.used_chars, full.value.limit_chars, full.value.requested_chars) == (
        100,
        2200,
        2153,
    )


def test_other_errors_are_typed(address: str, scope: tuple[str, str]) -> None:
    async def body() -> None:
        async with async_client(address, scope) as client:
            await client.update_memory("no-such-id", content="x")

    with pytest.raises(SidecarError) as missing:
        asyncio.run(body())
    assert (missing.value.code, missing.value.reason) == (
        grpc.StatusCode.NOT_FOUND,
        "MEMORY_NOT_FOUND",
    )


def test_export_resumes_after_a_cut(address: str, cuts: Cuts, scope: tuple[str, str]) -> None:
    notes = [f"note {n}" for n in range(5)]

    async def body() -> list[pb.ExportMemoriesResponse]:
        async with async_client(address, scope) as direct:
            for note in notes:
                await direct.add_memory(note)
            first = await anext(direct.export_memories(batch_size=2))
        async with async_client(cuts.target, scope) as cut:
            cuts.arm("data")
            return [first] + [
                b async for b in cut.export_memories(batch_size=2, cursor=first.cursor)
            ]

    before = cuts.count()
    batches = asyncio.run(body())
    assert cuts.count() == before + 1
    assert [json.loads(line)["content"] for b in batches for line in b.jsonl.splitlines()] == notes


def test_watch_resumes_after_the_last_event_across_a_cut(
    address: str, cuts: Cuts, scope: tuple[str, str]
) -> None:
    async def body() -> list[pb.MemoryEvent]:
        async with async_client(address, scope) as direct, async_client(cuts.target, scope) as cut:
            events = cut.watch_memories()
            seen = [await anext(events)]
            await direct.add_memory("first")
            seen.append(await anext(events))
            cuts.arm("data")
            await direct.add_memory("second")
            seen.append(await anext(events))
            await direct.add_memory("third")
            seen.append(await anext(events))
            await events.aclose()
            return seen

    before = cuts.count()
    sync, *added = asyncio.run(body())
    assert cuts.count() == before + 1
    assert sync.kind == pb.MemoryEvent.KIND_SYNC
    assert [event.memory.content for event in added] == ["first", "second", "third"]


def test_the_turn_loop_and_tools(address: str, scope: tuple[str, str]) -> None:
    async def body() -> None:
        async with async_client(address, scope) as client:
            tools = await client.tools("anthropic")
            assert tools[0] == {"type": "memory_20250818", "name": "memory"}
            command = {"command": "create", "path": "/memories/notes.md", "file_text": "uses uv\n"}
            created = await client.call_tool("s1", "memory", command)
            assert not created.is_error, created.text
            first = await client.turn("s1", "Which package manager?")
            again = await client.turn("s1", "And for tests?")
            assert "uses uv" in first.system_block
            assert (first.cache_hit, again.cache_hit) == (False, True)
            assert (await client.notify_compaction("s1")).invalidated
            assert (await client.end_session("s1")).dropped

    asyncio.run(body())
