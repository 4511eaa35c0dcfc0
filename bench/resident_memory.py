"""Section 7 of `make bench`: the daemon's resident memory.

Owns `bench_memory` and `turns` (one turn a session, which opens it): VmRSS as
sessions open over 100 scopes, then as sessions of new agents open under
max_sessions_total. Baseline: the idle daemon's and the 100-session VmRSS of
the same run; growth is reported per additional session or agent.

Must not touch the large tiers' memory figures (section 13,
bench.large_tiers) nor the shared helpers; its databases are sessions.db and
agents.db.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import Report, Row, daemon, populate
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def turns(stub: Any, sessions: Iterable[tuple[str, str]]) -> None:
    """One turn for each (agent_id, session_id): opens those sessions."""
    for agent_id, session_id in sessions:
        stub.InjectForTurn(
            pb.InjectForTurnRequest(scope=pb.Scope(agent_id=agent_id), session_id=session_id),
            timeout=10,
        )


def bench_memory(report: Report, work: Path, corpus: Corpus, many: int) -> None:
    db = work / "sessions.db"
    notes = list(corpus.memories(300))
    scopes = {}
    for s in range(100):
        scopes[(f"agent-{s}", Tier.MEMORY)] = notes[s * 3 : (s + 1) * 3]
    populate(db, scopes)
    rows: list[Row] = []
    with (
        daemon(db, f"defaults: {{max_sessions: {many + 1}}}\n") as d,
        grpc.insecure_channel(d.api) as channel,
    ):
        stub = pb_grpc.MemoryServiceStub(channel)

        def open_sessions(first: int, last: int) -> None:
            turns(stub, ((f"agent-{i % 100}", f"s{i}") for i in range(first, last)))

        base = d.rss_bytes()
        open_sessions(0, 100)
        at_100 = d.rss_bytes()
        open_sessions(100, many)
        at_many = d.rss_bytes()
        per = (at_many - at_100) / (many - 100)
        rows.append(["idle daemon", f"{base / 2**20:,.1f} MiB", "-"])
        rows.append(["100 sessions, 100 scopes", f"{at_100 / 2**20:,.1f} MiB", "-"])
        rows.append(
            [
                f"{many:,} sessions, 100 scopes",
                f"{at_many / 2**20:,.1f} MiB",
                f"{per:,.0f} bytes per additional session",
            ]
        )
    # Every session a new agent (empty tiers): each brings its own snapshot.
    # With the total cap at half of them, the second half replaces the first.
    db = work / "agents.db"
    populate(db, {})
    for cap in (2 * many, many // 2):
        with (
            daemon(db, f"server: {{max_sessions_total: {cap}}}\n") as d,
            grpc.insecure_channel(d.api) as channel,
        ):
            stub = pb_grpc.MemoryServiceStub(channel)

            def agents(first: int, last: int) -> None:
                turns(stub, ((f"new-agent-{i}", "s") for i in range(first, last)))

            agents(0, 100)
            before = d.rss_bytes()
            agents(100, many)
            after = d.rss_bytes()
            sessions = d.metric("memory_sessions_active")
        rows.append(
            [
                f"{many:,} new agents, one session each, max_sessions_total {cap:,}",
                f"{after / 2**20:,.1f} MiB",
                f"{(after - before) / (many - 100):,.0f} bytes per additional agent; "
                f"{sessions:,.0f} sessions kept",
            ]
        )
    report.add(
        "7. Resident memory",
        "The daemon's VmRSS as sessions open, spread over 100 scopes of 3 memories each "
        "(sessions of a scope share one snapshot); then sessions each of a new agent "
        "(empty tiers), first under the total cap, then with the cap at half their number. "
        "Target: at most 500 bytes per additional session.",
        ["state", "resident", "growth"],
        rows,
    )
