"""`make bench`: how fast, how big, how cost grows, against same-run baselines.

Every figure stands beside a baseline measured in the same run, because the
machines are shared and noisy: latencies beside the cheapest RPC (a health
check on the same server), search beside the seed's AND-LIKE scan over the
same rows, writes beside raw Peewee inserts. Results go to docs/BENCHMARKS.md.

    python -m bench.run [--quick] [--output docs/BENCHMARKS.md]

This file is the runner: its flags and the order of the sections. Each
section is a module of its own (bench/turns.py for 1-2 ... bench/expiry_sweep.py for 19,
bench/exports.py for 21, bench/watch_delay.py for 22, bench/read_your_writes.py for 23,
bench/agent_notes.py for 24, bench/mcp_sessions.py for 25, bench/client_overhead.py
for 26, with bench/client_probes.py for its Go and TypeScript rows, bench/write_groups.py
for 27, with bench/bare_server.py for its ceiling row, bench/encoder_speed.py for 28),
measuring with bench/measure.py; bench/report.py writes the report.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.agent_notes import bench_agent_notes
from bench.big_tier_writes import bench_big_tier_writes
from bench.client_overhead import bench_client_overhead
from bench.concurrency import bench_concurrency
from bench.corpus import Corpus
from bench.encoder_speed import bench_encoder_speed
from bench.expiry_sweep import bench_expiry_sweep
from bench.exports import bench_exports
from bench.forget_user import bench_forget_user
from bench.large_tiers import bench_large_tiers
from bench.mcp_calls import bench_mcp_calls
from bench.mcp_sessions import bench_mcp_sessions
from bench.measure import Report, postgres
from bench.near_duplicates import bench_near_duplicates
from bench.postgres_turn import bench_postgres_turn
from bench.postgres_writes import bench_postgres_writes
from bench.prefix_cache import bench_prefix_cache
from bench.read_your_writes import bench_read_your_writes
from bench.rebuild import bench_rebuild
from bench.replicas import bench_propagation
from bench.report import ROOT, write
from bench.resident_memory import bench_memory
from bench.retrieval_quality import bench_retrieval
from bench.search import bench_search
from bench.semantic import bench_semantic
from bench.tool_calls import bench_claude_memory_tool, bench_tool_calls
from bench.turns import bench_floor_and_cached_turn
from bench.watch_delay import bench_watch_delay
from bench.write_groups import bench_write_groups
from bench.writes import bench_writes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run in under a minute")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    parser.add_argument(
        "--locomo",
        type=Path,
        metavar="FILE",
        help="also score LoCoMo's own data (locomo10.json) in sections 14 and 25",
    )
    parser.add_argument(
        "--only",
        type=int,
        action="append",
        metavar="N",
        help="run only section N (repeatable; 2 runs with 1)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    report = Report(quick, [], [])
    corpus = Corpus()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
        work = Path(tmp)
        only = set(args.only or range(1, 29))
        if only & {1, 2}:
            bench_floor_and_cached_turn(report, work, corpus, 300 if quick else 3000)
        if 3 in only:
            bench_rebuild(
                report,
                work,
                corpus,
                [20, 1000] if quick else [20, 1000, 10_000],
                5 if quick else 20,
            )
        if 4 in only:
            bench_search(
                report,
                work,
                corpus,
                [1000, 10_000] if quick else [1000, 10_000, 100_000],
                30 if quick else 200,
            )
        if 5 in only:
            bench_writes(report, work, corpus, 200 if quick else 2000)
        if 6 in only:
            bench_concurrency(report, work, corpus, 1.0 if quick else 5.0)
        if 7 in only:
            bench_memory(report, work, corpus, 1000 if quick else 10_000)
        if 8 in only:
            bench_prefix_cache(report, work, corpus)
        if only & {9, 10, 11, 12, 20}:
            with postgres() as cluster:
                if cluster is None:
                    report.notes.append(
                        "No PostgreSQL server here: sections 9-12 and 20 ran SQLite only."
                    )
                else:
                    (version,) = cluster.sql("SHOW server_version")[0]
                    report.notes.append(
                        f"PostgreSQL {version}: a throwaway cluster on a Unix socket, "
                        "with the server's durable defaults (fsync, synchronous_commit)."
                    )
                    if 9 in only:
                        bench_postgres_turn(report, work, cluster, 300 if quick else 3000)
                    if 10 in only:
                        bench_postgres_writes(report, work, cluster, 200 if quick else 2000)
                if 11 in only:
                    bench_propagation(report, work, cluster, corpus, 20 if quick else 200)
                if 12 in only:
                    bench_big_tier_writes(
                        report,
                        work,
                        cluster,
                        corpus,
                        10_000 if quick else 100_000,
                        50 if quick else 300,
                    )
                if 20 in only:
                    bench_forget_user(report, work, cluster, corpus, 2000 if quick else 10_000)
    if 13 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
            bench_large_tiers(
                report, Path(tmp), corpus, [10_000] if quick else [10_000, 100_000, 1_000_000]
            )
    if 14 in only:
        bench_retrieval(report, args.locomo)
    if 15 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
            bench_semantic(report, Path(tmp), corpus, 1000 if quick else 5000, 50 if quick else 300)
    if 16 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
            bench_tool_calls(report, Path(tmp), corpus, 1000, 200 if quick else 2000)
            bench_claude_memory_tool(report, Path(tmp), 200 if quick else 2000)
    if 17 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
            bench_mcp_calls(report, Path(tmp), corpus, 1000, 200 if quick else 2000)
    if 18 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
            bench_near_duplicates(report, Path(tmp), corpus, 200 if quick else 1000)
    if 19 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
            bench_expiry_sweep(report, Path(tmp), corpus, 10_000 if quick else 1_000_000)
    if 21 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
            bench_exports(
                report, Path(tmp), corpus, 10_000 if quick else 100_000, 1 if quick else 3
            )
    if 22 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp, postgres() as pg:
            bench_watch_delay(report, Path(tmp), pg, 50 if quick else 500)
    if 23 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp, postgres() as pg:
            bench_read_your_writes(report, Path(tmp), pg, Corpus(), 50 if quick else 500)
    if 24 in only:
        bench_agent_notes(report)
    if 25 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
            bench_mcp_sessions(report, Path(tmp), 500 if quick else 4096)
    if 26 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
            bench_client_overhead(report, Path(tmp), corpus, 300 if quick else 3000)
    if 27 in only:
        with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp, postgres() as pg:
            bench_write_groups(report, Path(tmp), corpus, 256 if quick else 2000, pg)
    if 28 in only:
        bench_encoder_speed(report, args.locomo)
    report.notes.append(f"The run took {time.monotonic() - started:,.0f} s.")
    write(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
