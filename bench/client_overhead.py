"""Section 26 of `make bench`: what each client adds to a cached turn.

Owns `bench_client_overhead`: InjectForTurn through memory_sidecar_client's
`Client.turn` (deadline, retry loop, read-your-writes, the request built
each call, the `Turn` it returns) beside the same call on the raw generated
stub with a request built once, on one channel to one daemon, interleaved so
both see the same moments of a noisy machine; then the same pair for the Go
client (`Client.Turn` beside its memoryv1 stub) and the TypeScript client
(`MemoryClient.turn` beside its grpc-js stub), each in a process of its own
against the same daemon, scope and message (bench/client_probes.py builds
and runs them; a missing toolchain leaves its rows "not run"). Each session's
first turn builds its snapshot; every measured turn is the second or later,
cached. Baseline: each language's raw stub's p50, in the same run. Target:
p50 client / p50 raw stub at most 1.10x.

Must not touch the clients' internals (it calls what a caller calls) nor
the shared helpers (bench.measure); its database is client.db.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from memory_sidecar_client import Client

from bench.client_probes import Probe, build_go, build_typescript, run_go, run_typescript
from bench.corpus import Corpus
from bench.measure import SCOPE, Report, Row, daemon, interleaved, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def _rows(language: str, stub_call: str, client_call: str, probe: Probe) -> list[Row]:
    if probe.skipped:
        missing = f"not run ({probe.skipped})"
        return [[f"{language} {stub_call}", missing, "-", "-"], [client_call, missing, "-", "-"]]
    (s50, s99), (c50, c99) = probe.stub, probe.client
    return [
        [f"{language} {stub_call}", us(s50), us(s99), "1.00x"],
        [client_call, us(c50), us(c99), f"{c50 / s50:.2f}x"],
    ]


def _ratio(probe: Probe) -> float | None:
    return None if probe.skipped else round(probe.client[0] / probe.stub[0], 3)


def bench_client_overhead(report: Report, work: Path, corpus: Corpus, count: int) -> None:
    db = work / "client.db"
    notes = list(corpus.memories(12))
    populate(db, {(SCOPE.agent_id, Tier.MEMORY): notes[:8], (SCOPE.user_id, Tier.USER): notes[8:]})
    message = corpus.question(notes[0])
    # Built before the daemon starts, so no compiler shares the machine with
    # a measured call.
    go, typescript = build_go(work), build_typescript(work)
    with daemon(db) as d:
        with grpc.insecure_channel(d.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            raw_request = pb.InjectForTurnRequest(
                scope=SCOPE, session_id="raw", user_message=message
            )
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
        # One language at a time, so none measures beside another's load.
        asked = (d.api, SCOPE.agent_id, SCOPE.user_id, message, count)
        through_go = run_go(go, *asked)
        through_typescript = run_typescript(typescript, *asked)
    assert first_raw.system_block == first_client.system_block, "the two paths differ"
    cached = cached and all(p.cached for p in (through_go, through_typescript) if not p.skipped)
    r50, c50 = pct(raw, 50), pct(through_client, 50)
    report.figures["client_overhead_p50_ratio"] = round(c50 / r50, 3)
    report.figures["client_overhead_go_p50_ratio"] = _ratio(through_go)
    report.figures["client_overhead_ts_p50_ratio"] = _ratio(through_typescript)
    report.add(
        "26. The clients on a cached turn",
        f"Sequential cached InjectForTurn calls, {count} each after a warm-up, on one channel "
        "per language to one daemon, the same scope and message: the raw generated stub with "
        "a request built once, and the client's turn call (deadline, retry loop, "
        "read-your-writes, a request built per call, the value it returns). Python: "
        "memory_sidecar_client's `Client.turn`, interleaved in batches; Go: `Client.Turn` "
        "(clients/go's BenchmarkDaemonTurnOverhead, alternating call by call); TypeScript: "
        "`MemoryClient.turn` beside the grpc-js stub's `injectForTurn` "
        "(clients/typescript/bench/turn-overhead.ts, interleaved in batches). Each language's "
        "client is measured against its own stub, in a process of its own, one language at a "
        "time. Target: p50 client / p50 raw stub at most 1.10x. "
        f"All cached throughout: {cached}.",
        ["call", "p50", "p99", "p50 / raw stub"],
        [
            ["Python raw stub: InjectForTurn", us(r50), us(pct(raw, 99)), "1.00x"],
            ["Python Client.turn", us(c50), us(pct(through_client, 99)), f"{c50 / r50:.2f}x"],
            *_rows("Go", "raw stub: InjectForTurn", "Go Client.Turn", through_go),
            *_rows(
                "TypeScript",
                "raw stub: injectForTurn",
                "TypeScript MemoryClient.turn",
                through_typescript,
            ),
        ],
    )
