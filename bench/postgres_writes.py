"""Section 10 of `make bench`: sustained writes on PostgreSQL.

Owns `bench_postgres_writes`: sequential AddMemory calls with the daemon on
PostgreSQL. Baseline: raw psycopg inserts, one transaction each, in this
process, over the same Unix socket (as section 5, bench.writes, on SQLite).

Must not start or stop the cluster (the runner does) nor touch the shared
helpers; it takes new databases from the cluster.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, UNLIMITED, Report, daemon
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc


def bench_postgres_writes(report: Report, work: Path, cluster: Any, count: int) -> None:
    import psycopg

    texts = list(Corpus().memories(count * 2))
    dsn = cluster.new_database()
    with daemon(work / "pg-writes.db", UNLIMITED, dsn=dsn) as d, grpc.insecure_channel(d.api) as ch:
        stub = pb_grpc.MemoryServiceStub(ch)
        start = time.perf_counter()
        for text in texts[:count]:
            stub.AddMemory(pb.AddMemoryRequest(scope=SCOPE, content=text), timeout=60)
        grpc_rate = count / (time.perf_counter() - start)
    with psycopg.connect(cluster.new_database()) as connection:
        connection.execute("CREATE TABLE notes (id TEXT PRIMARY KEY, content TEXT, created BIGINT)")
        connection.commit()
        start = time.perf_counter()
        for text in texts[count:]:
            with connection.transaction():
                connection.execute(
                    "INSERT INTO notes VALUES (%s, %s, %s)", (str(uuid.uuid4()), text, 0)
                )
        raw_rate = count / (time.perf_counter() - start)
    report.add(
        "10. Sustained writes on PostgreSQL",
        f"{count:,} sequential AddMemory calls (lock the tier's state row, de-duplicate, "
        "insert, advance the generation, notify; one transaction each) against raw psycopg "
        "inserts, one transaction each, in this process, over the same Unix socket. The "
        "server runs with its durable defaults (fsync on, synchronous_commit on).",
        ["AddMemory over gRPC", "raw psycopg insert", "ratio"],
        [[f"{grpc_rate:,.0f}/s", f"{raw_rate:,.0f}/s", f"{grpc_rate / raw_rate:.2f}"]],
    )
