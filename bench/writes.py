"""Section 5 of `make bench`: sustained writes on SQLite.

Owns `bench_writes`: sequential AddMemory calls at durability normal and full.
Baseline: raw Peewee inserts with the same pragmas (sidecar.storage._sqlite), one
transaction each, in this process.

Must not touch the PostgreSQL writes (section 10, bench.postgres_writes) nor
the shared helpers; its databases are writes-*.db and raw-*.db. `raw_insert_rate`
is the raw-insert baseline, shared with section 27 (bench.write_groups).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import grpc
import peewee

from bench.corpus import Corpus
from bench.measure import SCOPE, UNLIMITED, Report, Row, daemon
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.storage import _sqlite


def bench_writes(report: Report, work: Path, corpus: Corpus, count: int) -> None:
    rows: list[Row] = []
    texts = list(corpus.memories(count * 2))
    for durability in ("normal", "full"):
        db = work / f"writes-{durability}.db"
        config = UNLIMITED + f"server: {{durability: {durability}}}\n"
        with daemon(db, config) as d, grpc.insecure_channel(d.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            start = time.perf_counter()
            for text in texts[:count]:
                stub.AddMemory(pb.AddMemoryRequest(scope=SCOPE, content=text), timeout=60)
            grpc_rate = count / (time.perf_counter() - start)
        raw_rate = raw_insert_rate(work / f"raw-{durability}.db", texts[count:], durability)
        rows.append(
            [durability, f"{grpc_rate:,.0f}/s", f"{raw_rate:,.0f}/s", f"{grpc_rate / raw_rate:.2f}"]
        )
    report.add(
        "5. Sustained writes",
        f"{count:,} sequential AddMemory calls (budget check, de-duplication, insert, one "
        "transaction each) against raw Peewee inserts with the same pragmas, one "
        "transaction each, in this process.",
        ["durability", "AddMemory over gRPC", "raw Peewee insert", "ratio"],
        rows,
    )


def raw_insert_rate(path: Path, texts: Sequence[str], synchronous: str = "normal") -> float:
    """Raw Peewee inserts a second into a new SQLite file at `path`, with the
    store's pragmas (sidecar.storage._sqlite), one row and one transaction
    each: the baseline every write figure stands beside."""
    raw_db = _sqlite.open_database(str(path), synchronous=synchronous)
    raw_db.execute_sql("CREATE TABLE notes (id TEXT PRIMARY KEY, content TEXT, created INT)")

    class Note(peewee.Model):
        id = peewee.TextField(primary_key=True)
        content = peewee.TextField()
        created = peewee.IntegerField()

        class Meta:
            database = raw_db
            table_name = "notes"

    start = time.perf_counter()
    for text in texts:
        with raw_db.atomic("IMMEDIATE"):
            Note.create(id=str(uuid.uuid4()), content=text, created=0)
    rate = len(texts) / (time.perf_counter() - start)
    raw_db.close_all()
    return rate
