"""MaxScore pruning for rank(): the candidates for a ranking's first places,
found without adding up the postings of the query's common words.

rank() (sidecar.retrieval.ranking) hands over the query's terms with their postings in
each partition, and the blend's weights; pruned() answers with the entries
that can place and their BM25 scores, or None when scoring every entry
costs less.

Owns: MaxScore's candidates (pruned), its cost model (LOOKUP_COST,
ENTRY_COST) and the arrays joined end to end (joined, which rank() uses
too). Must not touch: anything but the arrays it is given: it never imports
ranking (which imports it), builds no index, reads no entry and never the
database; the blend it bounds is ranking's, restated here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

# What scoring one candidate for one term by binary search costs, in units
# of adding up one posting densely; and an entry's share of the dense pass
# (zeroing, comparing, gathering): about 45, 11 and 3.6 ns, measured on
# section 13's corpus of `make bench` at 1,000,000 entries.
LOOKUP_COST = 4
ENTRY_COST = 1 / 3

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class TermPostings(Protocol):
    """A term's entries in one partition as pruning reads them (a
    ranking.Postings): positions ascending, the weights at some of them,
    and the highest."""

    @property
    def positions(self) -> npt.NDArray[np.integer[Any]]: ...
    def at(self, index: npt.NDArray[np.integer[Any]]) -> FloatArray: ...
    def highest(self) -> float: ...


class QueryTerm(Protocol):
    """One query term as rank() looks it up: its idf, its postings in each
    partition holding it (with the partition's place), and how many entries
    hold it."""

    @property
    def idf(self) -> float: ...
    @property
    def found(self) -> Sequence[tuple[int, TermPostings]]: ...
    @property
    def df(self) -> int: ...


class Blend(Protocol):
    """The blend's weights (a ranking.Weights)."""

    @property
    def similarity(self) -> float: ...
    @property
    def confidence(self) -> float: ...


# What a bound must fall short by before it rules an entry out: the scores
# it bounds add the same floats in another order (last-bit differences).
_MARGIN = 1e-9


def pruned(
    postings: Sequence[QueryTerm],
    offsets: list[int],
    keep: BoolArray | None,
    confidence: FloatArray,
    weights: Blend,
    deeper: int,
) -> tuple[IntArray, FloatArray] | None:
    """The candidates for the first `deeper` places and their BM25 scores,
    found without adding up the postings of the query's common words: the
    answer rank() would give by scoring every entry, for a fraction of the
    cost when one query word matches most of a large tier (MaxScore: Turtle
    and Flood, "Query evaluation: strategies and optimizations", 1995).

    The entries of the rarest terms are scored exactly (every term looked
    up by binary search). An entry holding none of them scores at most the
    sum of the other terms' highest weights (`rest`), so blends to at most
    `bound`; when that is below the deeper-th best blend found, no such
    entry can place. Nor can one score above the best found, which
    normalises every score (it would need rest > best, and the bound would
    then exceed every blend found). Otherwise the next rarest term's entries
    join, until scoring so many would cost more than scoring every entry:
    then None."""
    # Past this many candidates, scoring them all densely costs less.
    budget = _budget(postings, offsets[-1])
    by_df = sorted(range(len(postings)), key=lambda i: postings[i].df)
    ceilings = [
        term.idf * max((got.highest() for _, got in term.found), default=0.0) for term in postings
    ]
    found: list[IntArray] = []
    scored: list[FloatArray] = []
    top_confidence: float | None = None
    read = 0
    for split, i in enumerate(by_df, start=1):
        read += postings[i].df
        if read > budget:
            return None
        fresh = _newly_found(postings[i], [postings[j] for j in by_df[: split - 1]], offsets, keep)
        found.append(fresh)
        scored.append(_scores(fresh, postings, offsets))
        rest = sum(ceilings[j] for j in by_df[split:])
        candidates, scores = np.concatenate(found), np.concatenate(scored)
        if not rest:
            # Every term was read: these are all the matches there are.
            return candidates, scores
        if len(candidates) < deeper:
            continue
        best, threshold = _best_and_threshold(candidates, scores, confidence, weights, deeper)
        if top_confidence is None:
            top_confidence = float(confidence.max())
        bound = weights.similarity * (rest / best) + weights.confidence * top_confidence
        if bound + _MARGIN < threshold:
            return candidates, scores
    return None


def _budget(postings: Sequence[QueryTerm], total: int) -> float:
    """How many candidates scoring by binary search may take before scoring
    every entry densely costs less."""
    return (sum(term.df for term in postings) + total * ENTRY_COST) / (LOOKUP_COST * len(postings))


def _newly_found(
    term: QueryTerm, rarer: Sequence[QueryTerm], offsets: list[int], keep: BoolArray | None
) -> IntArray:
    """This term's kept entries (partitions in order: ascending), less those
    holding a rarer one (already scored)."""
    fresh = joined(
        [got.positions + offsets[pi] if offsets[pi] else got.positions for pi, got in term.found]
        or [_NO_INDICES]
    ).astype(np.int64, copy=False)
    for other in rarer:
        fresh = fresh[~_holding(fresh, other, offsets)]
    if keep is not None:
        fresh = fresh[keep[fresh]]
    return fresh


def _best_and_threshold(
    candidates: IntArray, scores: FloatArray, confidence: FloatArray, weights: Blend, deeper: int
) -> tuple[float, float]:
    """The best of these scores, and the deeper-th best blend: rank()'s
    blend, as it will compute it for these candidates."""
    best = float(scores.max())
    blended = weights.similarity * (scores / best) + weights.confidence * (confidence[candidates])
    return best, float(np.partition(blended, len(blended) - deeper)[len(blended) - deeper])


def _located(
    positions: IntArray, term: QueryTerm, offsets: list[int]
) -> Iterator[tuple[int, int, TermPostings, IntArray, BoolArray]]:
    """Where a term's postings hold these positions (ascending), partition by
    partition: the positions' range (lo:hi), the partition's postings, each
    position's index in them, and whether it is there."""
    bounds = np.searchsorted(positions, offsets).tolist()
    for pi, got in term.found:
        lo, hi = bounds[pi], bounds[pi + 1]
        if lo == hi:
            continue
        held = got.positions
        # The haystack's dtype: another would copy it on every search.
        local = (positions[lo:hi] - offsets[pi]).astype(held.dtype, copy=False)
        at = np.searchsorted(held, local)
        np.minimum(at, len(held) - 1, out=at)
        yield lo, hi, got, at, held[at] == local


def _holding(positions: IntArray, term: QueryTerm, offsets: list[int]) -> BoolArray:
    """Which of these positions (ascending) hold the term."""
    holding = np.zeros(len(positions), dtype=bool)
    for lo, hi, _, _, hit in _located(positions, term, offsets):
        holding[lo:hi] = hit
    return holding


def _scores(positions: IntArray, postings: Sequence[QueryTerm], offsets: list[int]) -> FloatArray:
    """The BM25 scores of these positions (ascending): the same floats rank()
    adds, in the same order, so the same sums to the bit."""
    scores = np.zeros(len(positions), dtype=np.float64)
    for term in postings:
        for lo, hi, got, at, hit in _located(positions, term, offsets):
            part = scores[lo:hi]
            part[hit] += term.idf * got.at(at[hit])
    return scores


def joined(arrays: Sequence[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    """The arrays end to end; no copy when only one holds anything (a large
    tier beside an empty one)."""
    filled = [a for a in arrays if len(a)]
    if len(filled) == 1:
        return filled[0]
    return np.concatenate(arrays)


# The positions of a term no partition holds (never written).
_NO_INDICES: IntArray = np.array([], dtype=np.int64)
_NO_INDICES.flags.writeable = False
