"""Ranked retrieval: BM25 over keyword terms, blended with confidence.

score = similarity_weight * (bm25 / best bm25) + confidence_weight * confidence

(DeerFlow's planned blend, defaults 0.6 and 0.4). Any keyword may match;
more matches and rarer words rank higher. Ties break by insertion order, so
results are deterministic.

rank() reads partitions through the `Ranked` protocol: a full partition
(sidecar.retrieval.partition, whose term weights these are) or a compact one
(sidecar.retrieval.compact). Skipping the entries that cannot place is
sidecar.retrieval.pruning's.

Owns: the order of a ranking (idf, the blend, the semantic spread, ties by
insertion), the protocols partitions are read through (Ranked, Listed,
Postings), and when to score in Python, in arrays or with pruning.
Must not touch: building an index or its term weights (the partitions'),
entries but through a partition's fetch (a compact one's reads the
database), the query's terms or cosines (sidecar.domain.queries hands them
in), gRPC.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from sidecar.core.memory import Memory
from sidecar.retrieval import pruning

# Below this many entries, plain Python beats numpy's per-call overhead.
VECTORIZE_FROM = 512
# From this many entries on, rank() skips the entries that cannot reach the
# first `limit` (sidecar.retrieval.pruning); below it, adding up every posting costs
# less (measured on bench's corpus: even at 50,000, 0.45 against 0.53 ms p50).
PRUNE_FROM = 50_000

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class Postings(NamedTuple):
    """A term's entries in one partition (positions ascending, none twice)
    and their BM25 weights: `weights` itself, or with a `table`, the floats
    of the table it indexes (a compact partition keeps counts, and a count's
    weight is then looked up only for the entries a search reads). A table
    ascends, so its entry at the highest index is the highest weight."""

    positions: npt.NDArray[np.integer[Any]]
    weights: npt.NDArray[Any]
    table: FloatArray | None = None

    def all(self) -> FloatArray:
        found: FloatArray = self.weights if self.table is None else self.table[self.weights]
        return found

    def at(self, index: npt.NDArray[np.integer[Any]]) -> FloatArray:
        found: FloatArray = self.weights[index]
        return found if self.table is None else self.table[found]

    def highest(self) -> float:
        top = self.weights.max()
        return float(top if self.table is None else self.table[top])


class Ranked(Protocol):
    """A partition as rank() sees it: a partition.Partition or a
    compact.CompactPartition."""

    @property
    def count(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def confidence(self) -> FloatArray: ...
    @property
    def recency(self) -> FloatArray: ...
    @property
    def seq(self) -> IntArray: ...
    def alive(self) -> BoolArray | None: ...
    def category_mask(self, category: str) -> BoolArray: ...
    def term(self, term: str) -> Postings | None: ...
    def fetch(self, positions: Sequence[int]) -> list[Memory | None]: ...


class Listed:
    """A partition holding its entries in memory (a partition.Partition
    declares itself one): rank() can score it in plain Python, from its
    memories and its postings (term -> entry indices, weights)."""

    __slots__ = ()

    memories: Sequence[Memory]
    postings: dict[str, tuple[IntArray, FloatArray]]


@dataclass(frozen=True, slots=True)
class SemanticScores:
    """A query's cosines for rank(): one per position of the partitions end
    to end (NaN for an entry without a vector), the blend's weight, and the
    floor for a match by meaning alone."""

    cosines: FloatArray
    weight: float
    floor: float


def spread(cosines: FloatArray) -> FloatArray:
    """The candidates' cosines scaled to 0..1, the lowest 0 and the best 1,
    as BM25 is scaled to the best: how far apart two entries are counts, not
    where a model's cosines happen to lie (all-MiniLM-L6-v2's run from about
    -0.1 to 0.7, e5's from 0.7 to 0.95), so one blend weight suits any
    encoder. An entry without a vector (NaN) gets 0; when the known cosines
    are all alike, each gets 1, as a lone BM25 match scores 1."""
    known = ~np.isnan(cosines)
    if not known.any():
        return np.zeros(len(cosines), dtype=np.float64)
    values = cosines[known]
    low, high = float(values.min()), float(values.max())
    if high <= low:
        return known.astype(np.float64)
    return np.where(known, (cosines - low) / (high - low), 0.0)


@dataclass(frozen=True, slots=True)
class Weights:
    similarity: float = 0.6
    confidence: float = 0.4


def rank(
    partitions: Sequence[Ranked],
    keywords: Sequence[str],
    weights: Weights,
    *,
    match_all: bool = False,
    category: str = "",
    limit: int | None = None,
    vectorized: bool | None = None,
    leave_out: frozenset[int] = frozenset(),
    semantic: SemanticScores | None = None,
    prune: bool | None = None,
) -> list[tuple[Memory, float]]:
    """The best `limit` matching memories (all with None) and their scores,
    leaving out the entries whose seqs are in `leave_out` (those the frozen
    block shows: a compact tier then reads only what the turn can use).

    No keywords: every memory, ranked by confidence, then recency, with its
    confidence as its score.

    Large tiers are scored in numpy arrays, so the cost is the query terms'
    postings at C speed; small ones (the budgeted tiers of a cached turn) in
    plain Python, which has no per-call array overhead. Both compute the same
    floating-point operations in the same order and return the same answer
    (tests/retrieval/test_ranking.py); `vectorized` forces one for those tests. Compact
    partitions are always scored in arrays, and only the entries returned
    are read (from the database); an entry removed in between is left out.

    With a limit, from PRUNE_FROM entries on (or with `prune`), entries that
    cannot place are skipped without being scored (sidecar.retrieval.pruning): a query
    word held by most of a million entries then costs little. The answer is
    the same, to the bit (tests/retrieval/test_pruning.py).

    With `semantic` (sidecar.retrieval.semantic), similarity blends BM25 with each
    entry's cosine to the query, and an entry matching no keyword matches
    when its cosine reaches the floor. match_all ignores it: all keywords
    must then match, as without; so does a query without keywords (only
    stop words), which ranks everything by confidence, as without.
    """
    if match_all or not keywords:
        semantic = None
    plain = [p for p in partitions if isinstance(p, Listed)]
    if semantic is not None:
        vectorized = True
    if vectorized is None:
        vectorized = len(plain) < len(partitions) or sum(p.count for p in plain) > VECTORIZE_FROM
    if not vectorized:
        if len(plain) < len(partitions):
            raise ValueError("compact partitions are ranked in arrays only")
        ranked = _rank_python(plain, keywords, weights, match_all, category, None)
        hits = [hit for hit in ranked if hit[0].seq not in leave_out]
        return hits if limit is None else hits[:limit]
    query = _Query(keywords, weights, match_all, limit, leave_out, semantic)
    return _rank_arrays(partitions, query, category, prune)


@dataclass(frozen=True, slots=True)
class _Query:
    """What rank() was asked, as its array steps read it. `deeper` is how
    deep to rank so that `limit` remain once `leave_out` is left out."""

    keywords: Sequence[str]
    weights: Weights
    match_all: bool
    limit: int | None
    leave_out: frozenset[int]
    semantic: SemanticScores | None

    @property
    def deeper(self) -> int | None:
        return None if self.limit is None else self.limit + len(self.leave_out)

    def kept(self, ordered: Iterable[int], seq: IntArray) -> list[int]:
        """The first `limit` of these positions whose seqs are not left out."""
        leave_out = self.leave_out
        found = [k for k in ordered if int(seq[k]) not in leave_out] if leave_out else ordered
        return [int(k) for k in found][: self.limit]


class _Tier(NamedTuple):
    """The partitions end to end: where each starts (and, last, the total),
    and the arrays over every position; `keep` says which positions are
    alive and in the category (None: all of them)."""

    offsets: list[int]
    confidence: FloatArray
    seq: IntArray
    keep: BoolArray | None


def _joined(partitions: Sequence[Ranked], offsets: list[int], category: str) -> _Tier:
    """The partitions' arrays end to end, and which positions may match."""
    confidence = pruning.joined([p.confidence for p in partitions])
    seq = pruning.joined([p.seq for p in partitions])
    masks = [p.alive() for p in partitions]
    keep: BoolArray | None = None
    if any(mask is not None for mask in masks):
        keep = np.concatenate(
            [
                np.ones(p.size, dtype=bool) if m is None else m
                for p, m in zip(partitions, masks, strict=True)
            ]
        )
    if category:
        wanted = np.concatenate([p.category_mask(category) for p in partitions])
        keep = wanted if keep is None else keep & wanted
    return _Tier(offsets, confidence, seq, keep)


