"""Section 20 of `make bench`: ForgetUser of a user with many memories.

Owns `bench_forget_user`: a user whose profile (the user tier, shared by
every agent) holds 10,000 memories (2,000 with --quick), with a turn of
each of 50 agents open on a second replica B showing it. ForgetUser on
replica A: how long the call takes (and how much of it is the wait for the
other replicas' feeds, see sidecar.domain.erasure), and how long until B's next
turn no longer shows the user. Baseline, same run, same data: the same
memories removed by one DeleteMemory call each. On SQLite (two processes on
one file) and, with a cluster, PostgreSQL.

Must not start or stop the cluster (the runner does) nor touch the shared
helpers; its databases are forget*.db, or new ones from the cluster.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import UNLIMITED, Report, Row, daemon, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier

USER = "forgotten-user"
AGENTS = 50
MARK = "(forgettable)"


def _shows(stub: Any, agent: int) -> bool:
    scope = pb.Scope(agent_id=f"agent-{agent}", user_id=USER)
    request = pb.InjectForTurnRequest(scope=scope, session_id="s", user_message="forgettable")
    turn = stub.InjectForTurn(request, timeout=30)
    return MARK in turn.system_block + turn.turn_context


def _forget(a: Any, b: Any) -> tuple[float, float]:
    """(the call's seconds, seconds from the call's start until every one
    of B's agents stops showing the user)."""
    for agent in range(AGENTS):
        assert _shows(b, agent), "B does not show the user before the erasure"
    started = time.perf_counter()
    gone: list[float] = []

    def watch() -> None:
        # B's turns in a loop, round the agents, until none shows the user:
        # timed at the first turn of the last run of turns that did not.
        agent, clear, since = 0, 0, 0.0
        while clear < AGENTS and time.perf_counter() - started < 60:
            asked = time.perf_counter() - started
            if _shows(b, agent % AGENTS):
                clear = 0
            else:
                since = since if clear else asked
                clear += 1
            agent += 1
        gone.append(since)

    watcher = threading.Thread(target=watch)
    watcher.start()
    erasure = a.ForgetUser(pb.ForgetUserRequest(user_id=USER), timeout=120).erasure
    took = time.perf_counter() - started
    watcher.join()
    assert erasure.memories > 0
    return took, gone[0]


def _delete_each(a: Any) -> float:
    scope = pb.Scope(agent_id="agent-0", user_id=USER)
    ids: list[str] = []
    token = ""
    while True:
        page = a.GetMemories(
            pb.GetMemoriesRequest(scope=scope, tier=pb.TIER_USER, page_size=1000, page_token=token),
            timeout=60,
        )
        ids += [m.id for m in page.memories]
        token = page.next_page_token
        if not token:
            break
    started = time.perf_counter()
    for memory_id in ids:
        a.DeleteMemory(pb.DeleteMemoryRequest(scope=scope, id=memory_id), timeout=30)
    return time.perf_counter() - started


def bench_forget_user(report: Report, work: Path, cluster: Any, corpus: Corpus, count: int) -> None:
    rows: list[Row] = []
    facts = [f"{text} {MARK}" for text in corpus.memories(count)]
    targets: list[tuple[str, Path, str, str]] = [
        ("SQLite (two processes)", work / "forget.db", "", "")
    ]
    if cluster is not None:
        targets.append(
            ("PostgreSQL", work / "forget-pg.db", cluster.new_database(), cluster.new_database())
        )
    # The wait ForgetUser ends with (ChangeFeed.settle_seconds) under the
    # default settings: stale_after plus one interval, as DataVersionPoller
    # (max(1 s, 10 polls) + a poll) and NotifyListener (3 heartbeats + one) set them.
    poll, heartbeat = 0.025, 1.0
    settle = {"SQLite (two processes)": max(1.0, 10 * poll) + poll, "PostgreSQL": 4 * heartbeat}
    for name, db, dsn, baseline_dsn in targets:
        seeded = {(USER, Tier.USER): facts}
        seeded.update({(f"agent-{i}", Tier.MEMORY): [f"agent {i} note"] for i in range(AGENTS)})
        baseline_db = db.with_name(db.stem + "-baseline.db")
        populate(dsn or db, seeded)
        populate(baseline_dsn or baseline_db, seeded)
        with (
            daemon(db, UNLIMITED, dsn=dsn) as a,
            daemon(db.with_name(db.stem + "-b.db"), UNLIMITED, dsn=dsn or str(db)) as b,
            grpc.insecure_channel(a.api) as channel_a,
            grpc.insecure_channel(b.api) as channel_b,
        ):
            took, gone = _forget(
                pb_grpc.MemoryServiceStub(channel_a), pb_grpc.MemoryServiceStub(channel_b)
            )
        with (
            daemon(baseline_db, UNLIMITED, dsn=baseline_dsn) as base,
            grpc.insecure_channel(base.api) as channel,
        ):
            deleted = _delete_each(pb_grpc.MemoryServiceStub(channel))
        wait = settle[name]
        rows.append(
            [
                name,
                f"{count:,}",
                us(took),
                us(wait),
                us(took - wait),
                us(gone),
                us(deleted),
                f"{deleted / took:,.1f}x",
                f"{deleted / (took - wait):,.0f}x",
            ]
        )
    report.add(
        "20. ForgetUser of a user with many memories",
        f"One user whose profile (the user tier every agent shares) holds {count:,} memories, "
        f"and a second replica B with a turn of each of {AGENTS} agents open on that user. "
        "ForgetUser on A: the whole call; the wait it ends with (the feed's stale_after plus "
        "one interval with the default settings, after which every replica has either "
        "delivered the erasure or checks the database before using its caches); the call "
        "without that wait (the one transaction, and dropping this replica's sessions); and "
        "the time from the call's start until none of B's 50 agents shows the user any more. "
        "Baseline, same run and data: the same memories removed with one DeleteMemory each.",
        [
            "database",
            "memories",
            "ForgetUser",
            "of which the wait",
            "without the wait",
            "B stops showing",
            "DeleteMemory each",
            "baseline / ForgetUser",
            "baseline / without the wait",
        ],
        rows,
    )
