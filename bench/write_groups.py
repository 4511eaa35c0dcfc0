"""Section 27 of `make bench`: adds in flight, sharing commits.

Owns `bench_write_groups`: `Store.add` from 1, 4, 16 and 64 threads of this
process (each thread its own partition, no budget), with server.group_commit
off and on, on SQLite and, when there is a cluster, on PostgreSQL (which
never groups: writers of different partitions hold different row locks and
run at once); then AddMemory over gRPC at 16 in flight (16 agents), off and
on, beside health checks at the same concurrency (the most any RPC reaches),
with the daemon's CPU time a call (from /proc: wall-clock rates on a shared
machine swing with the other jobs' load, CPU a call far less), and health
checks at 16 in flight against a bare grpc server (bench.bare_server: no
sidecar code, no interceptors), the ceiling of any RPC on the machine.
Baseline: raw Peewee inserts of one row per transaction, one after another,
with the same pragmas, in this process (raw psycopg on PostgreSQL), measured
before and after the store's figures and averaged.

Must not touch the sequential writes (sections 5 and 10, bench.writes and
bench.postgres_writes) nor the shared helpers; its databases are groups-*.db.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.corpus import Corpus
from bench.measure import UNLIMITED, Report, Row, daemon
from bench.writes import raw_insert_rate
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Scope, Tier
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry, TierPolicy

IN_FLIGHT = (1, 4, 16, 64)
NO_BUDGET = TierPolicy(0)


def bench_write_groups(
    report: Report, work: Path, corpus: Corpus, count: int, cluster: Any = None
) -> None:
    texts = list(corpus.memories(count))
    rows: list[Row] = []
    raw = [_raw_sqlite(work, count)]
    cells = {
        (inflight, grouped): _store_rate(
            str(work / f"groups-{inflight}-{grouped}.db"), texts, inflight, grouped
        )
        for inflight in IN_FLIGHT
        for grouped in (False, True)
    }
    raw.append(_raw_sqlite(work, count))
    baseline = sum(raw) / len(raw)
    for inflight in IN_FLIGHT:
        off, _ = cells[(inflight, False)]
        on, per_commit = cells[(inflight, True)]
        rows.append(_row("SQLite", f"Store.add x{inflight}", off, on, baseline, per_commit))
    on_grpc = {grouped: _grpc_rate(work, texts, grouped) for grouped in (False, True)}
    off_grpc, grouped = on_grpc[False], on_grpc[True]
    over = _row("SQLite", "AddMemory over gRPC x16", off_grpc.adds, grouped.adds, baseline, 0)
    rows.append([*over, _cpu(off_grpc.add_cpu, grouped.add_cpu)])
    checks = f"{grouped.checks:,.0f}/s"
    rows.append(
        ["SQLite", "health check over gRPC x16", "", checks, "", "", "", _cpu(grouped.check_cpu)]
    )
    bare, bare_cpu = _bare_rate(len(texts))
    rows.append(
        [
            "-",
            "health check x16, bare grpc server",
            "",
            f"{bare:,.0f}/s",
            f"{baseline:,.0f}/s",
            f"{bare / baseline:.2f}",
            "",
            _cpu(bare_cpu),
        ]
    )
    if cluster is not None:
        rows.extend(_postgres_rows(cluster, texts, count))
    rows = [row + [""] * (8 - len(row)) for row in rows]
    report.add(
        "27. Adds in flight, sharing commits",
        f"{count:,} adds per figure from threads of this process, each thread writing its own "
        "partition, with server.group_commit off and on (SQLite: the adds that arrive while one "
        "commits share the next transaction, each in its own savepoint), against raw inserts "
        "of one row per transaction one after another, in this process, with the same pragmas "
        "(raw psycopg on PostgreSQL, which never groups). Over gRPC the client's 16 threads "
        "and the daemon share the machine's cores: health checks at the same concurrency are "
        "the most calls a second any of the daemon's RPCs reaches, and health checks against a "
        "bare grpc server (no sidecar code) the most any RPC of a Python sync server reaches "
        "here. The last column is the daemon's CPU time a call (off / on), "
        "which the other jobs on a shared machine move far less than its rate.",
        [
            "database",
            "writes",
            "grouping off",
            "grouping on",
            "raw insert",
            "on / raw",
            "adds per commit",
            "daemon CPU a call",
        ],
        rows,
    )


def _row(db: str, what: str, off: float, on: float, raw: float, per_commit: float) -> Row:
    return [
        db,
        what,
        f"{off:,.0f}/s",
        f"{on:,.0f}/s" if on else "",
        f"{raw:,.0f}/s",
        f"{(on or off) / raw:.2f}",
        f"{per_commit:.1f}" if per_commit else "",
    ]


def _in_flight(calls: int, inflight: int, call: Callable[[int, int], object]) -> float:
    """Calls per second: `calls` calls of call(slot, i), from `inflight` threads."""
    per = calls // inflight

    def loop(slot: int) -> None:
        for i in range(per):
            call(slot, slot * per + i)

    start = time.perf_counter()
    if inflight == 1:
        loop(0)
    else:
        with ThreadPoolExecutor(inflight) as pool:
            list(pool.map(loop, range(inflight)))
    return per * inflight / (time.perf_counter() - start)


def _store_rate(db: str, texts: list[str], inflight: int, grouped: bool) -> tuple[float, float]:
    """Store.add throughput, and the adds per commit (grouped)."""
    store = Store(db, group_commit=grouped)
    store.open()
    try:

        def add(slot: int, i: int) -> None:
            store.add(NewEntry(Scope(f"agent-{slot}"), Tier.MEMORY, texts[i]), NO_BUDGET)

        rate = _in_flight(len(texts), inflight, add)
        counts = store.group_commit
        return rate, (counts.writes / counts.commits if counts.commits else 0.0)
    finally:
        store.close()


def _raw_sqlite(work: Path, count: int) -> float:
    texts = [f"raw note {i}" for i in range(count)]
    return raw_insert_rate(work / f"groups-raw-{uuid.uuid4().hex}.db", texts)


class _OverGrpc(NamedTuple):
    """AddMemory and health checks at 16 in flight: calls per second, and
    the daemon's CPU seconds a call (None where /proc is not there)."""

    adds: float
    add_cpu: float | None
    checks: float
    check_cpu: float | None


