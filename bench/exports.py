"""Section 21 of `make bench`: ExportMemories.

Owns `bench_exports`: the throughput of ExportMemories (entries/s and MB/s
of JSONL received) over one scope's two tiers, and the daemon's VmRSS while
it streams. Baseline: paging through the same entries with GetMemories
(page_size 1000, the largest), on the same daemon, the two runs
alternating so both see the same moments of a noisy machine. Memory is
bounded when the growth during an export of the large scope is no more than
during an export of a scope a tenth its size.

Must not touch the shared helpers or other sections' databases; its file is
exports.db in the run's work directory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from bench.corpus import Corpus
from bench.measure import UNLIMITED, Daemon, Report, Row, daemon, populate
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Tier

LARGE = pb.Scope(agent_id="export-agent", user_id="export-user")
SMALL = pb.Scope(agent_id="small-agent", user_id="small-user")


def _contents(corpus: Corpus, count: int) -> list[str]:
    """`count` distinct texts: the corpus's sentences, numbered past its
    supply (an export costs by size, not by wording)."""
    base = list(corpus.memories(min(count, 5000)))
    return [f"{base[i % len(base)]} ({i})" for i in range(count)]


@contextmanager
def _peak_rss(d: Daemon) -> Iterator[list[int]]:
    """The daemon's VmRSS sampled every 10 ms while the block runs: [before, peak]."""
    seen = [d.rss_bytes()] * 2
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            seen[1] = max(seen[1], d.rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        stop.set()
        sampler.join()
        seen[1] = max(seen[1], d.rss_bytes())


def _export(stub: Any, scope: pb.Scope) -> tuple[int, int]:
    """Entries and JSONL bytes of one whole export."""
    entries = size = 0
    for response in stub.ExportMemories(pb.ExportMemoriesRequest(scope=scope), timeout=600):
        entries += response.count
        size += len(response.jsonl.encode())
    return entries, size


def _paged(stub: Any, scope: pb.Scope) -> tuple[int, int]:
    """Entries and response bytes of GetMemories, every page."""
    entries = size = 0
    request = pb.GetMemoriesRequest(scope=scope, page_size=1000)
    while True:
        page = stub.GetMemories(request, timeout=60)
        entries += len(page.memories)
        size += page.ByteSize()
        if not page.next_page_token:
            return entries, size
        request.page_token = page.next_page_token


def _timed(run: Callable[[], tuple[int, int]]) -> tuple[float, int, int]:
    started = time.perf_counter()
    entries, size = run()
    return time.perf_counter() - started, entries, size


def bench_exports(report: Report, work: Path, corpus: Corpus, count: int, rounds: int) -> None:
    db = work / "exports.db"
    texts = _contents(corpus, count + count // 10)
    half, small = count // 2, count // 20
    populate(
        db,
        {
            (LARGE.agent_id, Tier.MEMORY): texts[:half],
            (LARGE.user_id, Tier.USER): texts[half:count],
            (SMALL.agent_id, Tier.MEMORY): texts[count : count + small],
            (SMALL.user_id, Tier.USER): texts[count + small :],
        },
    )
    rows: list[Row] = []
    with daemon(db, UNLIMITED) as d, grpc.insecure_channel(d.api) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        _export(stub, SMALL)  # warm: the first call pays for imports and the pool
        # RSS first, before the timed runs leave their allocations behind.
        growth: dict[str, int] = {}
        for name, scope in (("small", SMALL), ("large", LARGE)):
            with _peak_rss(d) as rss:
                _export(stub, scope)
            growth[name] = rss[1] - rss[0]
        exports, pages = [], []
        for _ in range(rounds):
            exports.append(_timed(lambda: _export(stub, LARGE)))
            pages.append(_timed(lambda: _paged(stub, LARGE)))
    export_s, entries, export_bytes = min(exports)
    paged_s, paged_entries, paged_bytes = min(pages)
    assert entries == paged_entries == count, (entries, paged_entries, count)
    for what, seconds, size in (
        ("ExportMemories (batch_size 500)", export_s, export_bytes),
        ("GetMemories, every page (page_size 1000)", paged_s, paged_bytes),
    ):
        rows.append(
            [
                what,
                f"{count:,}",
                f"{seconds:,.2f} s",
                f"{count / seconds:,.0f}",
                f"{size / 2**20 / seconds:,.1f}",
                f"{paged_s / seconds:,.2f}x",
            ]
        )
    report.figures["export"] = {
        "entries": count,
        "export_entries_per_s": round(count / export_s),
        "paged_entries_per_s": round(count / paged_s),
        "rss_growth_mib": {k: round(v / 2**20, 1) for k, v in growth.items()},
    }
    report.add(
        "21. ExportMemories",
        f"One scope of {count:,} entries (half agent notes, half user profile, one corpus "
        f"sentence each) exported whole, beside paging through the same entries with "
        f"GetMemories on the same daemon; best of {rounds} alternating runs each. MB/s is of "
        "what the client receives (JSONL for the export, protobuf pages for the list); the "
        "last column is the speed relative to paging.",
        ["read", "entries", "time", "entries/s", "MB/s", "vs paging"],
        rows,
    )
    report.add(
        "21. ExportMemories: the daemon's memory while it streams",
        "Peak VmRSS growth during one export (sampled every 10 ms), of a scope a tenth the "
        "size and of the large one: bounded when the second is no larger than the first "
        "plus noise (each stream holds at most batch_size rows per tier).",
        ["export", "entries", "VmRSS growth"],
        [
            ["small scope", f"{small * 2:,}", f"{growth['small'] / 2**20:,.1f} MiB"],
            ["large scope", f"{count:,}", f"{growth['large'] / 2**20:,.1f} MiB"],
        ],
    )
