"""Section 17 of `make bench`: a model's tool call over MCP (streamable HTTP).

Owns `bench_mcp_calls`: memory_search and a memory add sent to the daemon's
MCP listener (server.mcp_listen), each beside the same operation as its
plain RPC (SearchMemories, AddMemory) on the same daemon, in alternating
batches. Sent by the MCP Python SDK's own client in both of the protocol's
eras (2026-07-28: one POST per call; 2025-11-25: in an MCP session), and by
a plain HTTP client posting the 2026-07-28 request itself, which leaves out
the client SDK's share. The target (issue 23) is each within 2x of the
plain RPC.

The SDK's client is asynchronous: it runs on an event loop of its own
thread, and its calls are timed there, each batch handed over at once, as an
agent's own event loop would call it (timed from the measuring thread, each
call would also count two thread wake-ups, a few hundred microseconds on a
busy machine, that no agent pays).

Must not touch the shared helpers (bench.measure) beyond reading a daemon's
MCP URL; its database is mcp.db.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import TextContent

from bench.corpus import Corpus
from bench.measure import SCOPE, UNLIMITED, Report, Row, daemon, latencies, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier

_META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "0"},
    "io.modelcontextprotocol/clientCapabilities": {},
}


class _Plain:
    """A 2026-07-28 tools/call as one POST, over a kept-alive connection."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._http = httpx2.Client(timeout=30)

    def timed(self, call: Callable[[], tuple[str, dict[str, Any]]], count: int) -> list[float]:
        """Latencies of `count` tool calls, each (name, arguments) from `call`."""
        out = []
        for _ in range(count):
            name, arguments = call()
            start = time.perf_counter()
            self.call(name, arguments)
            out.append(time.perf_counter() - start)
        return out

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        headers = {
            "X-Memory-Agent-Id": SCOPE.agent_id,
            "X-Memory-User-Id": SCOPE.user_id,
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2026-07-28",
            "Mcp-Method": "tools/call",
            "Mcp-Name": name,
        }
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": name, "arguments": arguments, "_meta": _META},
        }
        answer = self._http.post(self._url, headers=headers, json=body)
        result = answer.json()["result"]
        if answer.status_code != 200 or result["isError"]:
            raise RuntimeError(answer.text)
        return result

    def close(self) -> None:
        self._http.close()


class _Session:
    """The SDK's Client on an event loop of its own, called synchronously."""

    def __init__(self, url: str, mode: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        opened: concurrent.futures.Future[Client] = concurrent.futures.Future()
        self._stop = asyncio.Event()
        self._held = asyncio.run_coroutine_threadsafe(self._hold(url, mode, opened), self._loop)
        self._client = opened.result(30)

    async def _hold(self, url: str, mode: str, opened: concurrent.futures.Future[Client]) -> None:
        # Entered and left in one task, as the SDK's task groups require.
        headers = {"X-Memory-Agent-Id": SCOPE.agent_id, "X-Memory-User-Id": SCOPE.user_id}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=30) as http,
            Client(streamable_http_client(url, http_client=http), mode=mode) as client,
        ):
            opened.set_result(client)
            await self._stop.wait()

    def timed(self, call: Callable[[], tuple[str, dict[str, Any]]], count: int) -> list[float]:
        """Latencies of `count` tool calls, each (name, arguments) from
        `call`, timed on the client's event loop."""

        async def batch() -> list[float]:
            out = []
            for _ in range(count):
                name, arguments = call()
                start = time.perf_counter()
                result = await self._client.call_tool(name, arguments)
                out.append(time.perf_counter() - start)
                if result.is_error:
                    content = result.content[0]
                    raise RuntimeError(
                        content.text if isinstance(content, TextContent) else repr(content)
                    )
            return out

        return asyncio.run_coroutine_threadsafe(batch(), self._loop).result(30 + count)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._held.result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


def _interleaved(
    rpc: Callable[[], None],
    session: _Plain | _Session,
    call: Callable[[], tuple[str, dict[str, Any]]],
    count: int,
    batch: int = 20,
) -> tuple[list[float], list[float]]:
    """bench.measure.interleaved, the tool calls timed by `session.timed`."""
    a: list[float] = []
    b: list[float] = []
    latencies(rpc, 0, warmup=50)
    session.timed(call, 50)
    while len(a) < count:
        a += latencies(rpc, batch, warmup=0)
        b += session.timed(call, batch)
    return a, b


def bench_mcp_calls(report: Report, work: Path, corpus: Corpus, size: int, count: int) -> None:
    db = work / "mcp.db"
    populate(db, {("bench-agent", Tier.MEMORY): list(corpus.memories(size))})
    config = UNLIMITED + "server: {mcp_listen: '127.0.0.1:0'}\n"
    query = "which package manager does the deploy use"
    numbers = itertools.count()
    rows: list[Row] = []
    with daemon(db, config) as d, grpc.insecure_channel(d.api) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)

        def search_rpc() -> None:
            request = pb.SearchMemoriesRequest(scope=SCOPE, query=query, limit=10)
            stub.SearchMemories(request, timeout=10)

        def add_rpc() -> None:
            content = f"bench note {next(numbers)} about the deploy"
            stub.AddMemory(pb.AddMemoryRequest(scope=SCOPE, content=content), timeout=10)

        clients: list[tuple[str, Callable[[], _Plain | _Session]]] = [
            ("SDK client, 2026-07-28", lambda: _Session(d.mcp, "auto")),
            ("SDK client, 2025-11-25 session", lambda: _Session(d.mcp, "legacy")),
            ("plain HTTP client, 2026-07-28", lambda: _Plain(d.mcp)),
        ]
        for era, connect in clients:
            session = connect()
            try:

                def search_mcp() -> tuple[str, dict[str, Any]]:
                    return "memory_search", {"query": query, "limit": 10}

                def add_mcp() -> tuple[str, dict[str, Any]]:
                    content = f"bench note {next(numbers)} about the deploy"
                    return "memory", {"action": "add", "content": content}

                pairs: list[
                    tuple[str, Callable[[], None], Callable[[], tuple[str, dict[str, Any]]]]
                ] = [
                    (f"search, a tier of {size:,} ({era})", search_rpc, search_mcp),
                    (f"add ({era})", add_rpc, add_mcp),
                ]
                for what, plain, tool in pairs:
                    a, b = _interleaved(plain, session, tool, count)
                    ratio = pct(b, 50) / pct(a, 50)
                    rows.append(
                        [what, us(pct(a, 50)), us(pct(b, 50)), us(pct(b, 99)), f"{ratio:.2f}x"]
                    )
            finally:
                session.close()
    report.add(
        "17. Tool calls over MCP (streamable HTTP)",
        "A model's tool call sent to the daemon's MCP listener (server.mcp_listen) beside the "
        "same operation as its plain RPC (SearchMemories limit 10, AddMemory) on the same "
        "daemon, in alternating batches: by the MCP Python SDK's client in both eras of the "
        "protocol (its figures include the client SDK's own work; timed on the client's event "
        "loop), and by a plain HTTP client posting the 2026-07-28 request. "
        "Target (issue 23): within 2x.",
        ["operation", "RPC p50", "MCP p50", "MCP p99", "ratio"],
        rows,
    )
