"""Ranked retrieval: BM25 over keyword terms, blended with confidence.

score = similarity_weight * (bm25 / best bm25) + confidence_weight * confidence

(DeerFlow's planned blend, defaults 0.6 and 0.4). Any keyword may match;
more matches and rarer words rank higher. Ties break by insertion order, so
results are deterministic.

Length normalisation, when on (B > 0), uses a fixed reference length
(REFERENCE_LENGTH terms) instead of the corpus average, so an entry's term
weights never depend on other entries: a write updates the index by one
entry instead of re-weighting all of them, and the same store always ranks
the same way whatever its history. It is off (B = 0, see below).

A `Partition` is one tier of one owner, indexed once and shared read-only by
every search, snapshot and session that needs it.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple, Protocol, TypeVar, overload

import numpy as np
import numpy.typing as npt

from sidecar.keywords import MONTHS, month_term, terms
from sidecar.memory import Memory, Tier, Usage

K1 = 1.2
# No length normalisation: on the relevance sets in bench/relevance/ every
# b > 0 found fewer answers (tuning sets 85.0% at b 0, 78.8% at 0.75; k1
# made no difference at b 0). Memories are short, and a longer one is not
# less about each word it holds. `python -m bench.retrieval --grid`.
B = 0.0
REFERENCE_LENGTH = 16
# Below this many entries, plain Python beats numpy's per-call overhead.
VECTORIZE_FROM = 512
# From this many entries on, rank() skips the entries that cannot reach the
# first `limit` (_pruned); below it, adding up every posting costs less
# (measured on bench's corpus: even at 50,000, 0.45 against 0.53 ms p50).
PRUNE_FROM = 50_000
# What scoring one candidate for one term by binary search costs, in units
# of adding up one posting densely; and an entry's share of the dense pass
# (zeroing, comparing, gathering): about 45, 11 and 3.6 ns, measured on
# section 13's corpus of `make bench` at 1,000,000 entries.
LOOKUP_COST = 4
ENTRY_COST = 1 / 3

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
TermWeights = tuple[tuple[str, float], ...]


def date_terms(moment: datetime) -> list[str]:
    """The year and the month of that year an entry was written, as index
    terms ("2023", "july2023"): "what happened in July 2023" finds what was
    noted then, and "may" alone matches no entry's date."""
    return [str(moment.year), month_term(MONTHS[moment.month - 1], str(moment.year))]


def term_weights(memory: Memory) -> TermWeights:
    """An entry's BM25 term weights, over its content's terms and the month
    and year it was created: tf * (k1 + 1) / (tf + k1 * (1 - b + b * len / ref))."""
    counts = Counter(terms(memory.content))
    counts.update(date_terms(memory.created_at))
    norm = K1 * (1 - B + B * sum(counts.values()) / REFERENCE_LENGTH)
    return tuple((term, tf * (K1 + 1) / (tf + norm)) for term, tf in counts.items())


T = TypeVar("T")

# The size estimate's coefficients (see Partition.nbytes).
_ENTRY_BYTES = 400
_POSTING_BYTES = 16
_TERM_BYTES = 400


class Column(Sequence[T]):
    """The first `size` items of a list that only ever grows at its end.

    Successive partitions of one tier share their columns: a write appends
    to the list and the new partition sees one item more, while readers of
    the older one never look past its end. Appending is O(1) where copying
    the column was O(entries).
    """

    __slots__ = ("_items", "_size")

    def __init__(self, items: list[T], size: int | None = None) -> None:
        self._items = items
        self._size = len(items) if size is None else size

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return self._items[: self._size][index]
        if index < 0:
            index += self._size
        if not 0 <= index < self._size:
            raise IndexError("column index out of range")
        return self._items[index]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Column({list(self)!r})"


