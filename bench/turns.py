"""Sections 1-2 of `make bench`: the floor and the cached turn.

Owns `bench_floor_and_cached_turn`: a cached InjectForTurn (snapshot built,
no database queries) and one whose turn block ranks the same memories, over
TCP loopback and a Unix socket. Baseline: a health check on the same server,
interleaved with the turns (`cached_turns`, in bench.measure, shared with
section 9).

Must not touch the shared helpers (change them in bench.measure, for every
section) nor the report files; its database is turn.db.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, Report, Row, cached_turns, daemon, interleaved, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def bench_floor_and_cached_turn(report: Report, work: Path, corpus: Corpus, count: int) -> float:
    db = work / "turn.db"
    notes = list(corpus.memories(12))
    populate(
        db,
        {
            ("bench-agent", Tier.MEMORY): notes[:8],
            ("bench-user", Tier.USER): notes[8:],
            ("ranking-agent", Tier.MEMORY): notes[:8],
        },
    )
    config = "agents: {ranking-agent: {inject_system_block: false}}\n"
    rows: list[Row] = []
    floor_tcp = 0.0
    for transport, listen in (
        ("TCP loopback", "127.0.0.1:0"),
        ("Unix socket", f"unix:{work / 'api.sock'}"),
    ):
        with daemon(db, config, listen=listen) as d, grpc.insecure_channel(d.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            request = pb.InjectForTurnRequest(
                scope=SCOPE, session_id="cached", user_message=corpus.question(notes[0])
            )
            floor, cached, queries = cached_turns(d, channel, request, count)
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest()
            hits = d.metric("memory_snapshot_lookups_total", result="hit")
            f50, c50 = pct(floor, 50), pct(cached, 50)
            if transport == "TCP loopback":
                floor_tcp = f50
            rows.append(
                [transport, "health check (floor)", us(f50), us(pct(floor, 99)), "1.00x", "-"]
            )
            ranked_request = pb.InjectForTurnRequest(
                scope=pb.Scope(agent_id="ranking-agent", user_id="bench-user"),
                session_id="ranked",
                user_message=request.user_message,
            )
            stub.InjectForTurn(ranked_request, timeout=10)
            _, ranked = interleaved(
                lambda: health.Check(check, timeout=10),
                lambda: stub.InjectForTurn(ranked_request, timeout=10),
                count // 2,
            )
            rows.append(
                [
                    transport,
                    "InjectForTurn, cached, ranking the turn block",
                    us(pct(ranked, 50)),
                    us(pct(ranked, 99)),
                    f"{pct(ranked, 50) / f50:.2f}x",
                    "system block off",
                ]
            )
            rows.append(
                [
                    transport,
                    "InjectForTurn, cached",
                    us(c50),
                    us(pct(cached, 99)),
                    f"{c50 / f50:.2f}x",
                    f"{queries:.0f} queries, {hits:.0f} hits",
                ]
            )
    report.add(
        "1-2. The floor and the cached turn",
        f"Sequential calls, {count} each after a warm-up. The floor is a health check on the "
        "same server; a cached InjectForTurn (snapshot built, 12 memories, an 8-word message) "
        "is reported as a ratio to it; so is one whose turn block ranks the same memories "
        "against the message (its agent has the system block off). Target: p50 within 1.20x, "
        "and zero database queries "
        "(read from the daemon's own metrics).",
        ["transport", "call", "p50", "p99", "p50 / floor", "database"],
        rows,
    )
    return floor_tcp
