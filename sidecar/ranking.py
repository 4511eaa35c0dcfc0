"""Ranked retrieval: BM25 over keyword terms, blended with confidence.

score = similarity_weight * (bm25 / best bm25) + confidence_weight * confidence

(DeerFlow's planned blend, defaults 0.6 and 0.4). Any keyword may match;
more matches and rarer words rank higher. Ties break by insertion order, so
results are deterministic.

Length normalisation uses a fixed reference length (REFERENCE_LENGTH terms)
instead of the corpus average: memories are short notes of similar length,
and it makes an entry's term weights independent of every other entry, so a
write updates the index by one entry instead of re-weighting all of them,
and the same store always ranks the same way whatever its history.

A `Partition` is one tier of one owner, indexed once and shared read-only by
every search, snapshot and session that needs it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from sidecar.keywords import terms
from sidecar.memory import Memory, Tier, Usage

K1 = 1.2
B = 0.75
REFERENCE_LENGTH = 16

Key = tuple[int, int]  # (partition index, entry index)
TermWeights = tuple[tuple[str, float], ...]


def term_weights(content: str) -> TermWeights:
    """An entry's BM25 term weights: tf * (k1 + 1) / (tf + k1 * (1 - b + b * len / ref))."""
    counts = Counter(terms(content))
    norm = K1 * (1 - B + B * sum(counts.values()) / REFERENCE_LENGTH)
    return tuple((term, tf * (K1 + 1) / (tf + norm)) for term, tf in counts.items())


@dataclass(frozen=True, slots=True, eq=False)
class Partition:
    """One owner's entries of one tier, as of one generation, with its index.

    Per entry, in insertion order: the memory, its term weights, what the
    content scanner found in it (or None) and its token count, all computed
    once. `postings` maps a term to {entry index: weight}.
    """

    tier: Tier
    owner: str
    generation: int
    memories: tuple[Memory, ...]
    usage: Usage
    weights: tuple[TermWeights, ...] = field(repr=False)
    findings: tuple[str | None, ...] = field(repr=False)
    tokens: tuple[int, ...] = field(repr=False)
    postings: dict[str, dict[int, float]] = field(repr=False)
    max_weight: dict[str, float] = field(repr=False)

    @classmethod
    def build(
        cls,
        tier: Tier,
        owner: str,
        generation: int,
        memories: Sequence[Memory],
        usage: Usage,
        *,
        scan: Callable[[Memory], str | None] = lambda m: None,
        count_tokens: Callable[[str], int] = lambda text: len(text) // 4,
    ) -> Partition:
        return cls._assemble(
            tier,
            owner,
            generation,
            tuple(memories),
            usage,
            tuple(term_weights(m.content) for m in memories),
            tuple(scan(m) for m in memories),
            tuple(count_tokens(m.content) for m in memories),
        )

    @classmethod
    def _assemble(
        cls,
        tier: Tier,
        owner: str,
        generation: int,
        memories: tuple[Memory, ...],
        usage: Usage,
        weights: tuple[TermWeights, ...],
        findings: tuple[str | None, ...],
        tokens: tuple[int, ...],
    ) -> Partition:
        postings: dict[str, dict[int, float]] = {}
        for index, entry in enumerate(weights):
            for term, weight in entry:
                postings.setdefault(term, {})[index] = weight
        max_weight = {term: max(docs.values()) for term, docs in postings.items()}
        return cls(
            tier,
            owner,
            generation,
            memories,
            usage,
            weights,
            findings,
            tokens,
            postings,
            max_weight,
        )

    def added(
        self,
        memory: Memory,
        generation: int,
        usage: Usage,
        *,
        scan: Callable[[Memory], str | None],
        count_tokens: Callable[[str], int],
    ) -> Partition:
        """This partition with one more entry, the newest (appended)."""
        index = len(self.memories)
        entry = term_weights(memory.content)
        # Copy on write: only the touched terms' postings are new objects;
        # readers of this partition keep seeing it unchanged.
        postings = dict(self.postings)
        max_weight = dict(self.max_weight)
        for term, weight in entry:
            docs = dict(postings.get(term, {}))
            docs[index] = weight
            postings[term] = docs
            max_weight[term] = max(weight, max_weight.get(term, 0.0))
        return Partition(
            self.tier,
            self.owner,
            generation,
            (*self.memories, memory),
            usage,
            (*self.weights, entry),
            (*self.findings, scan(memory)),
            (*self.tokens, count_tokens(memory.content)),
            postings,
            max_weight,
        )

    def changed(
        self,
        memory_id: str,
        replacement: Memory | None,
        generation: int,
        usage: Usage,
        *,
        scan: Callable[[Memory], str | None],
        count_tokens: Callable[[str], int],
    ) -> Partition:
        """This partition with one entry replaced (or removed, with None).

        Re-indexes from the entries' cached weights: no other entry is
        tokenised again.
        """
        position = next(i for i, m in enumerate(self.memories) if m.id == memory_id)
        memories, weights = list(self.memories), list(self.weights)
        findings, tokens = list(self.findings), list(self.tokens)
        if replacement is None:
            for column in (memories, weights, findings, tokens):
                del column[position]
        else:
            memories[position] = replacement
            weights[position] = term_weights(replacement.content)
            findings[position] = scan(replacement)
            tokens[position] = count_tokens(replacement.content)
        return Partition._assemble(
            self.tier,
            self.owner,
            generation,
            tuple(memories),
            usage,
            tuple(weights),
            tuple(findings),
            tuple(tokens),
        )


