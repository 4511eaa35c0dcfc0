"""What every section of `make bench` measures with: the daemon, latencies, the report.

Owns the shared helpers: a daemon as a real subprocess (`daemon()`, `Daemon`:
its addresses, VmRSS and metrics), latency sampling (`latencies`,
`interleaved`, `pct`, `us`), bulk loading (`populate`), the `Report` the
sections add their tables and figures to, the scope and config most sections
use, the same-run floors several baselines are (`health_floor`,
`cached_turns`) and the throwaway PostgreSQL cluster (`postgres()`). It
measures nothing by itself and compares against nothing.

Must not import a section module or bench.run (they import this, never the
other way round), nor write the report files (bench.report does). A change
here moves every section's figures: keep to what they all mean alike.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Memory, Tier
from sidecar.storage import archive
from sidecar.storage.store import Store

SERVING = re.compile(r"serving api=(\S+) health=(\S+) metrics=(\S+)(?: mcp=(\S+))?")


# --- the daemon ----------------------------------------------------------------


@dataclass
class Daemon:
    process: subprocess.Popen[str]
    api: str
    metrics: str
    # The MCP listener's URL, when the config sets server.mcp_listen ("-": off).
    mcp: str = "-"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10) as response:
            text = response.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextmanager
def daemon(
    db: Path,
    config: str = "",
    listen: str = "127.0.0.1:0",
    dsn: str = "",
    env: dict[str, str] | None = None,
) -> Iterator[Daemon]:
    """A daemon on the SQLite file `db`, or on PostgreSQL at `dsn` (its
    config file then still goes beside `db`), with `env` added to ours."""
    path = db.parent / f"{db.stem}.yaml"
    path.write_text(config or "{}\n")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--db",
            dsn or str(db),
            "--listen",
            listen,
            "--metrics-listen",
            "127.0.0.1:0",
            "--config",
            str(path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    assert process.stderr is not None
    running = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and running is None:
        line = process.stderr.readline()
        if not line:
            break
        match = SERVING.search(line)
        if match:
            running = Daemon(process, match[1], match[3], match[4] or "-")
    if running is None:
        process.kill()
        raise RuntimeError("daemon did not start")
    # Keep reading the log so a chatty daemon never blocks on a full pipe.
    stderr = process.stderr
    threading.Thread(target=lambda: [None for _ in stderr], daemon=True).start()
    try:
        yield running
    finally:
        running.stop()


# --- measuring -------------------------------------------------------------------


def latencies(call: Callable[[], Any], count: int, warmup: int = 50) -> list[float]:
    for _ in range(warmup):
        call()
    out = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def interleaved(
    first: Callable[[], Any], second: Callable[[], Any], count: int, batch: int = 20
) -> tuple[list[float], list[float]]:
    """Latencies of two calls measured in alternating batches."""
    a: list[float] = []
    b: list[float] = []
    latencies(first, 0, warmup=50)
    latencies(second, 0, warmup=50)
    while len(a) < count:
        a += latencies(first, batch, warmup=0)
        b += latencies(second, batch, warmup=0)
    return a, b


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs" if seconds < 0.01 else f"{seconds * 1e3:,.1f} ms"


def populate(db: Path | str, scopes: dict[tuple[str, Tier], list[str]]) -> None:
    """Bulk-load memories straight into the store (no budgets), like `import`."""
    store = Store(str(db))
    store.open()
    now = datetime.now(UTC)
    entries = [
        (owner, Memory(str(uuid.uuid4()), tier, text, "", 0.5 + (i % 5) / 10, now, now))
        for (owner, tier), texts in scopes.items()
        for i, text in enumerate(texts)
    ]
    archive.restore(store, entries)
    store.close()


Row = list[str]


@dataclass
class Report:
    quick: bool
    sections: list[tuple[str, str, list[str], list[Row]]]
    notes: list[str]
    # Figures other files are checked against (docs/benchmarks.json).
    figures: dict[str, Any] = field(default_factory=dict)

    def add(self, title: str, intro: str, headers: list[str], rows: list[Row]) -> None:
        self.sections.append((title, intro, headers, rows))
        print(f"\n## {title}", flush=True)
        for row in rows:
            print("  " + " | ".join(row), flush=True)


# --- what several sections share -------------------------------------------------

SCOPE = pb.Scope(agent_id="bench-agent", user_id="bench-user")
UNLIMITED = "defaults: {memory_char_limit: 0, user_char_limit: 0, max_injection_tokens: 2000}\n"


def health_floor(channel: grpc.Channel, count: int) -> list[float]:
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest()
    return latencies(lambda: stub.Check(request, timeout=10), count)


def cached_turns(
    d: Daemon, channel: grpc.Channel, request: pb.InjectForTurnRequest, count: int
) -> tuple[list[float], list[float], float]:
    """Health checks and cached turns, interleaved so both see the same
    moments of a noisy machine, and how many queries the turns ran."""
    stub = pb_grpc.MemoryServiceStub(channel)
    stub.InjectForTurn(request, timeout=10)  # builds the snapshot
    health = health_pb2_grpc.HealthStub(channel)
    check = health_pb2.HealthCheckRequest()
    queries_before = d.metric("memory_db_queries_total")
    floor, cached = interleaved(
        lambda: health.Check(check, timeout=10),
        lambda: stub.InjectForTurn(request, timeout=10),
        count,
    )
    return floor, cached, d.metric("memory_db_queries_total") - queries_before


# --- PostgreSQL, for sections 9-12 ---------------------------------------------------


@contextmanager
def postgres() -> Iterator[Any]:
    """A throwaway PostgreSQL cluster with the server's durable defaults
    (fsync on), or None when this machine has no PostgreSQL server."""
    from tests import pg  # the test suite's cluster, reused

    bin_dir = pg.bindir()
    if bin_dir is None:
        yield None
        return
    cluster = pg.Cluster(bin_dir, durable=True)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