def _rank_arrays(
    partitions: Sequence[Ranked], query: _Query, category: str, prune: bool | None
) -> list[tuple[Memory, float]]:
    """rank() in numpy arrays, over any partitions."""
    offsets = [0]
    for p in partitions:
        offsets.append(offsets[-1] + p.size)
    live = sum(p.count for p in partitions)
    if not live:
        return []
    tier = _joined(partitions, offsets, category)
    if not query.keywords and query.semantic is None:
        positions = query.kept(_by_confidence(partitions, tier, query.deeper), tier.seq)
        confidences = [float(tier.confidence[k]) for k in positions]
        return _fetched(partitions, offsets, positions, confidences)
    postings = _looked_up(partitions, query.keywords, live)
    if prune is None:
        prune = offsets[-1] >= PRUNE_FROM
    pruned = None
    deeper = query.deeper
    if prune and query.semantic is None and not query.match_all and deeper is not None:
        pruned = pruning.pruned(
            postings, offsets, tier.keep, tier.confidence, query.weights, deeper
        )
    candidates, scores = pruned if pruned is not None else _summed(postings, tier, query)
    if not len(candidates):
        return []
    blended = _blended(candidates, scores, tier.confidence, query)
    ordered, ordered_blends = _first(candidates, blended, tier.seq, deeper)
    score = dict(zip(ordered, ordered_blends, strict=True))
    positions = query.kept(ordered, tier.seq)
    return _fetched(partitions, offsets, positions, [score[k] for k in positions])