@dataclass(frozen=True, slots=True)
class Weights:
    similarity: float = 0.6
    confidence: float = 0.4


def by_confidence(memories: Iterable[Memory]) -> list[Memory]:
    """Highest confidence first, then most recently updated, then oldest entry."""
    return sorted(memories, key=lambda m: (-m.confidence, -m.updated_at.timestamp(), m.seq))


@dataclass(slots=True)
class _Term:
    idf: float
    bound: float  # the most this term can add to one entry's bm25
    lists: list[dict[int, float]]


def rank(
    partitions: Sequence[Partition],
    keywords: Sequence[str],
    weights: Weights,
    *,
    match_all: bool = False,
    category: str = "",
    limit: int | None = None,
) -> list[tuple[Memory, float]]:
    """The best `limit` matching memories (all with None) and their scores.

    No keywords: every memory, ranked by confidence, then recency, with its
    confidence as its score.

    With a limit, entries are scored rarest term first (MaxScore): once the
    `limit`-th best blended score beats anything an entry matching only the
    remaining, more common terms could reach, those terms' long postings are
    never walked. The answer is exactly the unpruned one, only cheaper.
    """
    if not keywords:
        pool = [m for p in partitions for m in p.memories if not category or m.category == category]
        ranked = [(m, m.confidence) for m in by_confidence(pool)]
        return ranked if limit is None else ranked[:limit]

    total_docs = sum(len(p.memories) for p in partitions)
    unique = list(dict.fromkeys(keywords))
    found: list[_Term] = []
    for term in unique:
        lists = [p.postings.get(term, {}) for p in partitions]
        df = sum(len(docs) for docs in lists)
        if not df:
            continue
        idf = math.log(1 + (total_docs - df + 0.5) / (df + 0.5))
        bound = idf * max(p.max_weight.get(term, 0.0) for p in partitions)
        found.append(_Term(idf, bound, lists))
    if not found or (match_all and len(found) < len(unique)):
        return []
    found.sort(key=lambda t: t.bound, reverse=True)

    def full_score(key: Key) -> float:
        pi, index = key
        return sum(t.idf * t.lists[pi].get(index, 0.0) for t in found)

    scores: dict[Key, float] = {}
    if match_all:
        rarest = min(found, key=lambda t: sum(len(docs) for docs in t.lists))
        for pi, docs in enumerate(rarest.lists):
            for index in docs:
                if all(index in t.lists[pi] for t in found):
                    scores[(pi, index)] = full_score((pi, index))
        return _finish(partitions, scores, weights, category, limit)

    remaining = sum(t.bound for t in found)
    for step, current in enumerate(found):
        for pi, docs in enumerate(current.lists):
            for index in docs:
                key = (pi, index)
                if key not in scores:
                    scores[key] = full_score(key)
        remaining -= current.bound
        if limit is None or step == len(found) - 1:
            continue
        top, best = _top(partitions, scores, weights, category, limit)
        # An entry not seen yet matches only the remaining terms: its bm25 is
        # at most `remaining`, its blended score at most this ceiling. Beating
        # the ceiling also settles the normalisation: were `remaining` above
        # the best bm25 seen, the ceiling would exceed any reachable score.
        if len(top) == limit:
            ceiling = weights.similarity * remaining / best + weights.confidence
            if top[-1][1] > ceiling:
                return top
    return _finish(partitions, scores, weights, category, limit)


def _top(
    partitions: Sequence[Partition],
    scores: dict[Key, float],
    weights: Weights,
    category: str,
    limit: int | None,
) -> tuple[list[tuple[Memory, float]], float]:
    """The blended, ordered hits among `scores`, and the best bm25 among them."""
    hits = [
        (partitions[pi].memories[index], bm25)
        for (pi, index), bm25 in scores.items()
        if not category or partitions[pi].memories[index].category == category
    ]
    if not hits:
        return [], 0.0
    best = max(bm25 for _, bm25 in hits)
    blended = [
        (m, weights.similarity * (bm25 / best) + weights.confidence * m.confidence)
        for m, bm25 in hits
    ]
    blended.sort(key=lambda hit: (-hit[1], hit[0].seq))
    return (blended if limit is None else blended[:limit]), best


def _finish(
    partitions: Sequence[Partition],
    scores: dict[Key, float],
    weights: Weights,
    category: str,
    limit: int | None,
) -> list[tuple[Memory, float]]:
    return _top(partitions, scores, weights, category, limit)[0]
