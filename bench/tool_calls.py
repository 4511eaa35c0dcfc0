"""Section 16 of `make bench`: a model's tool call through CallTool.

Owns `bench_tool_calls`: memory_search and a memory add run as CallTool,
each beside the same operation as its plain RPC (SearchMemories, AddMemory)
on the same daemon, measured in alternating batches. The target (issue 23)
is each within 2x of the plain RPC. And `bench_claude_memory_tool` (16b):
Claude's memory tool (memory_20250818) beside the `memory` tool doing the
same to a budgeted tier of a realistic size; the target (issue 33) is
within 1.2x.

Must not touch the shared helpers (bench.measure); its databases are
tools.db and files.db.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
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


# A budgeted agent-notes tier as a model keeps it: a few dozen short entries.
_FILE_ENTRIES = 24


def _call(stub: pb_grpc.MemoryServiceStub, name: str, arguments: Mapping[str, object]) -> None:
    answer = stub.CallTool(
        pb.CallToolRequest(
            scope=SCOPE, session_id="bench", name=name, arguments_json=json.dumps(arguments)
        ),
        timeout=10,
    )
    assert not answer.is_error, answer.text


def bench_claude_memory_tool(report: Report, work: Path, count: int) -> None:
    """memory_20250818's str_replace and view beside the memory tool's
    replace and memory_list, on one tier, in alternating batches."""
    db = work / "files.db"
    entries = [f"note {n}: the deploy uses tool-{n} version 0" for n in range(_FILE_ENTRIES)]
    populate(db, {("bench-agent", Tier.MEMORY): entries})
    versions = [0] * _FILE_ENTRIES
    # Each side edits its own half of the entries, round and round.
    halves = (
        itertools.cycle(range(0, _FILE_ENTRIES, 2)),
        itertools.cycle(range(1, _FILE_ENTRIES, 2)),
    )

    def edit(n: int) -> tuple[str, str]:
        old = f"tool-{n} version {versions[n]}"
        versions[n] += 1
        return old, f"tool-{n} version {versions[n]}"

    rows: list[Row] = []
    with daemon(db) as d, grpc.insecure_channel(d.api) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)

        def replace() -> None:
            old, new = edit(next(halves[0]))
            _call(stub, "memory", {"action": "replace", "old_text": old, "new_text": new})

        def str_replace() -> None:
            old, new = edit(next(halves[1]))
            path = "/memories/notes.md"
            command = {"command": "str_replace", "path": path, "old_str": old, "new_str": new}
            _call(stub, "memory_20250818", command)

        def listing() -> None:
            _call(stub, "memory_list", {"target": "memory"})

        def view() -> None:
            _call(stub, "memory_20250818", {"command": "view", "path": "/memories/notes.md"})

        for what, plain, claude in (
            ("edit by text: replace / str_replace", replace, str_replace),
            ("read the tier: memory_list / view", listing, view),
        ):
            a, b = interleaved(plain, claude, count)
            tool, files = pct(a, 50), pct(b, 50)
            rows.append([what, us(tool), us(files), us(pct(b, 99)), f"{files / tool:.2f}x"])
    report.add(
        "16b. Claude's memory tool (memory_20250818)",
        "Claude's memory tool run through CallTool beside the memory tool doing the same, "
        f"on one daemon and one agent-notes tier of {_FILE_ENTRIES} entries (default "
        "budget), in alternating batches: a substring edit (each side its own entries, "
        "written through the engine with Edit.expected), and reading the whole tier. "
        "Target (issue 33): within 1.2x.",
        ["operation", "memory tool p50", "memory_20250818 p50", "memory_20250818 p99", "ratio"],
        rows,
    )