def _daemon_cpu(pid: int) -> float | None:
    """The process's user and system CPU seconds so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(*seconds: float | None) -> str:
    if any(s is None for s in seconds):
        return ""
    return " / ".join(f"{s * 1000:.2f} ms" for s in seconds if s is not None)


def _bare_rate(calls: int) -> tuple[float, float | None]:
    """Health checks a second at 16 in flight against bench.bare_server, and
    its CPU seconds a call."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.bare_server"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            grpc.channel_ready_future(channel).result(timeout=60)

            def check(_slot: int, _i: int) -> None:
                health.Check(health_pb2.HealthCheckRequest(), timeout=60)

            _in_flight(calls // 4, 16, check)  # warm-up
            started = _daemon_cpu(process.pid)
            rate = _in_flight(calls, 16, check)
            ended = _daemon_cpu(process.pid)
    finally:
        process.kill()
        process.wait()
    if started is None or ended is None:
        return rate, None
    return rate, (ended - started) / (calls // 16 * 16)


def _grpc_rate(work: Path, texts: list[str], grouped: bool) -> _OverGrpc:
    """AddMemory and health checks over gRPC, 16 in flight (16 agents)."""
    config = UNLIMITED + f"server: {{max_workers: 16, group_commit: {str(grouped).lower()}}}\n"
    db = work / f"groups-grpc-{grouped}.db"
    with daemon(db, config) as d, grpc.insecure_channel(d.api) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        pid = d.process.pid

        def add(slot: int, i: int) -> None:
            scope = pb.Scope(agent_id=f"agent-{slot}")
            stub.AddMemory(pb.AddMemoryRequest(scope=scope, content=texts[i]), timeout=60)

        def check(_slot: int, _i: int) -> None:
            health.Check(health_pb2.HealthCheckRequest())

        started = _daemon_cpu(pid)
        adds = _in_flight(len(texts), 16, add)
        between = _daemon_cpu(pid)
        checks = _in_flight(len(texts), 16, check)
        ended = _daemon_cpu(pid)
    if started is None or between is None or ended is None:
        return _OverGrpc(adds, None, checks, None)
    calls = len(texts) // 16 * 16
    return _OverGrpc(adds, (between - started) / calls, checks, (ended - between) / calls)


def _postgres_rows(cluster: Any, texts: list[str], count: int) -> list[Row]:
    import psycopg

    dsn = cluster.new_database()
    with psycopg.connect(dsn) as connection:
        connection.execute("CREATE TABLE notes (id TEXT PRIMARY KEY, content TEXT, created BIGINT)")
        connection.commit()
        start = time.perf_counter()
        for i in range(count):
            with connection.transaction():
                connection.execute(
                    "INSERT INTO notes VALUES (%s, %s, %s)", (str(uuid.uuid4()), f"raw {i}", 0)
                )
        raw = count / (time.perf_counter() - start)
    rows: list[Row] = []
    for inflight in IN_FLIGHT:
        rate, _ = _store_rate(cluster.new_database(), texts, inflight, grouped=False)
        rows.append(_row("PostgreSQL", f"Store.add x{inflight}", rate, 0, raw, 0))
    return rows
