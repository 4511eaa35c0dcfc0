"""Section 11 of `make bench`: a write on one replica, seen by another.

Owns `bench_propagation` and `propagation`: two daemons on one database
(SQLite, and PostgreSQL when the run has a cluster); how long after A
acknowledges an add or a delete B's next turn shows it. Baseline: A's own next
turn after the same write.

Must not start or stop the cluster (the runner does) nor touch the shared
helpers; its databases are replicas*.db, or new ones from the cluster.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, Report, Row, daemon, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def propagation(
    writer: Any, reader: Any, samples: int, rng: Any
) -> tuple[list[float], list[float]]:
    """Seconds from a write's acknowledgement by `writer` until it shows in
    `reader`'s next turn (an add appearing, then a delete disappearing), and
    the same for the writer's own next turn (the baseline)."""
    turn = pb.InjectForTurnRequest(scope=SCOPE, session_id="watch", user_message="x")
    reader.InjectForTurn(turn, timeout=10)
    writer.InjectForTurn(turn, timeout=10)
    remote: list[float] = []
    local: list[float] = []

    def until(stub: Any, shown: Callable[[str], bool], since: float) -> float:
        while not shown(stub.InjectForTurn(turn, timeout=10).system_block):
            if time.perf_counter() - since > 10:
                raise RuntimeError("a write never reached the other replica")
        return time.perf_counter() - since

    for i in range(samples):
        marker = f"propagation marker {i} {uuid.uuid4().hex[:8]}"
        # Start at a random moment relative to the reader's poll or heartbeat.
        time.sleep(rng.uniform(0, 0.03))
        added = writer.AddMemory(pb.AddMemoryRequest(scope=SCOPE, content=marker), timeout=10)
        acked = time.perf_counter()
        remote.append(until(reader, lambda block: marker in block, acked))
        local.append(until(writer, lambda block: marker in block, time.perf_counter()))
        time.sleep(rng.uniform(0, 0.03))
        writer.DeleteMemory(
            pb.DeleteMemoryRequest(scope=SCOPE, id=added.memory.id),
            timeout=10,
        )
        acked = time.perf_counter()
        remote.append(until(reader, lambda block: marker not in block, acked))
        local.append(until(writer, lambda block: marker not in block, time.perf_counter()))
    return remote, local


def bench_propagation(
    report: Report, work: Path, cluster: Any, corpus: Corpus, samples: int
) -> None:
    rows: list[Row] = []
    targets: list[tuple[str, Path, str]] = [("SQLite (one file)", work / "replicas.db", "")]
    if cluster is not None:
        targets.append(("PostgreSQL", work / "replicas-pg.db", cluster.new_database()))
    for name, db, dsn in targets:
        populate(dsn or db, {("bench-agent", Tier.MEMORY): list(corpus.memories(8))})
        with (
            daemon(db, dsn=dsn) as a,
            daemon(db.with_name(db.stem + "-b.db"), dsn=dsn or str(db)) as b,
            grpc.insecure_channel(a.api) as channel_a,
            grpc.insecure_channel(b.api) as channel_b,
        ):
            remote, local = propagation(
                pb_grpc.MemoryServiceStub(channel_a),
                pb_grpc.MemoryServiceStub(channel_b),
                samples,
                corpus.rng,
            )
        rows.append(
            [
                name,
                str(len(remote)),
                us(pct(remote, 50)),
                us(pct(remote, 99)),
                us(max(remote)),
                us(pct(local, 50)),
                us(pct(local, 99)),
            ]
        )
    report.add(
        "11. A write on one replica, seen by another",
        f"Two daemons on one database. {samples} times: AddMemory on A, then B's turns until "
        "its system block shows the memory; DeleteMemory on A, then B's turns until it is "
        "gone. Timed from A's acknowledgement; started at random moments so the samples "
        "cover SQLite's poll interval (change_poll_ms 25) and PostgreSQL's notifications. "
        "The baseline is A's own next turn after the same write. Target: p99 within 100 ms.",
        ["database", "writes", "B p50", "B p99", "B max", "A's own turn p50", "A's own p99"],
        rows,
    )