class _Lineage:
    """Storage shared by a partition and the partitions appended from it:
    the entry columns, and the ranking arrays with room to grow. Only the
    partition that ends where the storage ends may append in place; any
    other (an older one written again) copies."""

    __slots__ = ("arrays", "findings", "lock", "memories", "size", "terms", "tokens")

    def __init__(
        self,
        memories: list[Memory],
        findings: list[str | None],
        tokens: list[int],
        arrays: tuple[npt.NDArray[Any], ...],
    ) -> None:
        self.lock = threading.Lock()
        self.memories, self.findings, self.tokens = memories, findings, tokens
        self.arrays = arrays
        self.size = len(memories)
        # term -> (indices buffer, weights buffer, filled): postings that
        # grow in place the same way, made on a term's first append.
        self.terms: dict[str, tuple[IntArray, FloatArray, int]] = {}

    def append(self, size: int, memory: Memory, finding: str | None, tokens: int) -> _Lineage:
        """Storage holding the first `size` entries and then this one."""
        row = (memory.confidence, memory.updated_at.timestamp(), memory.seq)
        with self.lock:
            if self.size == size:
                if size == len(self.arrays[0]):
                    # Doubling keeps appends amortised O(1); partitions
                    # holding views of the old buffers keep them.
                    self.arrays = tuple(
                        np.concatenate([a[:size], np.empty(max(size, 8), dtype=a.dtype)])
                        for a in self.arrays
                    )
                for array, value in zip(self.arrays, row, strict=True):
                    array[size] = value
                self.memories.append(memory)
                self.findings.append(finding)
                self.tokens.append(tokens)
                self.size = size + 1
                return self
            arrays = tuple(
                np.append(a[:size], value) for a, value in zip(self.arrays, row, strict=True)
            )
            return _Lineage(
                [*self.memories[:size], memory],
                [*self.findings[:size], finding],
                [*self.tokens[:size], tokens],
                arrays,
            )

    def grow_postings(
        self,
        postings: dict[str, tuple[IntArray, FloatArray]],
        weights: TermWeights,
        index: int,
    ) -> None:
        """Add entry `index` to each weighted term's postings (a copy of the
        partition's dict, changed here). Call on the lineage `append` just
        returned: a term's buffer is written past the end of every view of
        it, as the columns are, so a common term (every entry's year) costs
        O(1), not a copy of its postings."""
        with self.lock:
            for term, weight in weights:
                indices, values = postings.get(term, (_NO_INDICES, _NO_WEIGHTS))
                n = len(indices)
                held = self.terms.get(term)
                if held is not None and held[2] == n and indices.base is held[0]:
                    idx, val, _ = held
                    if n == len(idx):
                        idx = np.concatenate([idx, np.empty(n, dtype=idx.dtype)])
                        val = np.concatenate([val, np.empty(n, dtype=val.dtype)])
                else:
                    idx = np.empty(max(4, 2 * (n + 1)), dtype=np.int64)
                    val = np.empty(len(idx), dtype=np.float64)
                    idx[:n], val[:n] = indices, values
                idx[n], val[n] = index, weight
                self.terms[term] = (idx, val, n + 1)
                postings[term] = (idx[: n + 1], val[: n + 1])


