"""Section 4 of `make bench`: SearchMemories against the seed's AND-LIKE scan.

Owns `bench_search` and its baseline `like_scan`: the seed's
`content LIKE '%kw%' AND ...` over the same rows, run directly in SQLite in
this process (no gRPC: the baseline gets the benefit of the doubt). Also adds
the note on how search latency grows with the tier.

Must not make `like_scan` anything but the seed's search (it is the baseline)
nor touch the shared helpers; its databases are search-N.db.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, UNLIMITED, Report, Row, daemon, latencies, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def like_scan(db: Path, owner: str, keywords: list[str]) -> Callable[[], Any]:
    """The seed's search: every keyword must appear, LIKE '%kw%' each."""
    conn = sqlite3.connect(db, check_same_thread=False)
    sql = (
        "SELECT id, content FROM memories WHERE owner = ? AND tier = 'memory'"
        + " AND content LIKE ?" * len(keywords)
        + " ORDER BY seq"
    )
    params = [owner, *[f"%{k}%" for k in keywords]]
    return lambda: conn.execute(sql, params).fetchall()


def bench_search(report: Report, work: Path, corpus: Corpus, sizes: list[int], count: int) -> None:
    rows: list[Row] = []
    ours: dict[int, float] = {}
    for size in sizes:
        db = work / f"search-{size}.db"
        notes = list(corpus.memories(size))
        populate(db, {("bench-agent", Tier.MEMORY): notes})
        questions = [corpus.question(corpus.rng.choice(notes)) for _ in range(count)]
        keyword_sets = [[w for w in q.rstrip("?").split()[5:]] for q in questions]
        with daemon(db, UNLIMITED) as d, grpc.insecure_channel(d.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            stub.SearchMemories(pb.SearchMemoriesRequest(scope=SCOPE, query="warm"), timeout=120)
            cycle = iter(range(10**9))

            def search() -> Any:
                q = questions[next(cycle) % len(questions)]
                return stub.SearchMemories(
                    pb.SearchMemoriesRequest(scope=SCOPE, query=q, limit=20), timeout=60
                )

            mine = latencies(search, count, warmup=10)
        scans = [like_scan(db, "bench-agent", k) for k in keyword_sets]
        cycle2 = iter(range(10**9))
        baseline = latencies(lambda: scans[next(cycle2) % len(scans)](), count, warmup=5)
        ours[size] = pct(mine, 50)
        rows.append(
            [
                f"{size:,}",
                us(pct(mine, 50)),
                us(pct(mine, 99)),
                us(pct(baseline, 50)),
                us(pct(baseline, 99)),
                f"{pct(baseline, 50) / pct(mine, 50):,.1f}x",
            ]
        )
    if len(sizes) > 1:
        first, last = sizes[0], sizes[-1]
        slope = (ours[last] - ours[first]) / (last - first)
        report.notes.append(
            f"Search latency grows by {slope * 1e6 * 1000:,.1f} µs per 1,000 memories "
            f"from {first:,} to {last:,} (p50 {us(ours[first])} to {us(ours[last])})."
        )
    report.add(
        "4. SearchMemories against the seed's AND-LIKE scan",
        f"Five-keyword questions drawn from stored memories, {count} per size, ranked search "
        "over gRPC (limit 20) against the seed's `content LIKE '%kw%' AND ...` on the same "
        "rows, run directly in SQLite in this process (no gRPC: the baseline gets the benefit "
        "of the doubt). Target: at 100,000 memories, at least 10x faster at p50.",
        ["memories", "ranked p50", "ranked p99", "AND-LIKE p50", "AND-LIKE p99", "speed-up at p50"],
        rows,
    )
