"""Section 15 of `make bench`: what semantic retrieval costs.

Owns `bench_semantic`: SearchMemories, a ranking InjectForTurn and AddMemory
with `server.semantic_encoder: local`, resident memory and the backfill at
start. Baseline: the same daemon without the encoder, running at the same
time on a copy of the database, called in alternating batches. Sets
`semantic_local_rss_mib` in docs/benchmarks.json.

Must not touch the retrieval quality figures (section 14,
bench.retrieval_quality) nor the shared helpers; its databases are
semantic-*.db, in a work directory of its own.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, UNLIMITED, Report, Row, daemon, interleaved, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def bench_semantic(report: Report, work: Path, corpus: Corpus, size: int, count: int) -> None:
    """What server.semantic_encoder: local costs, beside the same daemon
    without it, both running at once and called in alternating batches."""
    notes = list(corpus.memories(size))
    config = UNLIMITED + "agents: {ranking-agent: {inject_system_block: false}}\n"
    dbs = {mode: work / f"semantic-{mode}.db" for mode in ("off", "local")}
    for db in dbs.values():
        populate(
            db,
            {("bench-agent", Tier.MEMORY): notes, ("ranking-agent", Tier.MEMORY): notes[:50]},
        )
    # As deploy/Dockerfile runs it: one BLAS thread (the pod's CPU limit is 1).
    env = {"OPENBLAS_NUM_THREADS": "1"}
    with (
        daemon(dbs["off"], config, env=env) as off,
        daemon(dbs["local"], config + "server: {semantic_encoder: local}\n", env=env) as on,
        grpc.insecure_channel(off.api) as off_channel,
        grpc.insecure_channel(on.api) as on_channel,
    ):
        idle_off, idle_on = off.rss_bytes(), on.rss_bytes()
        # The backfill embeds the bulk-loaded tier in the background from start.
        started = time.monotonic()
        embedded = "SELECT COUNT(*) FROM memory_vectors"
        with closing(sqlite3.connect(dbs["local"])) as conn:
            while conn.execute(embedded).fetchone()[0] < len(notes) + 50:
                time.sleep(0.1)
        backfill = time.monotonic() - started
        stubs = {
            "off": pb_grpc.MemoryServiceStub(off_channel),
            "local": pb_grpc.MemoryServiceStub(on_channel),
        }
        # Every call a new question or text: the query cache never answers.
        questions = [corpus.question(n) for n in corpus.memories(2 * (count + 100))]
        texts = iter(corpus.memories(count * 4 + 200))

        def cycle(
            mode: str, make: Callable[[pb_grpc.MemoryServiceStub, str], Any], asked: list[str]
        ) -> Callable[[], Any]:
            stub, ask = stubs[mode], iter(asked)
            return lambda: make(stub, next(ask))

        def search(stub: pb_grpc.MemoryServiceStub, q: str) -> Any:
            request = pb.SearchMemoriesRequest(scope=SCOPE, query=q, limit=10)
            return stub.SearchMemories(request, timeout=30)

        def turn(stub: pb_grpc.MemoryServiceStub, q: str) -> Any:
            scope = pb.Scope(agent_id="ranking-agent", user_id="bench-user")
            request = pb.InjectForTurnRequest(scope=scope, session_id="s", user_message=q)
            return stub.InjectForTurn(request, timeout=30)

        def add(mode: str) -> Callable[[], Any]:
            stub = stubs[mode]
            scope = pb.Scope(agent_id="writer", user_id="bench-user")
            return lambda: stub.AddMemory(
                pb.AddMemoryRequest(scope=scope, content=next(texts)), timeout=30
            )

        rows: list[Row] = []
        for row, (label, make) in enumerate(
            (
                (f"SearchMemories, a tier of {size:,}", search),
                ("InjectForTurn, turn block over 50 memories", turn),
            )
        ):
            asked = questions[row * (count + 100) : (row + 1) * (count + 100)]
            a, b = interleaved(
                cycle("off", make, asked), cycle("local", make, asked), count, batch=10
            )
            rows.append([label, us(pct(a, 50)), us(pct(b, 50)), f"{pct(b, 50) / pct(a, 50):.2f}x"])
        a, b = interleaved(add("off"), add("local"), count, batch=10)
        rows.append(
            ["AddMemory", us(pct(a, 50)), us(pct(b, 50)), f"{pct(b, 50) / pct(a, 50):.2f}x"]
        )
        loaded_off, loaded_on = off.rss_bytes(), on.rss_bytes()
        rows.append(
            [
                "resident, idle",
                f"{idle_off / 2**20:,.1f} MiB",
                f"{idle_on / 2**20:,.1f} MiB",
                f"+{(idle_on - idle_off) / 2**20:,.0f} MiB",
            ]
        )
        rows.append(
            [
                f"resident, after the above ({size:,} vectors held)",
                f"{loaded_off / 2**20:,.1f} MiB",
                f"{loaded_on / 2**20:,.1f} MiB",
                f"+{(loaded_on - loaded_off) / 2**20:,.0f} MiB",
            ]
        )
        rows.append(
            [
                f"backfill of {len(notes) + 50:,} entries at start",
                "-",
                f"{backfill:,.1f} s",
                f"{(len(notes) + 50) / backfill:,.0f} entries/s",
            ]
        )
        report.figures["semantic_local_rss_mib"] = round((idle_on - idle_off) / 2**20, 1)
    report.add(
        "15. Semantic retrieval: what it costs",
        f"Two daemons at once on copies of one database, without and with "
        "`server.semantic_encoder: local` (the bundled all-MiniLM-L6-v2, one BLAS thread as "
        "in deploy/Dockerfile), called in alternating batches of 10; every search, turn "
        f"and write a new text, so the query cache never answers. {count} of each.",
        ["call", "lexical p50", "semantic p50", "ratio"],
        rows,
    )
