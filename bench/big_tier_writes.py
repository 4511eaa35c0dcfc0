"""Section 12 of `make bench`: AddMemory into a tier of many memories.

Owns `bench_big_tier_writes`: interleaved AddMemory calls into an unlimited
tier of 20 memories and one of 100,000 (10,000 with --quick), both cached, on
SQLite and, with a cluster, PostgreSQL. Baselines, in the same run: the
20-memory tier on the same daemon, and raw Peewee inserts of one row per
transaction into the same `memories` table (the store's own pooled database
and bound model, so the same pragmas, indexes and triggers), interleaved
with the calls. Beside them, the SQL statements one AddMemory runs, counted
by an engine of this process on the same database and configuration (the
daemon's own count would mix in its change feed's polls), and the CPU time
the daemon spent per AddMemory while they ran (all its threads, from
/proc: "-" where there is none), steadier than wall time on a shared machine.

Must not start or stop the cluster (the runner does) nor touch the shared
helpers; its databases are big-tier*.db, or new ones from the cluster.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import UNLIMITED, Report, Row, daemon, latencies, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.config import settings
from sidecar.core.clock import to_micros
from sidecar.core.memory import Scope, Tier
from sidecar.domain.engine import MemoryEngine
from sidecar.ops.daemon import open_store
from sidecar.storage import _sqlite
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry

# The raw inserts' rows: a partition of their own in the same table.
RAW_OWNER = "raw-agent"


def bench_big_tier_writes(
    report: Report, work: Path, cluster: Any, corpus: Corpus, size: int, count: int
) -> None:
    rows: list[Row] = []
    targets: list[tuple[str, Path, str]] = [("SQLite", work / "big-tier.db", "")]
    if cluster is not None:
        targets.append(("PostgreSQL", work / "big-tier-pg.db", cluster.new_database()))
    notes = list(corpus.memories(size))
    for name, db, dsn in targets:
        populate(
            dsn or db,
            {("small-agent", Tier.MEMORY): notes[:20], ("big-agent", Tier.MEMORY): notes},
        )
        config = settings.load(_config(db), environ={}, flags={"db": dsn or str(db)})
        store = open_store(config)
        store.open()
        try:
            at_small, at_big, raw, cpu = _timed(db, dsn, store, count)
            statements = _statements(config, store)
        finally:
            store.close()
        rows.append(
            [
                name,
                us(pct(at_small, 50)),
                us(pct(at_big, 50)),
                us(pct(at_big, 99)),
                f"{pct(at_big, 50) / pct(at_small, 50):.2f}x",
                us(pct(raw, 50)),
                f"{pct(at_big, 50) / pct(raw, 50):.1f}x",
                us(cpu) if cpu else "-",
                str(statements),
            ]
        )
    report.add(
        f"12. AddMemory into a tier of {size:,} memories",
        f"Interleaved AddMemory calls ({count} each) into an unlimited tier of 20 memories and "
        f"one of {size:,}, on one daemon, both tiers cached by a turn first, and raw Peewee "
        "inserts of one row per transaction into the same table from this process (the "
        "store's pooled database and model: same pragmas, indexes and triggers), interleaved "
        "with them. Usage comes from the tier's state row, so a write costs the same whatever "
        "the tier holds. Statements: the SQL one AddMemory runs into the big tier, cached (an "
        "engine of this process on the same database and configuration, the default expiry "
        "grace). The big tier's compact index, made from its rows when the turn loaded it, "
        "is saved by the daemon in the background once (a cold start's cost): the writes are "
        "timed after. Daemon CPU: the CPU time the daemon used, all threads, per AddMemory "
        "of the timed loop (both tiers). "
        "Target: within 1.5x of the small tier.",
        [
            "database",
            "20 memories p50",
            f"{size:,} p50",
            f"{size:,} p99",
            "ratio at p50",
            "raw insert p50",
            "AddMemory / raw",
            "daemon CPU per AddMemory",
            "statements",
        ],
        rows,
    )


def _config(db: Path) -> Path:
    path = db.parent / f"{db.stem}.yaml"
    path.write_text(UNLIMITED)
    return path


def _timed(
    db: Path, dsn: str, store: Store, count: int
) -> tuple[list[float], list[float], list[float], float]:
    """AddMemory into the small and the big tier, and raw inserts, in
    alternating batches of 20 (after 50 of each unmeasured); and the
    daemon's CPU seconds per AddMemory of the timed loop (0: unknown)."""
    small = pb.Scope(agent_id="small-agent")
    big = pb.Scope(agent_id="big-agent")
    with daemon(db, UNLIMITED, dsn=dsn) as d, grpc.insecure_channel(d.api) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        # Each agent's tier loaded and cached, as in a running agent.
        for scope in (small, big):
            stub.InjectForTurn(
                pb.InjectForTurnRequest(scope=scope, session_id="s", user_message="x"),
                timeout=600,
            )
        # The big tier was indexed from its rows at that load, and the daemon
        # saves the index once, in the background: a cold start's one-off
        # cost, not a write's, so the writes are timed once it is saved.
        _index_saved(store, big.agent_id)
        serial = iter(range(10**9))

        def add(scope: pb.Scope) -> Callable[[], Any]:
            return lambda: stub.AddMemory(
                pb.AddMemoryRequest(scope=scope, content=f"note {next(serial)} {uuid.uuid4()}"),
                timeout=60,
            )

        calls = [add(small), add(big), _raw_insert(store, serial)]
        samples: list[list[float]] = [[] for _ in calls]
        for call in calls:
            latencies(call, 0, warmup=50)
        started = _cpu_seconds(d.process.pid)
        while len(samples[0]) < count:
            for call, sample in zip(calls, samples, strict=True):
                sample += latencies(call, 20, warmup=0)
        used = _cpu_seconds(d.process.pid) - started
    cpu = used / (len(samples[0]) + len(samples[1])) if started >= 0 else 0.0
    return samples[0], samples[1], samples[2], cpu


