"""Section 12 of `make bench`: AddMemory into a tier of many memories.

Owns `bench_big_tier_writes`: interleaved AddMemory calls into an unlimited
tier of 20 memories and one of 100,000 (10,000 with --quick), both cached, on
SQLite and, with a cluster, PostgreSQL. Baseline: the 20-memory tier on the
same daemon.

Must not start or stop the cluster (the runner does) nor touch the shared
helpers; its databases are big-tier*.db, or new ones from the cluster.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import UNLIMITED, Report, Row, daemon, interleaved, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def bench_big_tier_writes(
    report: Report, work: Path, cluster: Any, corpus: Corpus, size: int, count: int
) -> None:
    rows: list[Row] = []
    targets: list[tuple[str, Path, str]] = [("SQLite", work / "big-tier.db", "")]
    if cluster is not None:
        targets.append(("PostgreSQL", work / "big-tier-pg.db", cluster.new_database()))
    small = pb.Scope(agent_id="small-agent")
    big = pb.Scope(agent_id="big-agent")
    notes = list(corpus.memories(size))
    for name, db, dsn in targets:
        populate(
            dsn or db,
            {("small-agent", Tier.MEMORY): notes[:20], ("big-agent", Tier.MEMORY): notes},
        )
        with daemon(db, UNLIMITED, dsn=dsn) as d, grpc.insecure_channel(d.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            # Each agent's tier loaded and cached, as in a running agent.
            for scope in (small, big):
                stub.InjectForTurn(
                    pb.InjectForTurnRequest(scope=scope, session_id="s", user_message="x"),
                    timeout=600,
                )
            serial = iter(range(10**9))

            def add(scope: pb.Scope) -> Callable[[], Any]:
                return lambda: stub.AddMemory(
                    pb.AddMemoryRequest(scope=scope, content=f"note {next(serial)} {uuid.uuid4()}"),
                    timeout=60,
                )

            at_small, at_big = interleaved(add(small), add(big), count)
        rows.append(
            [
                name,
                us(pct(at_small, 50)),
                us(pct(at_big, 50)),
                us(pct(at_big, 99)),
                f"{pct(at_big, 50) / pct(at_small, 50):.2f}x",
            ]
        )
    report.add(
        f"12. AddMemory into a tier of {size:,} memories",
        f"Interleaved AddMemory calls ({count} each) into an unlimited tier of 20 memories and "
        f"one of {size:,}, on one daemon, both tiers cached by a turn first. Usage comes from "
        "the tier's state row, so a write costs the same whatever the tier holds. Target: "
        "within 1.5x.",
        ["database", "20 memories p50", f"{size:,} p50", f"{size:,} p99", "ratio at p50"],
        rows,
    )