def _by_confidence(partitions: Sequence[Ranked], tier: _Tier, deeper: int | None) -> list[int]:
    """The kept positions, or the first `deeper` of them, by confidence, then
    recency, then seq: a query without keywords."""
    recency = pruning.joined([p.recency for p in partitions])
    confidence, seq, keep = tier.confidence, tier.seq, tier.keep
    if deeper is None:
        order = np.lexsort((seq, -recency, -confidence))
        chosen = order if keep is None else order[keep[order]]
        found: list[int] = chosen.tolist()
        return found
    return top_by_confidence(confidence, recency, seq, keep, deeper)


def _looked_up(partitions: Sequence[Ranked], keywords: Sequence[str], live: int) -> list[_Postings]:
    """Each distinct query term's idf over the live entries, and its postings."""
    postings: list[_Postings] = []
    for term in dict.fromkeys(keywords):
        found = [(pi, got) for pi, p in enumerate(partitions) if (got := p.term(term)) is not None]
        df = sum(len(got.positions) for _, got in found)
        postings.append(_Postings(math.log(1 + (live - df + 0.5) / (df + 0.5)), found, df))
    return postings


def _summed(postings: list[_Postings], tier: _Tier, query: _Query) -> tuple[IntArray, FloatArray]:
    """The matching positions and their BM25 scores, every posting added up."""
    offsets = tier.offsets
    bm25 = np.zeros(offsets[-1], dtype=np.float64)
    # Counted only for match_all: any match leaves a positive score (every
    # idf and every weight is), so bm25 > 0 says which entries matched.
    matched = np.zeros(offsets[-1], dtype=np.int32) if query.match_all else None
    for term_postings in postings:
        for pi, got in term_postings.found:
            at = got.positions + offsets[pi] if offsets[pi] else got.positions
            # A term lists an entry at most once: plain fancy indexing adds safely.
            bm25[at] += term_postings.idf * got.all()
            if matched is not None:
                matched[at] += 1
    hit = bm25 > 0 if matched is None else matched >= len(postings)
    if query.semantic is not None:
        hit |= query.semantic.cosines >= query.semantic.floor
    if tier.keep is not None:
        hit &= tier.keep
    candidates = np.nonzero(hit)[0]
    return candidates, bm25[candidates]


def _blended(
    candidates: IntArray, scores: FloatArray, confidence: FloatArray, query: _Query
) -> FloatArray:
    """The candidates' blend: BM25 scaled to the best (with the semantic
    spread, if any) and confidence."""
    best = float(scores.max())
    similarity = scores / best if best > 0 else scores
    semantic = query.semantic
    if semantic is not None:
        similarity = (1 - semantic.weight) * similarity + semantic.weight * spread(
            semantic.cosines[candidates]
        )
    weights = query.weights
    blended: FloatArray = (
        weights.similarity * similarity + weights.confidence * (confidence[candidates])
    )
    return blended


def _first(
    candidates: IntArray, blended: FloatArray, seq: IntArray, deeper: int | None
) -> tuple[list[int], list[float]]:
    """The first `deeper` candidates (all with None) and their blends, by
    blend, then insertion order."""
    if deeper is not None and len(candidates) > deeper:
        # Everything scoring at least the deeper-th best, ties included, then
        # the exact order (score, then insertion) on that small set.
        threshold = np.partition(blended, len(blended) - deeper)[len(blended) - deeper]
        near = blended >= threshold
        candidates, blended = candidates[near], blended[near]
    order = np.lexsort((seq[candidates], -blended))
    if deeper is not None:
        order = order[:deeper]
    return candidates[order].tolist(), blended[order].tolist()