def _index_saved(store: Store, owner: str, seconds: float = 900) -> None:
    """Wait until the owner's memory tier has a persisted compact index."""
    db = store.tables.db
    sql = f"SELECT indexed FROM tier_state WHERE owner = {db.param} AND tier = 'memory'"
    deadline = time.monotonic() + seconds
    while True:
        with db.connection_context():
            row = db.execute_sql(sql, (owner,)).fetchone()
        if row is not None and int(row[0]) > 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the compact index was never persisted")
        time.sleep(0.2)


def _cpu_seconds(pid: int) -> float:
    """The user and system CPU time of process `pid`, all its threads, from
    /proc (-1.0 where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # Past the command's closing parenthesis: fields 3 onwards;
            # utime and stime are fields 14 and 15, in clock ticks.
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _raw_insert(store: Store, serial: Any) -> Callable[[], None]:
    """One row into `memories`, in a write transaction of its own: what the
    database alone takes to store a row like an AddMemory's."""
    tables = store.tables
    Memories = tables.rows  # noqa: N806 - a bound model class
    backend = tables.backend

    def insert() -> None:
        content = f"raw {next(serial)} {uuid.uuid4()}"
        now = to_micros(datetime.now(UTC))
        with backend.guard(), tables.db.connection_context(), backend.write_transaction():
            Memories.insert(
                memory_id=str(uuid.uuid4()),
                tier=Tier.MEMORY.value,
                owner=RAW_OWNER,
                content=content,
                content_chars=len(content),
                content_sha256=_sqlite.content_digest(content),
                created_at=now,
                updated_at=now,
            ).execute()

    return insert


def _statements(config: settings.Config, store: Store) -> int:
    """The SQL statements one AddMemory into the big tier runs, its tier
    cached by a turn first, as in the daemon (whose verified change feed
    spares it a freshness read)."""
    engine = MemoryEngine(config, store)
    statements: list[str] = []
    hooks = store.tables.db.query_hooks
    try:
        scope = Scope("big-agent")
        engine.inject(scope, "s", user_message="x")
        engine.add(NewEntry(scope, Tier.MEMORY, f"warm {uuid.uuid4()}"))
        hooks.append(lambda event: statements.append(event.sql))
        engine.add(NewEntry(scope, Tier.MEMORY, f"counted {uuid.uuid4()}"))
        hooks.pop()
    finally:
        engine.stop_indexing(60)
    return len(statements)
