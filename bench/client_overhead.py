"""Section 26 of `make bench`: what the Python client adds to a cached turn.

Owns `bench_client_overhead`: InjectForTurn through memory_sidecar_client's
`Client.turn` (deadline, retry loop, read-your-writes, the request built
each call, the `Turn` it returns) beside the same call on the raw generated
stub with a request built once, on one channel to one daemon, interleaved so
both see the same moments of a noisy machine. Each session's first turn
builds its snapshot; every measured turn is the second or later, cached.
Baseline: the raw stub's p50, in the same run. Target: p50 client / p50 raw
stub at most 1.10x.

Must not touch the client's internals (it calls what a caller calls) nor
the shared helpers (bench.measure); its database is client.db.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from memory_sidecar_client import Client

from bench.corpus import Corpus
from bench.measure import SCOPE, Report, daemon, interleaved, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def bench_client_overhead(report: Report, work: Path, corpus: Corpus, count: int) -> None:
    db = work / "client.db"
    notes = list(corpus.memories(12))
    populate(db, {(SCOPE.agent_id, Tier.MEMORY): notes[:8], (SCOPE.user_id, Tier.USER): notes[8:]})
    message = corpus.question(notes[0])
    with daemon(db) as d, grpc.insecure_channel(d.api) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        raw_request = pb.InjectForTurnRequest(scope=SCOPE, session_id="raw", user_message=message)
        client = Client(channel=channel, agent_id=SCOPE.agent_id, user_id=SCOPE.user_id)
        first_raw = stub.InjectForTurn(raw_request, timeout=10)
        first_client = client.turn("client", message)
        raw, through_client = interleaved(
            lambda: stub.InjectForTurn(raw_request, timeout=10),
            lambda: client.turn("client", message),
            count,
        )
        cached = stub.InjectForTurn(raw_request, timeout=10).cache_hit
        cached = cached and client.turn("client", message).cache_hit
    assert first_raw.system_block == first_client.system_block, "the two paths differ"
    r50, c50 = pct(raw, 50), pct(through_client, 50)
    report.figures["client_overhead_p50_ratio"] = round(c50 / r50, 3)
    report.add(
        "26. The Python client on a cached turn",
        f"Sequential cached InjectForTurn calls, {count} each after a warm-up, on one channel: "
        "the raw generated stub with a request built once, and memory_sidecar_client's "
        "`Client.turn` (deadline, retry loop, read-your-writes, a request built per call, "
        "the `Turn` it returns), interleaved in batches. Target: p50 client / p50 raw stub "
        f"at most 1.10x. Both cached at the end: {cached}.",
        ["call", "p50", "p99", "p50 / raw stub"],
        [
            ["raw stub: InjectForTurn", us(r50), us(pct(raw, 99)), "1.00x"],
            ["Client.turn", us(c50), us(pct(through_client, 99)), f"{c50 / r50:.2f}x"],
        ],
    )
