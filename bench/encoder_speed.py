"""Section 28 of `make bench`: the local encoder, numpy against int8.

Owns `bench_encoder_speed`: per-call latency of one query (8 tokens, and 86
characters) through the numpy encoder (before) and the int8 one run by
onnxruntime (after), on one pinned core; retrieval quality with each, on the
agent-notes set, the LoCoMo-scale sets and, with --locomo, LoCoMo's own
data; and queries per second at 1, 4, 16 and 64 callers in flight: numpy
as the daemon ran it before (each call its own pass), int8 alone, and int8
behind the batching the daemon now puts in front of it. Sets the
`encoder_speed` figures of docs/benchmarks.json.

Must not score retrieval by itself (bench.retrieval and bench.agent_notes
do). It starts no daemon: the encoders are measured in this process.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.measure import Report, Row, pct, us
from sidecar.core.memory import Memory
from sidecar.retrieval import ranking, semantic
from sidecar.retrieval.batching import BatchingEncoder
from sidecar.retrieval.embedding import Encoder, LocalEncoder
from sidecar.retrieval.keywords import keywords
from sidecar.retrieval.quantized import QuantizedEncoder

# [CLS] + 6 word pieces + [SEP]: 8 tokens.
SHORT = "where does the staging deploy run"
# 86 characters.
LONG = "Which database did the analytics team pick last spring, and who signed off on it then?"
IN_FLIGHT = (1, 4, 16, 64)


def _per_call(encoder: Encoder, text: str, count: int) -> list[float]:
    """Thread CPU seconds of `count` calls on one pinned core (CPU time,
    not wall: on a shared machine wall time is mostly other processes)."""
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(affinity)})
    try:
        for _ in range(10):
            encoder.encode([text])
        out = []
        for _ in range(count):
            start = time.thread_time()
            encoder.encode([text])
            out.append(time.thread_time() - start)
        return out
    finally:
        os.sched_setaffinity(0, affinity)


def _throughput(encoder: Encoder, callers: int, seconds: float) -> float:
    """Queries a second with `callers` threads each asking in a loop, every
    query a new text (as turns' queries are)."""
    stop = threading.Event()
    counts = [0] * callers

    def ask(index: int) -> None:
        n = 0
        while not stop.is_set():
            encoder.encode([f"{SHORT} {index} {n}"])
            n += 1
        counts[index] = n

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(callers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.monotonic() - started)


def _quality(encoders: Sequence[Encoder], locomo: Path | None, quick: bool) -> list[Row]:
    from bench import agent_notes, retrieval

    rows: list[Row] = []
    notes = agent_notes.load()
    got = [agent_notes.scores(notes, _notes_hybrid(e)) for e in encoders]
    for measure, pick in (("R@1", "r1"), ("R@5", "r5"), ("MRR", "mrr")):
        values = [getattr(s, pick)["all"] for s in got]
        rows.append([f"agent notes, hybrid: {measure}", *(f"{v:.4f}" for v in values), ""])
    groups: list[tuple[str, Sequence[retrieval.RelevanceSet]]] = []
    if not quick:
        groups.append(("LoCoMo-scale sets, hybrid", retrieval.load(retrieval.LOCOMO)))
    if locomo is not None:
        groups.append(("LoCoMo's own data, hybrid", retrieval.load_locomo(locomo)[0]))
    for label, sets in groups:
        results = [retrieval.scores(sets, retrieval.hybrid(e)) for e in encoders]
        rows.append([f"{label}: all found", *(f"{r.found['all']:.4f}" for r in results), ""])
        rows.append([f"{label}: R@10", *(f"{r.recall['all']:.4f}" for r in results), ""])
    return rows


def _notes_hybrid(encoder: Encoder) -> Callable[[list[Memory]], Callable[[str], list[str]]]:
    """bench.agent_notes' search (an agent's two tiers, as SearchMemories
    ranks them) blended with the encoder's cosines, as bench.retrieval's
    hybrid blends them: weight 0.5, floor 0.35, vectors stored as float16."""
    from bench import agent_notes

    def make(memories: list[Memory]) -> Callable[[str], list[str]]:
        tiers = agent_notes._partitions(memories)
        stored = [semantic.to_stored(v) for v in encoder.encode([m.content for m in memories])]
        vectors = semantic.VectorSet(
            1, np.array([m.seq for m in memories]), semantic.from_stored(stored), True, 0.0
        )
        seqs = np.concatenate([tier.seq for tier in tiers])

        def search(query: str) -> list[str]:
            found = keywords([query])
            if not found and query.strip():
                return []
            cosines = vectors.cosines(encoder.encode([query])[0], seqs)
            hits = ranking.rank(
                tiers,
                found,
                ranking.Weights(),
                limit=agent_notes.TOP,
                semantic=ranking.SemanticScores(cosines, 0.5, 0.35),
            )
            return [m.id for m, _ in hits]

        return search

    return make


def bench_encoder_speed(report: Report, locomo: Path | None) -> None:
    quick = report.quick
    numpy_encoder = LocalEncoder()
    with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as cache:
        int8 = QuantizedEncoder(cache_dir=cache)
    count = 60 if quick else 400
    rows: list[Row] = []
    figures: dict[str, object] = {}
    for label, text in (("8 tokens", SHORT), (f"{len(LONG)} characters", LONG)):
        before = _per_call(numpy_encoder, text, count)
        after = _per_call(int8, text, count)
        rows.append(
            [
                f"one query, {label}",
                f"{us(pct(before, 50))} / {us(pct(before, 99))}",
                f"{us(pct(after, 50))} / {us(pct(after, 99))}",
                "",
            ]
        )
        figures[label] = {"numpy_p50": pct(before, 50), "int8_p50": pct(after, 50)}
    seconds = 1.0 if quick else 4.0
    for callers in IN_FLIGHT:
        batching = BatchingEncoder(int8, slots=os.cpu_count() or 1)
        got = [
            _throughput(encoder, callers, seconds) for encoder in (numpy_encoder, int8, batching)
        ]
        mean = batching.batched / max(1, batching.passes)
        rows.append(
            [
                f"queries/s, {callers} in flight",
                f"{got[0]:,.0f}",
                f"{got[1]:,.0f} alone; {got[2]:,.0f} batched",
                f"{mean:.1f} a pass",
            ]
        )
        figures[f"qps_{callers}"] = {"numpy": got[0], "int8": got[1], "batched": got[2]}
    cosines = (numpy_encoder.encode([SHORT, LONG]) * int8.encode([SHORT, LONG])).sum(axis=1)
    figures["cosine"] = [round(float(c), 4) for c in cosines]
    report.figures["encoder_speed"] = figures
    rows.extend(_quality([numpy_encoder, int8], locomo, quick))
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    report.add(
        "28. The local encoder: numpy and int8",
        "server.semantic_encoder: local, its layers run by numpy (before; "
        "server.semantic_runtime: numpy) and by onnxruntime with int8 weights (after; the "
        "default). One query: thread CPU time a call, p50 / p99, on one pinned core (wall "
        "time on a shared machine is mostly the others' processes). Queries/s: that many "
        "threads each embedding a new query in a loop, numpy as every call ran before, "
        "int8 alone, and int8 behind the batching the daemon puts in front of it "
        "(sidecar.retrieval.batching: a call finding every pass slot busy waits up to 2 ms "
        "to share one); the last column is the batched texts a pass. Quality: the same "
        "hybrid ranking (weight 0.5, floor 0.35) with each encoder's vectors, entries and "
        f"queries alike. Load average during the run: {load}.",
        ["measure", "numpy (before)", "int8 (after)", ""],
        rows,
    )
