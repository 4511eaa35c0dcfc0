"""Section 6 of `make bench`: throughput with calls in flight.

Owns `bench_concurrency`: cached InjectForTurn calls at 16 and 64 in flight
from one client process. Baseline: health checks at the same concurrency on
the same daemon.

Must not touch the sequential latencies (sections 1-2, bench.turns) nor the
shared helpers; its database is concurrency.db.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, Report, Row, daemon, populate
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def bench_concurrency(report: Report, work: Path, corpus: Corpus, seconds: float) -> None:
    db = work / "concurrency.db"
    notes = list(corpus.memories(12))
    populate(db, {("bench-agent", Tier.MEMORY): notes})
    rows: list[Row] = []
    with daemon(db, "server: {max_workers: 16}\n") as d, grpc.insecure_channel(d.api) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        for inflight in (16, 64):
            requests = [
                pb.InjectForTurnRequest(
                    scope=SCOPE, session_id=f"c{i}", user_message=corpus.question(notes[i % 12])
                )
                for i in range(inflight)
            ]
            for r in requests:
                stub.InjectForTurn(r, timeout=10)

            def throughput(call: Callable[[int], Any]) -> float:
                done = [0] * inflight
                stop = time.monotonic() + seconds

                def loop(i: int) -> None:
                    while time.monotonic() < stop:
                        call(i)
                        done[i] += 1

                with ThreadPoolExecutor(inflight) as pool:
                    list(pool.map(loop, range(inflight)))
                return sum(done) / seconds

            turns = throughput(lambda i: stub.InjectForTurn(requests[i], timeout=30))
            checks = throughput(lambda i: health.Check(health_pb2.HealthCheckRequest(), timeout=30))
            rows.append(
                [str(inflight), f"{turns:,.0f}/s", f"{checks:,.0f}/s", f"{turns / checks:.2f}"]
            )
    report.add(
        "6. Throughput with calls in flight",
        f"Cached InjectForTurn against health checks at the same concurrency, {seconds:g} s "
        "each, one client process (which shares the machine's 2 cores with the daemon).",
        ["in flight", "cached InjectForTurn", "health check", "ratio"],
        rows,
    )
