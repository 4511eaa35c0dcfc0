"""Section 23 of `make bench`: read-your-writes across replicas, and what the
consistency token (min_generation) costs.

Owns `bench_read_your_writes`: two daemon processes on one database (one
SQLite file, and PostgreSQL when the run has a cluster). Each sample is an
AddMemory on A followed at once by a SearchMemories on B for the new entry:
half the samples pass the write's generation as min_generation, half do not
(the same-run baseline), in random order. Reported: B's read latency (p50,
p99) and how many reads missed the acknowledged write.

Must not start or stop the cluster (the runner does) nor touch the shared
helpers; its databases are ryw*.db, or new ones from the cluster.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, Report, Row, daemon, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def read_after_write(
    writer: Any, reader: Any, samples: int, rng: Any
) -> dict[bool, tuple[list[float], int]]:
    """For with and without the token: B's read latencies (s) and how many
    of those reads missed the write A had just acknowledged."""
    # B holds the tier in its caches, as a serving replica does.
    reader.SearchMemories(pb.SearchMemoriesRequest(scope=SCOPE, query="warm"), timeout=10)
    results: dict[bool, tuple[list[float], int]] = {True: ([], 0), False: ([], 0)}
    modes = [True, False] * samples
    rng.shuffle(modes)
    for token in modes:
        marker = f"ryw{uuid.uuid4().hex[:12]}"
        ack = writer.AddMemory(pb.AddMemoryRequest(scope=SCOPE, content=marker), timeout=10)
        request = pb.SearchMemoriesRequest(
            scope=SCOPE, query=marker, min_generation=ack.generation if token else 0
        )
        started = time.perf_counter()
        hits = reader.SearchMemories(request, timeout=10)
        elapsed = time.perf_counter() - started
        latencies, stale = results[token]
        latencies.append(elapsed)
        missed = not any(marker in hit.memory.content for hit in hits.hits)
        results[token] = (latencies, stale + missed)
        writer.DeleteMemory(pb.DeleteMemoryRequest(scope=SCOPE, id=ack.memory.id), timeout=10)
    return results


# Busy processes that load the CPU while a row is measured: the stale reads
# the issue saw (6-24% on replica B) happened under load. Each stops by
# itself after BURN_SECONDS at the latest.
BURNERS = 2
BURN_SECONDS = 120


@contextlib.contextmanager
def cpu_load(on: bool) -> Iterator[None]:
    burn = f"import time\nend = time.time() + {BURN_SECONDS}\nwhile time.time() < end: pass"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(BURNERS if on else 0)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def bench_read_your_writes(
    report: Report, work: Path, cluster: Any, corpus: Corpus, samples: int
) -> None:
    rows: list[Row] = []
    targets: list[tuple[str, Path, str]] = [("SQLite (two processes)", work / "ryw.db", "")]
    if cluster is not None:
        targets.append(("PostgreSQL", work / "ryw-pg.db", cluster.new_database()))
    for (name, db, dsn), loaded in [(t, on) for t in targets for on in (False, True)]:
        if not loaded:
            populate(dsn or db, {("bench-agent", Tier.MEMORY): list(corpus.memories(8))})
        with (
            daemon(db, dsn=dsn) as a,
            daemon(db.with_name(db.stem + "-b.db"), dsn=dsn or str(db)) as b,
            grpc.insecure_channel(a.api) as channel_a,
            grpc.insecure_channel(b.api) as channel_b,
            cpu_load(loaded),
        ):
            results = read_after_write(
                pb_grpc.MemoryServiceStub(channel_a),
                pb_grpc.MemoryServiceStub(channel_b),
                samples,
                corpus.rng,
            )
        base, base_stale = results[False]
        with_token, token_stale = results[True]
        rows.append(
            [
                name + (f", {BURNERS} CPU burners" if loaded else ""),
                str(len(base)),
                us(pct(base, 50)),
                us(pct(base, 99)),
                f"{base_stale / len(base):.0%}",
                us(pct(with_token, 50)),
                us(pct(with_token, 99)),
                f"{token_stale / len(with_token):.0%}",
                f"{pct(with_token, 50) / pct(base, 50):.2f}x",
            ]
        )
    report.add(
        "23. Read-your-writes across replicas: the cost of min_generation",
        f"Two daemon processes on one database. {2 * samples} times: AddMemory on A, then "
        "at once SearchMemories on B for the new entry; half of the reads pass the write's "
        "generation as min_generation, half do not (the baseline), in random order. Stale: "
        "reads that missed the acknowledged write (with the token it must be 0%). Default "
        "settings (SQLite polls every 25 ms; PostgreSQL notifies). Each database twice: as "
        f"the machine is, and with {BURNERS} busy processes loading the CPU.",
        [
            "database",
            "reads each",
            "without p50",
            "without p99",
            "without: stale",
            "with token p50",
            "with token p99",
            "with token: stale",
            "p50 ratio",
        ],
        rows,
    )
