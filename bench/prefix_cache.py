"""Section 8 of `make bench`: prefix-cache stability.

Owns `bench_prefix_cache`: a scripted 200-turn session (a write every 7 turns,
a compaction every 25) under each snapshot_refresh policy; the figure is the
share of turns whose system_block is byte-identical to the previous turn's.
Its baseline is the other policy, in the same run.

Must not touch the shared helpers (bench.measure); its databases are
prefix-*.db.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from bench.corpus import Corpus
from bench.measure import SCOPE, Report, Row, daemon, populate
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier


def bench_prefix_cache(report: Report, work: Path, corpus: Corpus) -> None:
    rows: list[Row] = []
    for policy in ("on_write", "on_compaction"):
        db = work / f"prefix-{policy}.db"
        populate(db, {("bench-agent", Tier.MEMORY): list(corpus.memories(10))})
        with (
            daemon(db, f"defaults: {{snapshot_refresh: {policy}, memory_char_limit: 0}}\n") as d,
            grpc.insecure_channel(d.api) as channel,
        ):
            stub = pb_grpc.MemoryServiceStub(channel)
            previous, same, writes, compactions = None, 0, 0, 0
            for turn in range(200):
                if turn and turn % 7 == 0:
                    stub.AddMemory(
                        pb.AddMemoryRequest(scope=SCOPE, content=f"learned at turn {turn}"),
                        timeout=10,
                    )
                    writes += 1
                if turn and turn % 25 == 0:
                    stub.NotifyCompaction(
                        pb.NotifyCompactionRequest(scope=SCOPE, session_id="script"), timeout=10
                    )
                    compactions += 1
                block = stub.InjectForTurn(
                    pb.InjectForTurnRequest(
                        scope=SCOPE, session_id="script", user_message=f"turn {turn}"
                    ),
                    timeout=10,
                ).system_block
                if previous is not None and block == previous:
                    same += 1
                previous = block
        rows.append([policy, f"{same}/199", f"{same / 199:.1%}", str(writes), str(compactions)])
    report.add(
        "8. Prefix-cache stability",
        "A scripted 200-turn session: a write every 7 turns, a compaction every 25. Share of "
        "turns whose system_block is byte-identical to the previous turn's.",
        ["snapshot_refresh", "identical turns", "share", "writes", "compactions"],
        rows,
    )