@dataclass(frozen=True, slots=True, eq=False)
class Partition:
    """One owner's entries of one tier, as of one generation, with its index.

    Per entry, in insertion order: the memory, what the content scanner
    found in it (or None) and its token count, computed once. `postings`
    maps a term to (entry indices, weights) arrays, indices ascending;
    `confidence`, `recency` and `seq` are per-entry arrays for ranking.
    Nothing per entry is kept beyond that: an entry's terms are recomputed
    from its text when it changes.
    """

    tier: Tier
    owner: str
    generation: int
    memories: Sequence[Memory]
    usage: Usage
    findings: Sequence[str | None] = field(repr=False)
    tokens: Sequence[int] = field(repr=False)
    postings: dict[str, tuple[IntArray, FloatArray]] = field(repr=False)
    confidence: FloatArray = field(repr=False)
    recency: FloatArray = field(repr=False)
    seq: IntArray = field(repr=False)
    # id -> finding, for the few entries the scanner flagged.
    flagged: dict[str, str] = field(repr=False)
    # How many (term, entry) pairs `postings` holds, kept up to date so the
    # size estimate costs nothing.
    npostings: int = field(default=0, repr=False)
    # Where the columns above live, when appends may share it (see Column).
    lineage: _Lineage | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """About how much memory the partition holds (measured with
        tracemalloc on the bench corpus; within 10%): per entry, per
        character, per posting and per distinct term."""
        return (
            _ENTRY_BYTES * len(self.memories)
            + self.usage.used_chars
            + _POSTING_BYTES * self.npostings
            + _TERM_BYTES * len(self.postings)
        )

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
        if not memories:
            # Most tiers of most agents are empty: they share every column
            # (nothing ever writes into one in place) and, when it is nil,
            # their usage, so an empty partition costs one small object.
            usage = _NO_USAGE if usage == _NO_USAGE else usage
            return cls(
                tier, owner, generation, (), usage, (), (), _NO_POSTINGS,
                _NO_WEIGHTS, _NO_WEIGHTS, _NO_INDICES, _NO_FLAGS,
            )  # fmt: skip
        lists: dict[str, tuple[list[int], list[float]]] = {}
        for index, memory in enumerate(memories):
            for term, weight in term_weights(memory):
                indices, values = lists.setdefault(term, ([], []))
                indices.append(index)
                values.append(weight)
        postings = {
            term: (np.array(indices, dtype=np.int64), np.array(values, dtype=np.float64))
            for term, (indices, values) in lists.items()
        }
        findings = [scan(m) for m in memories]
        lineage = _Lineage(
            list(memories),
            findings,
            [count_tokens(m.content) for m in memories],
            (
                np.array([m.confidence for m in memories], dtype=np.float64),
                np.array([m.updated_at.timestamp() for m in memories], dtype=np.float64),
                np.array([m.seq for m in memories], dtype=np.int64),
            ),
        )
        confidence, recency, seq = lineage.arrays
        return cls(
            tier,
            owner,
            generation,
            Column(lineage.memories),
            usage,
            Column(lineage.findings),
            Column(lineage.tokens),
            postings,
            confidence,
            recency,
            seq,
            {m.id: f for m, f in zip(memories, findings, strict=True) if f},
            sum(len(indices) for indices, _ in postings.values()),
            lineage,
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
        # Copy on write: only the touched terms' postings are new arrays, and
        # the columns grow in place past this partition's end; readers of
        # this partition keep seeing it unchanged.
        postings = dict(self.postings)
        weights = term_weights(memory)
        finding = scan(memory)
        lineage = self.lineage or _Lineage(
            list(self.memories),
            list(self.findings),
            list(self.tokens),
            (self.confidence, self.recency, self.seq),
        )
        lineage = lineage.append(index, memory, finding, count_tokens(memory.content))
        lineage.grow_postings(postings, weights, index)
        size = index + 1
        confidence, recency, seq = (a[:size] for a in lineage.arrays)
        return Partition(
            self.tier,
            self.owner,
            generation,
            Column(lineage.memories, size),
            usage,
            Column(lineage.findings, size),
            Column(lineage.tokens, size),
            postings,
            confidence,
            recency,
            seq,
            {**self.flagged, memory.id: finding} if finding else self.flagged,
            self.npostings + len(weights),
            lineage,
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
        """This partition with one entry replaced in place (or removed, with None).

        Only the old and new entry are tokenised; the other entries' postings
        are untouched, except that a removal shifts the indices after it.
        """
        position = next(i for i, m in enumerate(self.memories) if m.id == memory_id)
        old = self.memories[position]
        postings = dict(self.postings)
        removed = term_weights(old)
        npostings = self.npostings - len(removed)
        for term, _weight in removed:
            indices, values = postings[term]
            keep = indices != position
            if keep.any():
                postings[term] = (indices[keep], values[keep])
            else:
                del postings[term]
        memories, findings, tokens = list(self.memories), list(self.findings), list(self.tokens)
        flagged = {k: v for k, v in self.flagged.items() if k != memory_id}
        if replacement is None:
            for column in (memories, findings, tokens):
                del column[position]
            postings = {
                term: (np.where(indices > position, indices - 1, indices), values)
                for term, (indices, values) in postings.items()
            }
            confidence = np.delete(self.confidence, position)
            recency = np.delete(self.recency, position)
            seq = np.delete(self.seq, position)
        else:
            added = term_weights(replacement)
            npostings += len(added)
            for term, weight in added:
                indices, values = postings.get(term, (_NO_INDICES, _NO_WEIGHTS))
                at = int(np.searchsorted(indices, position))
                postings[term] = (np.insert(indices, at, position), np.insert(values, at, weight))
            finding = scan(replacement)
            memories[position] = replacement
            findings[position] = finding
            tokens[position] = count_tokens(replacement.content)
            if finding:
                flagged[replacement.id] = finding
            confidence, recency, seq = self.confidence.copy(), self.recency.copy(), self.seq
            confidence[position] = replacement.confidence
            recency[position] = replacement.updated_at.timestamp()
        # A fresh lineage: later appends grow it, not the one this partition
        # shares (seq may still be a view of it; a lineage whose arrays are
        # full reallocates before writing, so that view is never written).
        lineage = _Lineage(memories, findings, tokens, (confidence, recency, seq))
        return Partition(
            self.tier,
            self.owner,
            generation,
            Column(memories),
            usage,
            Column(findings),
            Column(tokens),
            postings,
            confidence,
            recency,
            seq,
            flagged,
            npostings,
            lineage,
        )

    def by_confidence(self) -> IntArray:
        """Entry indices: highest confidence, then most recently updated, then oldest."""
        return np.lexsort((self.seq, -self.recency, -self.confidence))

    # --- what rank() reads (CompactPartition answers the same) -------------

    @property
    def count(self) -> int:
        """Entries held."""
        return len(self.memories)

    @property
    def size(self) -> int:
        """Positions in the per-entry arrays (every one holds an entry)."""
        return len(self.memories)

    def alive(self) -> BoolArray | None:
        return None

    def category_mask(self, category: str) -> BoolArray:
        return np.array([m.category == category for m in self.memories], dtype=bool)

    def term(self, term: str) -> Postings | None:
        found = self.postings.get(term)
        return None if found is None else Postings(*found)

    def fetch(self, positions: Sequence[int]) -> list[Memory | None]:
        return [self.memories[p] for p in positions]


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
    """A partition as rank() sees it: a Partition or a compact.CompactPartition."""

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
    (tests/test_ranking.py); `vectorized` forces one for those tests. Compact
    partitions are always scored in arrays, and only the entries returned
    are read (from the database); an entry removed in between is left out.

    With a limit, from PRUNE_FROM entries on (or with `prune`), entries that
    cannot place are skipped without being scored (_pruned): a query word
    held by most of a million entries then costs little. The answer is the
    same, to the bit (tests/test_ranking.py).

    With `semantic` (sidecar.semantic), similarity blends BM25 with each
    entry's cosine to the query, and an entry matching no keyword matches
    when its cosine reaches the floor. match_all ignores it: all keywords
    must then match, as without; so does a query without keywords (only
    stop words), which ranks everything by confidence, as without.
    """
    if match_all or not keywords:
        semantic = None
    plain = [p for p in partitions if isinstance(p, Partition)]
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
    offsets = [0]
    for p in partitions:
        offsets.append(offsets[-1] + p.size)
    total = offsets[-1]
    live = sum(p.count for p in partitions)
    if not live:
        return []
    confidence = _joined([p.confidence for p in partitions])
    seq = _joined([p.seq for p in partitions])
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

    # Rank deep enough that `limit` remain once `leave_out` is left out.
    deeper = None if limit is None else limit + len(leave_out)

    def kept(ordered: Iterable[int]) -> list[int]:
        found = [k for k in ordered if int(seq[k]) not in leave_out] if leave_out else ordered
        return [int(k) for k in found][:limit]

    if not keywords and semantic is None:
        recency = _joined([p.recency for p in partitions])
        if deeper is None:
            order = np.lexsort((seq, -recency, -confidence))
            chosen = order if keep is None else order[keep[order]]
            positions = kept(chosen.tolist())
        else:
            positions = kept(top_by_confidence(confidence, recency, seq, keep, deeper))
        return _fetched(partitions, offsets, positions, [float(confidence[k]) for k in positions])

    unique = list(dict.fromkeys(keywords))
    postings: list[_Postings] = []
    for term in unique:
        found = [(pi, got) for pi, p in enumerate(partitions) if (got := p.term(term)) is not None]
        df = sum(len(got.positions) for _, got in found)
        postings.append(_Postings(math.log(1 + (live - df + 0.5) / (df + 0.5)), found, df))
    if prune is None:
        prune = total >= PRUNE_FROM
    pruned = None
    if prune and semantic is None and not match_all and deeper is not None:
        pruned = _pruned(postings, offsets, keep, confidence, weights, deeper)
    if pruned is not None:
        candidates, scores = pruned
    else:
        bm25 = np.zeros(total, dtype=np.float64)
        # Counted only for match_all: any match leaves a positive score (every
        # idf and every weight is), so bm25 > 0 says which entries matched.
        matched = np.zeros(total, dtype=np.int32) if match_all else None
        for term_postings in postings:
            for pi, got in term_postings.found:
                at = got.positions + offsets[pi] if offsets[pi] else got.positions
                # A term lists an entry at most once: plain fancy indexing adds safely.
                bm25[at] += term_postings.idf * got.all()
                if matched is not None:
                    matched[at] += 1
        hit = bm25 > 0 if matched is None else matched >= len(unique)
        if semantic is not None:
            hit |= semantic.cosines >= semantic.floor
        if keep is not None:
            hit &= keep
        candidates = np.nonzero(hit)[0]
        scores = bm25[candidates]
    if not len(candidates):
        return []
    best = float(scores.max())
    similarity = scores / best if best > 0 else scores
    if semantic is not None:
        similarity = (1 - semantic.weight) * similarity + semantic.weight * spread(
            semantic.cosines[candidates]
        )
    blended = weights.similarity * similarity + weights.confidence * (confidence[candidates])
    if deeper is not None and len(candidates) > deeper:
        # Everything scoring at least the deeper-th best, ties included, then
        # the exact order (score, then insertion) on that small set.
        threshold = np.partition(blended, len(blended) - deeper)[len(blended) - deeper]
        near = blended >= threshold
        candidates, blended = candidates[near], blended[near]
    order = np.lexsort((seq[candidates], -blended))
    if deeper is not None:
        order = order[:deeper]
    score = dict(zip(candidates[order].tolist(), blended[order].tolist(), strict=True))
    positions = kept(candidates[order].tolist())
    return _fetched(partitions, offsets, positions, [score[k] for k in positions])


class _Postings(NamedTuple):
    """One query term: its idf, its postings in each partition holding it,
    and how many entries hold it."""

    idf: float
    found: list[tuple[int, Postings]]
    df: int


# What a bound must fall short by before it rules an entry out: the scores
# it bounds add the same floats in another order (last-bit differences).
_MARGIN = 1e-9


def _pruned(
    postings: Sequence[_Postings],
    offsets: list[int],
    keep: BoolArray | None,
    confidence: FloatArray,
    weights: Weights,
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
    total = offsets[-1]
    # Past this many candidates, scoring them all densely costs less.
    budget = (sum(term.df for term in postings) + total * ENTRY_COST) / (
        LOOKUP_COST * len(postings)
    )
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
        # This term's entries (partitions in order: ascending), less those
        # holding a rarer one (already scored).
        fresh = _joined(
            [
                got.positions + offsets[pi] if offsets[pi] else got.positions
                for pi, got in postings[i].found
            ]
            or [_NO_INDICES]
        ).astype(np.int64, copy=False)
        for j in by_df[: split - 1]:
            fresh = fresh[~_holding(fresh, postings[j], offsets)]
        if keep is not None:
            fresh = fresh[keep[fresh]]
        found.append(fresh)
        scored.append(_scores(fresh, postings, offsets))
        rest = sum(ceilings[j] for j in by_df[split:])
        candidates, scores = np.concatenate(found), np.concatenate(scored)
        if not rest:
            # Every term was read: these are all the matches there are.
            return candidates, scores
        if len(candidates) < deeper:
            continue
        best = float(scores.max())
        # rank()'s blend, as it will compute it for these candidates.
        blended = (
            weights.similarity * (scores / best) + weights.confidence * (confidence[candidates])
        )
        threshold = float(np.partition(blended, len(blended) - deeper)[len(blended) - deeper])
        if top_confidence is None:
            top_confidence = float(confidence.max())
        bound = weights.similarity * (rest / best) + weights.confidence * top_confidence
        if bound + _MARGIN < threshold:
            return candidates, scores
    return None


def _located(
    positions: IntArray, term: _Postings, offsets: list[int]
) -> Iterator[tuple[int, int, Postings, IntArray, BoolArray]]:
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


def _holding(positions: IntArray, term: _Postings, offsets: list[int]) -> BoolArray:
    """Which of these positions (ascending) hold the term."""
    holding = np.zeros(len(positions), dtype=bool)
    for lo, hi, _, _, hit in _located(positions, term, offsets):
        holding[lo:hi] = hit
    return holding


def _scores(positions: IntArray, postings: Sequence[_Postings], offsets: list[int]) -> FloatArray:
    """The BM25 scores of these positions (ascending): the same floats rank()
    adds, in the same order, so the same sums to the bit."""
    scores = np.zeros(len(positions), dtype=np.float64)
    for term in postings:
        for lo, hi, got, at, hit in _located(positions, term, offsets):
            part = scores[lo:hi]
            part[hit] += term.idf * got.at(at[hit])
    return scores


def _joined(arrays: Sequence[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    """The arrays end to end; no copy when only one holds anything (a large
    tier beside an empty one)."""
    filled = [a for a in arrays if len(a)]
    if len(filled) == 1:
        return filled[0]
    return np.concatenate(arrays)


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
    partitions: Sequence[Partition], term: str, total: int
) -> tuple[float, list[tuple[int, tuple[IntArray, FloatArray]]]]:
    """A query term's idf over all entries, and its postings per partition."""
    found = [(pi, p.postings[term]) for pi, p in enumerate(partitions) if term in p.postings]
    df = sum(len(indices) for _, (indices, _) in found)
    return math.log(1 + (total - df + 0.5) / (df + 0.5)), found


def _rank_python(
    partitions: Sequence[Partition],
    keywords: Sequence[str],
    weights: Weights,
    match_all: bool,
    category: str,
    limit: int | None,
) -> list[tuple[Memory, float]]:
    pool = [m for p in partitions for m in p.memories]
    if not keywords:
        chosen = sorted(
            (m for m in pool if not category or m.category == category),
            key=lambda m: (-m.confidence, -m.updated_at.timestamp(), m.seq),
        )
        return [(m, m.confidence) for m in (chosen if limit is None else chosen[:limit])]
    unique = list(dict.fromkeys(keywords))
    total = len(pool)
    offsets = [0]
    for p in partitions:
        offsets.append(offsets[-1] + len(p.memories))
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
    hits = [
        k
        for k, n in matched.items()
        if n >= needed and (not category or pool[k].category == category)
    ]
    if not hits:
        return []
    best = max(bm25[k] for k in hits)
    blended = [
        (pool[k], weights.similarity * (bm25[k] / best) + weights.confidence * pool[k].confidence)
        for k in hits
    ]
    blended.sort(key=lambda hit: (-hit[1], hit[0].seq))
    return blended if limit is None else blended[:limit]


_NO_INDICES: IntArray = np.array([], dtype=np.int64)
_NO_WEIGHTS: FloatArray = np.array([], dtype=np.float64)
for _empty in (_NO_INDICES, _NO_WEIGHTS):
    _empty.flags.writeable = False
# Shared by every empty partition: never written (every change copies).
_NO_POSTINGS: dict[str, tuple[IntArray, FloatArray]] = {}
_NO_FLAGS: dict[str, str] = {}
_NO_USAGE = Usage()
