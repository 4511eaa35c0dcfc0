"""Section 3 of `make bench`: InjectForTurn rebuilding its snapshot after a write.

Owns `bench_rebuild`: one AddMemory, then the turn that reloads the changed
tier, re-indexes it and re-renders the frozen block, at each size of an
unlimited tier. Baseline: a health check on the same server (`health_floor`,
bench.measure).

Must not time the cached turn (sections 1-2, bench.turns) nor touch the
shared helpers; its databases are rebuild-N.db.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, UNLIMITED, Report, Row, daemon, health_floor, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def bench_rebuild(report: Report, work: Path, corpus: Corpus, sizes: list[int], count: int) -> None:
    rows: list[Row] = []
    for size in sizes:
        db = work / f"rebuild-{size}.db"
        populate(db, {("bench-agent", Tier.MEMORY): list(corpus.memories(size))})
        with daemon(db, UNLIMITED) as d, grpc.insecure_channel(d.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            request = pb.InjectForTurnRequest(scope=SCOPE, session_id="s", user_message="x")
            stub.InjectForTurn(request, timeout=60)
            floor = health_floor(channel, 200)
            samples = []
            for i in range(count):
                stub.AddMemory(
                    pb.AddMemoryRequest(scope=SCOPE, content=f"write {i} {uuid.uuid4()}"),
                    timeout=60,
                )
                start = time.perf_counter()
                stub.InjectForTurn(request, timeout=60)
                samples.append(time.perf_counter() - start)
            f50 = pct(floor, 50)
            rows.append(
                [
                    f"{size:,}",
                    us(pct(samples, 50)),
                    us(pct(samples, 99)),
                    f"{pct(samples, 50) / f50:,.1f}x",
                ]
            )
    report.add(
        "3. InjectForTurn rebuilding its snapshot after a write",
        f"One write, then the turn that rebuilds (reload the changed tier from SQLite, "
        f"re-index it, re-render the frozen block), {count} times per size; unlimited tier.",
        ["memories in scope", "p50", "p99", "p50 / floor"],
        rows,
    )
