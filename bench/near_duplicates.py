"""Section 18 of `make bench`: near-duplicates on AddMemory.

Owns `bench_near_duplicates`: how often sidecar.retrieval.similarity reports a merely
related entry (false matches) and misses a restatement (misses), on the
pairs of bench/similarity/pairs.jsonl, lexically and with semantic retrieval;
and what similar_writes: report costs an AddMemory. Baselines: the same
pairs' other half (the threshold is chosen on the tuning half, the rates
that count are the held-out half's), and AddMemory under similar_writes:
allow (nothing computed) on the same daemon, called in alternating batches.

    python -m bench.near_duplicates    # the tuning sweep, lexical and semantic

Each pair is scored through a real engine over a real SQLite file: the
pair's tier holds every `existing` text of that tier (50 entries), the `new`
text is added under similar_writes: report with threshold 0 (so every
candidate comes back with its score), then deleted again. A pair counts as
reported when its own `existing` entry scores at least the threshold; any
other entry reported for it is counted apart ("others").

Must not touch the shared helpers or other sections' databases; its files
are near-duplicates-*.db in the run's work directory.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from bench.corpus import Corpus
from bench.measure import UNLIMITED, Report, Row, daemon, pct, populate, us
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.config.settings import AgentSettings, Config
from sidecar.core.memory import Scope, Tier
from sidecar.core.metrics import Metrics
from sidecar.domain.engine import MemoryEngine
from sidecar.retrieval.embedding import Encoder
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry

PAIRS = Path(__file__).resolve().parent / "similarity" / "pairs.jsonl"
SPLITS = ("tuning", "held_out")
# Thresholds tried on the tuning half.
GRID = [round(0.30 + 0.01 * k, 2) for k in range(61)]


@dataclass(frozen=True, slots=True)
class Pair:
    id: int
    split: str
    tier: Tier
    kind: str  # duplicate or related
    existing: str
    new: str


@dataclass(frozen=True, slots=True)
class Scored:
    """A pair's outcome: its own entry's score (0 when not a candidate) and
    the scores of the other entries of the tier that came back."""

    pair: Pair
    score: float
    others: tuple[float, ...]


def load(path: Path = PAIRS) -> list[Pair]:
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        pairs.append(
            Pair(
                row["id"],
                row["split"],
                Tier(row["tier"]),
                row["kind"],
                row["existing"],
                row["new"],
            )
        )
    return pairs


def scored(pairs: list[Pair], work: Path, encoder: Encoder | None) -> list[Scored]:
    """Every pair through MemoryEngine.add, lexically or with this encoder."""
    mode = "semantic" if encoder is not None else "lexical"
    db = work / f"near-duplicates-{mode}.db"
    db.unlink(missing_ok=True)
    settings = AgentSettings(
        memory_char_limit=0, user_char_limit=0, similar_writes="report", similar_threshold=0.0
    )
    store = Store(str(db))
    store.open()
    try:
        engine = MemoryEngine(
            Config(defaults=settings), store, metrics=Metrics(CollectorRegistry()), encoder=encoder
        )
        scope = Scope("bench-agent", "bench-user")
        ids: dict[tuple[Tier, str], str] = {}
        for pair in pairs:
            if (pair.tier, pair.existing) not in ids:
                added = engine.add(NewEntry(scope, pair.tier, pair.existing))
                ids[(pair.tier, pair.existing)] = added.memory.id
        out = []
        for pair in pairs:
            added = engine.add(NewEntry(scope, pair.tier, pair.new))
            assert added.created, pair
            own = ids[(pair.tier, pair.existing)]
            mine = [s.score for s in added.similar if s.memory.id == own]
            others = tuple(s.score for s in added.similar if s.memory.id != own)
            out.append(Scored(pair, mine[0] if mine else 0.0, others))
            engine.delete(scope, added.memory.id)
    finally:
        store.close()
    return out


@dataclass(frozen=True, slots=True)
class Rates:
    false_matches: float  # related pairs whose entry was reported
    misses: float  # near-duplicates whose entry was not
    others: float  # pairs for which some other entry was reported
    pairs: int

    @property
    def errors(self) -> float:
        return self.false_matches + self.misses


def rates(results: Iterable[Scored], threshold: float, split: str) -> Rates:
    chosen = [r for r in results if r.pair.split == split]
    related = [r for r in chosen if r.pair.kind == "related"]
    duplicates = [r for r in chosen if r.pair.kind == "duplicate"]
    return Rates(
        sum(r.score >= threshold for r in related) / len(related),
        sum(r.score < threshold for r in duplicates) / len(duplicates),
        sum(any(o >= threshold for o in r.others) for r in chosen) / len(chosen),
        len(chosen),
    )


def choose(modes: Iterable[list[Scored]]) -> float:
    """The threshold with the fewest false matches plus misses on the
    tuning half, lexical and semantic counted alike (one setting serves
    both). Of equals, the middle one: scores bunch at a few values (a Dice
    of 2/3 is common), and a threshold just below such a value is one
    rewording away from missing every pair at it."""
    results = list(modes)
    errors = {t: round(sum(rates(r, t, "tuning").errors for r in results), 9) for t in GRID}
    fewest = min(errors.values())
    tied = [t for t in GRID if errors[t] == fewest]
    return tied[len(tied) // 2]


def best(results: list[Scored]) -> float:
    """The threshold one way of scoring alone would choose on the tuning half."""
    return choose([results])


# --- what report costs ---------------------------------------------------------


def _cost(work: Path, corpus: Corpus, sizes: list[int], count: int, semantic: bool) -> list[Row]:
    """AddMemory p50 and p99 of an agent under report beside one under
    allow, on one daemon, in alternating batches of 10. Each agent's tier
    holds `size` entries, cached (as after any turn); every add is of a new
    text and deleted again, untimed, so the tier stays that size."""
    rows: list[Row] = []
    agents = "agents: {reporting: {similar_writes: report}, allowing: {similar_writes: allow}}\n"
    server = "server: {semantic_encoder: local}\n" if semantic else ""
    mode = "semantic" if semantic else "lexical"
    for size in sizes:
        db = work / f"near-duplicates-cost-{mode}-{size}.db"
        populate(
            db,
            {
                ("reporting", Tier.MEMORY): list(corpus.memories(size)),
                ("allowing", Tier.MEMORY): list(corpus.memories(size)),
            },
        )
        texts = iter(corpus.memories(2 * count + 100))
        env = {"OPENBLAS_NUM_THREADS": "1"}
        timed: dict[str, list[float]] = {"allowing": [], "reporting": []}
        with daemon(db, UNLIMITED + agents + server, env=env) as d:
            if semantic:
                _wait_for_vectors(db, 2 * size)
            with grpc.insecure_channel(d.api) as channel:
                stub = pb_grpc.MemoryServiceStub(channel)
                scopes = {a: pb.Scope(agent_id=a, user_id="bench-user") for a in timed}
                for scope in scopes.values():
                    # Loads and caches the tier (and its vectors), as any turn does.
                    stub.SearchMemories(
                        pb.SearchMemoriesRequest(scope=scope, query="project travel")
                    )
                rounds = 0
                while len(timed["reporting"]) < count:
                    for agent, scope in scopes.items():
                        for _ in range(10):
                            request = pb.AddMemoryRequest(scope=scope, content=next(texts))
                            started = time.perf_counter()
                            added = stub.AddMemory(request, timeout=30)
                            elapsed = time.perf_counter() - started
                            stub.DeleteMemory(
                                pb.DeleteMemoryRequest(scope=scope, id=added.memory.id)
                            )
                            if rounds >= 5:  # the first 50 of each warm up
                                timed[agent].append(elapsed)
                    rounds += 1
        allow, report = timed["allowing"], timed["reporting"]
        label = f"AddMemory, a tier of {size:,}" + (" (semantic)" if semantic else "")
        rows.append(
            [
                label,
                us(pct(allow, 50)),
                us(pct(report, 50)),
                f"{pct(report, 50) / pct(allow, 50):.2f}x",
                us(pct(allow, 99)),
                us(pct(report, 99)),
            ]
        )
    return rows


def _wait_for_vectors(db: Path, count: int) -> None:
    """Until the backfill has embedded the bulk-loaded entries."""
    with closing(sqlite3.connect(db)) as conn:
        while conn.execute("SELECT COUNT(*) FROM memory_vectors").fetchone()[0] < count:
            time.sleep(0.1)


# --- the section ------------------------------------------------------------------


def _percent(value: float) -> str:
    return f"{value:.0%}"


def bench_near_duplicates(report: Report, work: Path, corpus: Corpus, count: int) -> None:
    from sidecar.retrieval.embedding import LocalEncoder

    pairs = load()
    lexical = scored(pairs, work, None)
    semantic = scored(pairs, work, LocalEncoder())
    chosen = choose([lexical, semantic])
    default = AgentSettings().similar_threshold
    rows: list[Row] = []
    for label, results in (("lexical", lexical), ("with semantic", semantic)):
        for split in SPLITS:
            at = rates(results, default, split)
            rows.append(
                [
                    label if split == "tuning" else "",
                    split.replace("_", "-"),
                    str(at.pairs),
                    _percent(at.false_matches),
                    _percent(at.misses),
                    _percent(at.others),
                ]
            )
    report.figures["near_duplicates"] = {
        "threshold": default,
        "chosen_on_tuning": chosen,
        **{
            f"{label}_{split}": {
                "false_matches": round(rates(r, default, split).false_matches, 4),
                "misses": round(rates(r, default, split).misses, 4),
            }
            for label, r in (("lexical", lexical), ("semantic", semantic))
            for split in SPLITS
        },
    }
    report.add(
        "18. Near-duplicates on AddMemory: found and missed",
        f"{len(pairs)} pairs written for this (bench/similarity/pairs.jsonl): half "
        "restatements of an entry (paraphrases, reorderings, hedges added or removed, "
        "synonyms), half merely related (same topic, another fact), over agent notes and "
        "user profiles; split by entry into a tuning half and a held-out half. Each `new` "
        "text is added through the engine to a tier holding all 50 `existing` texts of its "
        "tier. False match: a related pair's entry reported; miss: a restatement's entry "
        f"not reported; others: any other entry of the tier reported. At the default "
        f"similar_threshold {default:g}, which the tuning half chose (fewest false matches "
        f"plus misses over both ways of scoring; this run's sweep says {chosen:g}; alone, "
        f"lexical {best(lexical):g}, with semantic {best(semantic):g}). Semantic: the "
        "bundled all-MiniLM-L6-v2.",
        ["scoring", "half", "pairs", "false matches", "misses", "others"],
        rows,
    )
    cost = _cost(work, corpus, [30, 2000], count, semantic=False)
    cost += _cost(work, corpus, [30], max(count // 4, 50), semantic=True)
    report.add(
        "18b. Near-duplicates on AddMemory: what report costs",
        "One daemon, two agents: one under similar_writes: allow (nothing computed, the "
        "baseline), one under report (the tier ranked by the new content's 4 rarest terms, "
        "the best 5 scored, and with semantic retrieval the 5 nearest by cosine too), their "
        "AddMemory calls in alternating batches of 10, each a new text, deleted again "
        "untimed so each tier stays at its size, held in memory as after any turn. "
        f"{count} timed calls of each (lexical), {max(count // 4, 50)} (semantic: "
        "server.semantic_encoder: local, where both agents embed every write).",
        ["call", "allow p50", "report p50", "ratio", "allow p99", "report p99"],
        cost,
    )


def main(argv: list[str] | None = None) -> int:
    """The tuning sweep: false matches and misses at each threshold."""
    del argv
    from sidecar.retrieval.embedding import LocalEncoder

    pairs = load()
    with tempfile.TemporaryDirectory(prefix="memory-sidecar-bench-") as tmp:
        modes = {
            "lexical": scored(pairs, Path(tmp), None),
            "semantic": scored(pairs, Path(tmp), LocalEncoder()),
        }
    print("threshold  " + "  ".join(f"{m:>8} fm/miss (tuning)" for m in modes))
    for threshold in GRID:
        cells = [rates(r, threshold, "tuning") for r in modes.values()]
        print(
            f"{threshold:9.2f}  "
            + "  ".join(f"{c.false_matches:8.0%} {c.misses:4.0%}          " for c in cells)
        )
    print(f"chosen: {choose(modes.values()):g}")
    for mode, results in modes.items():
        print(f"{mode} alone: {best(results):g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
