"""Section 22 of `make bench`: how soon a watcher hears of a write.

Owns `bench_watch_delay` and `watch_delays`: two daemons on one database
(two processes on one SQLite file, and two replicas on PostgreSQL when the
run has a cluster), a WatchMemories stream on each, and AddMemory calls on
A. Each write is timed from the moment it is sent: to A's acknowledgement
(the baseline, the AddMemory round trip), to the event on A's own watcher
(the in-process delay), and to the event on B's watcher (across processes:
SQLite's data_version poller, or PostgreSQL's NOTIFY); B's delay is also
given from A's acknowledgement, as a client that writes and then waits for
a mirror sees it.

Must not start or stop the cluster (the runner does) nor touch the shared
helpers; its databases are watch*.db, or new ones from the cluster.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

from bench.measure import SCOPE, Report, Row, daemon, pct, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc

# Every sample adds an entry: no budget to run out of.
UNLIMITED = "defaults:\n  memory_char_limit: 0\n"


class Heard:
    """Arrival times (perf_counter) of a watch's ADD events, by id."""

    def __init__(self, stub: Any) -> None:
        self.at: dict[str, float] = {}
        self._arrived = threading.Condition()
        self.call = stub.WatchMemories(pb.WatchMemoriesRequest(scope=SCOPE))
        self.synced = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                now = time.perf_counter()
                event = response.event
                if event.kind == pb.MemoryEvent.KIND_SYNC:
                    self.synced.set()
                elif event.kind == pb.MemoryEvent.KIND_ADD:
                    with self._arrived:
                        self.at[event.id] = now
                        self._arrived.notify_all()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                raise

    def wait(self, memory_id: str) -> float:
        with self._arrived:
            if not self._arrived.wait_for(lambda: memory_id in self.at, timeout=10):
                raise RuntimeError("a write never reached a watcher")
            return self.at[memory_id]

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(10)


def watch_delays(a: Any, b: Any, samples: int, rng: Any) -> dict[str, list[float]]:
    """Seconds per write: round trip, to A's watcher, to B's watcher (from
    the send), and to B's watcher from A's acknowledgement."""
    mine, theirs = Heard(a), Heard(b)
    try:
        for heard in (mine, theirs):
            if not heard.synced.wait(10):
                raise RuntimeError("a watch never started")
        found: dict[str, list[float]] = {"ack": [], "a": [], "b": [], "b_after_ack": []}
        for i in range(samples + 5):
            # Start at a random moment relative to the poll or heartbeat.
            time.sleep(rng.uniform(0, 0.03))
            content = f"watch marker {i} {uuid.uuid4().hex[:8]}"
            sent = time.perf_counter()
            added = a.AddMemory(pb.AddMemoryRequest(scope=SCOPE, content=content), timeout=10)
            acked = time.perf_counter()
            on_a, on_b = mine.wait(added.memory.id), theirs.wait(added.memory.id)
            if i < 5:
                continue  # warm-up
            found["ack"].append(acked - sent)
            found["a"].append(on_a - sent)
            found["b"].append(on_b - sent)
            found["b_after_ack"].append(max(0.0, on_b - acked))
        return found
    finally:
        mine.close()
        theirs.close()


def bench_watch_delay(report: Report, work: Path, cluster: Any, samples: int) -> None:
    rows: list[Row] = []
    targets: list[tuple[str, Path, str]] = [("SQLite (two processes)", work / "watch.db", "")]
    if cluster is not None:
        targets.append(("PostgreSQL (two replicas)", work / "watch-pg.db", cluster.new_database()))
    for name, db, dsn in targets:
        with (
            daemon(db, UNLIMITED, dsn=dsn) as a,
            daemon(db.with_name(db.stem + "-b.db"), UNLIMITED, dsn=dsn or str(db)) as b,
            grpc.insecure_channel(a.api) as channel_a,
            grpc.insecure_channel(b.api) as channel_b,
        ):
            found = watch_delays(
                pb_grpc.MemoryServiceStub(channel_a),
                pb_grpc.MemoryServiceStub(channel_b),
                samples,
                random.Random(22),
            )
        rows.append(
            [
                name,
                str(len(found["ack"])),
                us(pct(found["ack"], 50)),
                us(pct(found["a"], 50)),
                us(pct(found["a"], 99)),
                us(pct(found["b"], 50)),
                us(pct(found["b"], 99)),
                us(pct(found["b_after_ack"], 50)),
                us(pct(found["b_after_ack"], 99)),
            ]
        )
    if cluster is None:
        report.notes.append("No PostgreSQL server here: section 22 ran SQLite only.")
    report.add(
        "22. Watch event delay",
        f"Two daemons on one database, a WatchMemories stream on each. {samples} AddMemory "
        "calls on A, each sent at a random moment, timed from the send: A's acknowledgement "
        "(the baseline: the write's round trip), the ADD event on A's own watcher (woken by "
        "the write itself), and on B's (woken by the change feed: SQLite's poller, every "
        "change_poll_ms 25, or PostgreSQL's NOTIFY). The last two columns time B's event "
        "from A's acknowledgement (0 when it came first).",
        [
            "database",
            "writes",
            "AddMemory p50",
            "on A p50",
            "on A p99",
            "on B p50",
            "on B p99",
            "B after ack p50",
            "B after ack p99",
        ],
        rows,
    )
