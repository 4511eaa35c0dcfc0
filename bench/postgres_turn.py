"""Section 9 of `make bench`: the cached turn on PostgreSQL.

Owns `bench_postgres_turn`: as sections 1-2 (bench.turns, TCP loopback), with
the daemon on PostgreSQL and its change listener running. Baseline: a health
check on the same server, interleaved (`cached_turns`, bench.measure).

Must not start or stop the cluster (the runner does, with `postgres()`) nor
touch the shared helpers; it takes a new database from the cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, Report, cached_turns, daemon, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.core.memory import Tier


def bench_postgres_turn(report: Report, work: Path, cluster: Any, count: int) -> None:
    dsn = cluster.new_database()
    notes = list(Corpus().memories(12))
    populate(dsn, {("bench-agent", Tier.MEMORY): notes[:8], ("bench-user", Tier.USER): notes[8:]})
    with daemon(work / "pg-turn.db", dsn=dsn) as d, grpc.insecure_channel(d.api) as channel:
        request = pb.InjectForTurnRequest(scope=SCOPE, session_id="cached", user_message="x")
        floor, cached, queries = cached_turns(d, channel, request, count)
        verified = d.metric("memory_change_feed_verified")
    f50 = pct(floor, 50)
    report.add(
        "9. The cached turn on PostgreSQL",
        f"As in 1-2 (TCP loopback, {count} calls each, interleaved), with the daemon on "
        "PostgreSQL and its change listener running. Target: the same ratio as on SQLite, "
        "and zero database queries.",
        ["call", "p50", "p99", "p50 / floor", "database"],
        [
            ["health check (floor)", us(f50), us(pct(floor, 99)), "1.00x", "-"],
            [
                "InjectForTurn, cached",
                us(pct(cached, 50)),
                us(pct(cached, 99)),
                f"{pct(cached, 50) / f50:.2f}x",
                f"{queries:.0f} queries, change feed verified={verified:.0f}",
            ],
        ],
    )
