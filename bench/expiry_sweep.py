"""Section 19 of `make bench`: the expiry sweep's effect on turn latency over
one large tier.

Owns `bench_expiry_sweep`: a tier of 1,000,000 memories (10,000 in the quick
run, as section 13), held compactly, a tenth of them with an expiry a year
ahead. The daemon's background sweep runs every 0.2 s, with no grace (rows
go as they expire). The baseline is InjectForTurn on that tier with nothing
expired; then the tenth's expiry is moved to now (one UPDATE from outside
the daemon) and the same turns are measured while the sweep removes them,
500 per transaction, resting after each batch three times as long as it
took (PACE). Each
batch advances the tier's generation, but what it removes was hidden
already: the session keeps its frozen block, and turns read the cached
compact index with the batch applied as tombstones, or the one before it
while a batch's transaction is under way (they do not wait for it). The
machine's load average is part of the intro: the ratios are what compare.

Must not touch the shared helpers; its database is expiry-N.db, in the work
directory it is given.
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import grpc

from bench.corpus import Corpus
from bench.large_tiers import indexed_generation
from bench.measure import SCOPE, UNLIMITED, Report, daemon, latencies, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.clock import system_clock, to_micros
from sidecar.core.memory import Tier

YEAR_MICROS = 365 * 24 * 3600 * 1_000_000
# No grace (server.expiry_grace_seconds): the sweep removes what expires at once.
SWEEP = (
    "server: {compact_tier_entries: 1, expiry_sweep_seconds: 0.2, expiry_sweep_batch: 500,"
    " expiry_grace_seconds: 0}\n"
)


def _expiring(db: Path) -> int:
    """Rows with an expiry (the sweep has not removed yet)."""
    with closing(sqlite3.connect(db)) as conn:
        return int(
            conn.execute("SELECT COUNT(*) FROM memories WHERE expires_at IS NOT NULL").fetchone()[0]
        )


def _set_expiry(db: Path, at: int, *, every: int = 10) -> None:
    """Give every `every`-th row of the tier (or every row that has one) the expiry `at`."""
    with closing(sqlite3.connect(db, timeout=60)) as conn, conn:
        conn.execute(
            "UPDATE memories SET expires_at = ? WHERE owner = 'bench-agent'"
            " AND (expires_at IS NOT NULL OR seq % ? = 0)",
            (at, every),
        )


def _settled(db: Path) -> None:
    """Wait until the tier's compact index is persisted after the sweep's
    removals (a background save the daemon starts once enough writes are
    unindexed), so the turns measured after do not share the CPU with it."""
    deadline = time.monotonic() + 300
    last, since = indexed_generation(db, "bench-agent"), time.monotonic()
    while time.monotonic() - since < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        now = indexed_generation(db, "bench-agent")
        if now != last:
            last, since = now, time.monotonic()


def bench_expiry_sweep(report: Report, work: Path, corpus: Corpus, size: int) -> None:
    notes = list(corpus.memories(size))
    questions = [corpus.question(corpus.rng.choice(notes)) for _ in range(60)]
    db = work / f"expiry-{size}.db"
    populate(db, {("bench-agent", Tier.MEMORY): notes})
    _set_expiry(db, to_micros(system_clock()) + YEAR_MICROS)
    expiring = _expiring(db)
    with daemon(db, UNLIMITED + SWEEP) as d, grpc.insecure_channel(d.api) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        stub.SearchMemories(pb.SearchMemoriesRequest(scope=SCOPE, query=questions[0]), timeout=900)
        deadline = time.monotonic() + 900
        while indexed_generation(db, "bench-agent") <= 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the compact index was never persisted")
            time.sleep(0.2)
        cycle = iter(range(10**9))

        def turn() -> None:
            stub.InjectForTurn(
                pb.InjectForTurnRequest(
                    scope=SCOPE, session_id="s", user_message=questions[next(cycle) % 60]
                ),
                timeout=60,
            )

        baseline = latencies(turn, 300, warmup=20)
        # The 1-minute load average after each phase (other jobs share the cores).
        load = [os.getloadavg()[0]]
        _set_expiry(db, to_micros(system_clock()))
        sweeping: list[float] = []
        started = time.perf_counter()
        while _expiring(db):
            sweeping += latencies(turn, 20, warmup=0)
            if time.perf_counter() - started > 1800:
                raise RuntimeError("the sweep never finished")
        took = time.perf_counter() - started
        load.append(os.getloadavg()[0])
        _settled(db)
        after = latencies(turn, 300, warmup=20)
        load.append(os.getloadavg()[0])
    rows = [
        ["no sweep (baseline)", str(len(baseline)), us(pct(baseline, 50)), us(pct(baseline, 99))],
        [
            f"while the sweep removes {expiring:,} ({took:,.1f} s)",
            str(len(sweeping)),
            f"{us(pct(sweeping, 50))} ({pct(sweeping, 50) / pct(baseline, 50):.2f}x)",
            f"{us(pct(sweeping, 99))} ({pct(sweeping, 99) / pct(baseline, 99):.2f}x)",
        ],
        [
            "after the sweep",
            str(len(after)),
            f"{us(pct(after, 50))} ({pct(after, 50) / pct(baseline, 50):.2f}x)",
            f"{us(pct(after, 99))} ({pct(after, 99) / pct(baseline, 99):.2f}x)",
        ],
    ]
    report.add(
        "19. The expiry sweep and turn latency",
        f"One unlimited tier of {size:,} memories held compactly, a tenth of them expiring. "
        "InjectForTurn (one session, a new message each turn) with nothing expired (the "
        "baseline), then while the background sweep (every 0.2 s, 500 rows per transaction) "
        "removes the tenth, after their expiry was moved to now, and after it is done (and "
        "the index the daemon persists again since has been saved). The sweep rests after "
        "each batch three times as long as the batch took. Each batch advances the tier's "
        "generation, "
        "but removes only entries hidden already: the session keeps its frozen block, and "
        "the cached compact index takes the batch as tombstones (no reload); a turn that "
        "comes while a batch's transaction is under way reads the index as it was before "
        "the batch instead of waiting for it. Ratios are against the baseline. The machine's "
        "1-minute load average after the baseline, the sweep and the turns after it: "
        + ", ".join(f"{x:.1f}" for x in load)
        + ".",
        ["turns", "count", "p50", "p99"],
        rows,
    )
