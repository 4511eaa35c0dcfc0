"""Section 16 of `make bench`: a model's tool call through CallTool.

Owns `bench_tool_calls`: memory_search and a memory add run as CallTool,
each beside the same operation as its plain RPC (SearchMemories, AddMemory)
on the same daemon, measured in alternating batches. The target (issue 23)
is each within 2x of the plain RPC.

Must not touch the shared helpers (bench.measure); its database is
tools.db.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, UNLIMITED, Report, Row, daemon, interleaved, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def bench_tool_calls(report: Report, work: Path, corpus: Corpus, size: int, count: int) -> None:
    db = work / "tools.db"
    populate(db, {("bench-agent", Tier.MEMORY): list(corpus.memories(size))})
    rows: list[Row] = []
    with daemon(db, UNLIMITED) as d, grpc.insecure_channel(d.api) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        query = "which package manager does the deploy use"

        def search_rpc() -> None:
            stub.SearchMemories(
                pb.SearchMemoriesRequest(scope=SCOPE, query=query, limit=10), timeout=10
            )

        def search_tool() -> None:
            stub.CallTool(
                pb.CallToolRequest(
                    scope=SCOPE,
                    session_id="bench",
                    name="memory_search",
                    arguments_json=json.dumps({"query": query, "limit": 10}),
                ),
                timeout=10,
            )

        numbers = itertools.count()

        def add_rpc() -> None:
            content = f"bench note {next(numbers)} about the deploy"
            stub.AddMemory(pb.AddMemoryRequest(scope=SCOPE, content=content), timeout=10)

        def add_tool() -> None:
            arguments = {"action": "add", "content": f"bench note {next(numbers)} about the deploy"}
            stub.CallTool(
                pb.CallToolRequest(
                    scope=SCOPE,
                    session_id="bench",
                    name="memory",
                    arguments_json=json.dumps(arguments),
                ),
                timeout=10,
            )

        for what, plain, tool in (
            (f"search, a tier of {size:,}", search_rpc, search_tool),
            ("add", add_rpc, add_tool),
        ):
            a, b = interleaved(plain, tool, count)
            rpc, called = pct(a, 50), pct(b, 50)
            rows.append([what, us(rpc), us(called), us(pct(b, 99)), f"{called / rpc:.2f}x"])
    report.add(
        "16. Tool calls (CallTool)",
        "A model's tool call run by the daemon (ListTools/CallTool: arguments as JSON, the "
        "text for the model and a JSON outcome back) beside the same operation as its plain "
        "RPC (SearchMemories limit 10, AddMemory) on the same daemon, in alternating "
        "batches. Target (issue 23): within 2x.",
        ["operation", "RPC p50", "CallTool p50", "CallTool p99", "ratio"],
        rows,
    )