class _Postings(NamedTuple):
    """One query term: its idf, its postings in each partition holding it,
    and how many entries hold it."""

    idf: float
    found: list[tuple[int, Postings]]
    df: int


def _fetched(
    partitions: Sequence[Ranked], offsets: list[int], chosen: list[int], scores: list[float]
) -> list[tuple[Memory, float]]:
    """The memories at these global positions, with their scores, in order;
    each partition asked once."""
    located: list[tuple[int, int]] = []
    wanted: dict[int, list[int]] = {}
    for k in chosen:
        pi = bisect.bisect_right(offsets, k) - 1
        located.append((pi, k - offsets[pi]))
        wanted.setdefault(pi, []).append(k - offsets[pi])
    got = {
        pi: dict(zip(positions, partitions[pi].fetch(positions), strict=True))
        for pi, positions in wanted.items()
    }
    return [
        (memory, score)
        for (pi, position), score in zip(located, scores, strict=True)
        if (memory := got[pi][position]) is not None
    ]


def top_by_confidence(
    confidence: FloatArray,
    recency: FloatArray,
    seq: IntArray,
    keep: BoolArray | None,
    limit: int,
) -> list[int]:
    """The first `limit` of the kept positions ordered by confidence (highest
    first), then recency (newest first), then seq, without sorting them all:
    the entries tied with the limit-th on confidence are narrowed by recency,
    and only what is left is sorted."""
    candidates = np.flatnonzero(keep) if keep is not None else np.arange(len(seq))
    if limit <= 0 or not len(candidates):
        return []
    if len(candidates) > limit:
        values = -confidence[candidates]
        cut = np.partition(values, limit - 1)[limit - 1]
        better, tied = candidates[values < cut], candidates[values == cut]
        needed = limit - len(better)
        if len(tied) > needed:
            recent = -recency[tied]
            tied = tied[recent <= np.partition(recent, needed - 1)[needed - 1]]
        candidates = np.concatenate([better, tied])
    order = np.lexsort((seq[candidates], -recency[candidates], -confidence[candidates]))
    return [int(p) for p in candidates[order[:limit]]]


def _term(
    partitions: Sequence[Listed], term: str, total: int
) -> tuple[float, list[tuple[int, tuple[IntArray, FloatArray]]]]:
    """A query term's idf over all entries, and its postings per partition."""
    found = [(pi, p.postings[term]) for pi, p in enumerate(partitions) if term in p.postings]
    df = sum(len(indices) for _, (indices, _) in found)
    return math.log(1 + (total - df + 0.5) / (df + 0.5)), found


def _rank_python(
    partitions: Sequence[Listed],
    keywords: Sequence[str],
    weights: Weights,
    match_all: bool,
    category: str,
    limit: int | None,
) -> list[tuple[Memory, float]]:
    if not keywords:
        pool = [m for p in partitions for m in p.memories]
        chosen = sorted(
            (m for m in pool if not category or m.category == category),
            key=lambda m: (-m.confidence, -m.updated_at.timestamp(), m.seq),
        )
        return [(m, m.confidence) for m in (chosen if limit is None else chosen[:limit])]
    unique = list(dict.fromkeys(keywords))
    offsets = [0]
    for p in partitions:
        offsets.append(offsets[-1] + len(p.memories))
    total = offsets[-1]
    bm25: dict[int, float] = {}
    matched: dict[int, int] = {}
    for term in unique:
        idf, found = _term(partitions, term, total)
        for pi, (indices, values) in found:
            for index, value in zip(indices.tolist(), values.tolist(), strict=True):
                k = offsets[pi] + index
                bm25[k] = bm25.get(k, 0.0) + idf * value
                matched[k] = matched.get(k, 0) + 1
    needed = len(unique) if match_all else 1
    # Only the entries matched are looked up, not every entry listed (a
    # near-duplicate check ranks its tier by a few rare terms on each add).
    hits = []
    for k, n in matched.items():
        if n >= needed:
            memory = _entry(partitions, offsets, k)
            if not category or memory.category == category:
                hits.append((bm25[k], memory))
    if not hits:
        return []
    best = max(score for score, _ in hits)
    blended = [
        (memory, weights.similarity * (score / best) + weights.confidence * memory.confidence)
        for score, memory in hits
    ]
    blended.sort(key=lambda hit: (-hit[1], hit[0].seq))
    return blended if limit is None else blended[:limit]


def _entry(partitions: Sequence[Listed], offsets: list[int], k: int) -> Memory:
    """The entry at position `k` of the partitions end to end (`offsets`:
    where each starts)."""
    at = bisect.bisect_right(offsets, k) - 1
    return partitions[at].memories[k - offsets[at]]
