"""Ranked retrieval: BM25 over keyword terms, blended with confidence.

score = similarity_weight * (bm25 / best bm25) + confidence_weight * confidence

(DeerFlow's planned blend, defaults 0.6 and 0.4). Any keyword may match;
more matches and rarer words rank higher. Ties break by insertion order, so
results are deterministic.

A `Partition` is one tier of one owner, indexed once and shared read-only by
every search, snapshot and session that needs it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sidecar.keywords import terms
from sidecar.memory import Memory, Tier, Usage

K1 = 1.2
B = 0.75


@dataclass(frozen=True, slots=True, eq=False)
class Partition:
    """One owner's entries of one tier, as of one generation, with its index."""

    tier: Tier
    owner: str
    generation: int
    memories: tuple[Memory, ...]
    usage: Usage
    lengths: tuple[int, ...]
    postings: dict[str, list[tuple[int, int]]] = field(repr=False)

    @classmethod
    def build(
        cls, tier: Tier, owner: str, generation: int, memories: Sequence[Memory], usage: Usage
    ) -> Partition:
        postings: dict[str, list[tuple[int, int]]] = {}
        lengths = []
        for index, memory in enumerate(memories):
            counts = Counter(terms(memory.content))
            lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                postings.setdefault(term, []).append((index, tf))
        return cls(tier, owner, generation, tuple(memories), usage, tuple(lengths), postings)


@dataclass(frozen=True, slots=True)
class Weights:
    similarity: float = 0.6
    confidence: float = 0.4


def by_confidence(memories: Iterable[Memory]) -> list[Memory]:
    """Highest confidence first, then most recently updated, then oldest entry."""
    return sorted(memories, key=lambda m: (-m.confidence, -m.updated_at.timestamp(), m.seq))


def rank(
    partitions: Sequence[Partition],
    keywords: Sequence[str],
    weights: Weights,
    *,
    match_all: bool = False,
    category: str = "",
) -> list[tuple[Memory, float]]:
    """Every memory that matches, with its blended score, best first.

    No keywords: every memory, ranked by confidence, then recency, with its
    confidence as its score.
    """
    if not keywords:
        pool = [m for p in partitions for m in p.memories if not category or m.category == category]
        return [(m, m.confidence) for m in by_confidence(pool)]

    total_docs = sum(len(p.memories) for p in partitions)
    total_len = sum(sum(p.lengths) for p in partitions)
    avgdl = total_len / total_docs if total_docs else 0.0
    scores: dict[tuple[int, int], float] = {}
    matched: Counter[tuple[int, int]] = Counter()
    for term in dict.fromkeys(keywords):
        df = sum(len(p.postings.get(term, ())) for p in partitions)
        if not df:
            continue
        idf = math.log(1 + (total_docs - df + 0.5) / (df + 0.5))
        for pi, partition in enumerate(partitions):
            for index, tf in partition.postings.get(term, ()):
                norm = K1 * (1 - B + B * partition.lengths[index] / avgdl) if avgdl else K1
                key = (pi, index)
                scores[key] = scores.get(key, 0.0) + idf * tf * (K1 + 1) / (tf + norm)
                matched[key] += 1

    needed = len(set(keywords))
    hits = []
    for (pi, index), bm25 in scores.items():
        if match_all and matched[(pi, index)] < needed:
            continue
        memory = partitions[pi].memories[index]
        if category and memory.category != category:
            continue
        hits.append((memory, bm25))
    if not hits:
        return []
    best = max(bm25 for _, bm25 in hits)
    blended = [
        (m, weights.similarity * (bm25 / best) + weights.confidence * m.confidence)
        for m, bm25 in hits
    ]
    blended.sort(key=lambda hit: (-hit[1], hit[0].seq))
    return blended
