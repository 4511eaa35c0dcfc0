"""The full partition: one tier of one owner held in memory, its entries
and their keyword index, and the BM25 term weights that index holds.

An entry's term weights are BM25's, tf * (k1 + 1) / (tf + k1 * norm).
Length normalisation, when on (B > 0), uses a fixed reference length
(REFERENCE_LENGTH terms) instead of the corpus average, so an entry's term
weights never depend on other entries: a write updates the index by one
entry instead of re-weighting all of them, and the same store always ranks
the same way whatever its history. It is off (B = 0, see below).

A `Partition` is one tier of one owner, indexed once and shared read-only by
every search, snapshot and session that needs it. rank() (sidecar.retrieval.ranking)
reads it as it reads a compact partition.

Owns: the BM25 term weights (K1, B, REFERENCE_LENGTH, term_weights) and the
date terms an entry is indexed by, the full partition's columns and
postings, their copy-on-write updates (added, changed) and the storage
successive partitions share. Must not touch: blending or ordering scores
(ranking), the database or the partition cache (sidecar.domain.partition
hands it the memories and keeps it), scanning or counting tokens (it calls
the `scan` and `count_tokens` it is handed), gRPC.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

from sidecar.core.memory import Memory, Tier, Usage
from sidecar.retrieval.keywords import MONTHS, month_term, text_terms
from sidecar.retrieval.ranking import BoolArray, FloatArray, IntArray, Listed, Postings

K1 = 1.2
# No length normalisation: on the relevance sets in bench/relevance/ every
# b > 0 found fewer answers (tuning sets 85.0% at b 0, 78.8% at 0.75; k1
# made no difference at b 0). Memories are short, and a longer one is not
# less about each word it holds. `python -m bench.retrieval --grid`.
B = 0.0
REFERENCE_LENGTH = 16

TermWeights = tuple[tuple[str, float], ...]


def date_terms(moment: datetime) -> list[str]:
    """The year and the month of that year an entry was written, as index
    terms ("2023", "july2023"): "what happened in July 2023" finds what was
    noted then, and "may" alone matches no entry's date."""
    return [str(moment.year), month_term(MONTHS[moment.month - 1], str(moment.year))]


def term_weights(memory: Memory) -> TermWeights:
    """An entry's BM25 term weights, over its content's terms and the month
    and year it was created: tf * (k1 + 1) / (tf + k1 * (1 - b + b * len / ref))."""
    counts = Counter(text_terms(memory.content))
    counts.update(date_terms(memory.created_at))
    norm = K1 * (1 - B + B * sum(counts.values()) / REFERENCE_LENGTH)
    return tuple((term, tf * (K1 + 1) / (tf + norm)) for term, tf in counts.items())


def earliest_expiry(memories: Sequence[Memory]) -> float:
    """When the first of these entries expires (a POSIX time; inf: never)."""
    return min((m.expires_at.timestamp() for m in memories if m.expires_at), default=math.inf)


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
        held_terms = self.terms
        with self.lock:
            for term, weight in weights:
                found = postings.get(term)
                held = held_terms.get(term)
                if found is None:
                    # A term new to the partition: nothing to copy.
                    n = 0
                    idx = np.empty(4, dtype=np.int64)
                    val = np.empty(4, dtype=np.float64)
                else:
                    indices, values = found
                    n = len(indices)
                    if held is not None and held[2] == n and indices.base is held[0]:
                        idx, val, _ = held
                        if n == len(idx):
                            idx = np.concatenate([idx, np.empty(n, dtype=idx.dtype)])
                            val = np.concatenate([val, np.empty(n, dtype=val.dtype)])
                    else:
                        idx = np.empty(2 * (n + 1), dtype=np.int64)
                        val = np.empty(len(idx), dtype=np.float64)
                        idx[:n], val[:n] = indices, values
                idx[n], val[n] = index, weight
                held_terms[term] = (idx, val, n + 1)
                postings[term] = (idx[: n + 1], val[: n + 1])


@dataclass(frozen=True, slots=True, eq=False)
class Partition(Listed):
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
    # When its first entry expires (a POSIX time; inf: none will): it is
    # then no longer current (sidecar.domain.partition) and loads without it.
    expires: float = field(default=math.inf, repr=False)
    # The latest expiry of the entries it was loaded without, as expired but
    # not removed yet (a POSIX time; -inf: none): a clock set back before it
    # would show them again, so it is not current then either.
    hidden: float = field(default=-math.inf, repr=False)

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
        hidden: float = -math.inf,
    ) -> Partition:
        """A partition of these entries (in insertion order), indexed, each
        scanned and its tokens counted once; `hidden`: see the field."""
        if not memories:
            return cls._empty(tier, owner, generation, usage, hidden)
        postings = _postings_of(memories)
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
        return cls._over_lineage(
            tier,
            owner,
            generation,
            usage,
            lineage,
            postings,
            {m.id: f for m, f in zip(memories, findings, strict=True) if f},
            sum(len(indices) for indices, _ in postings.values()),
            hidden,
        )

    @classmethod
    def _empty(
        cls, tier: Tier, owner: str, generation: int, usage: Usage, hidden: float = -math.inf
    ) -> Partition:
        """A partition without entries. Most tiers of most agents are empty:
        they share every column (nothing ever writes into one in place) and,
        when it is nil, their usage, so an empty partition costs one small
        object."""
        usage = _NO_USAGE if usage == _NO_USAGE else usage
        return cls(
            tier,
            owner,
            generation,
            (),
            usage,
            (),
            (),
            _NO_POSTINGS,
            _NO_WEIGHTS,
            _NO_WEIGHTS,
            _NO_INDICES,
            _NO_FLAGS,
            hidden=hidden,
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
            min(self.expires, earliest_expiry([memory])),
            self.hidden,
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
        removed = term_weights(self.memories[position])
        postings = _without_entry(self.postings, removed, position)
        npostings = self.npostings - len(removed)
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
            _add_entry(postings, added, position)
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
        return self._over_lineage(
            self.tier,
            self.owner,
            generation,
            usage,
            lineage,
            postings,
            flagged,
            npostings,
            self.hidden,
        )

    @classmethod
    def _over_lineage(
        cls,
        tier: Tier,
        owner: str,
        generation: int,
        usage: Usage,
        lineage: _Lineage,
        postings: dict[str, tuple[IntArray, FloatArray]],
        flagged: dict[str, str],
        npostings: int,
        hidden: float,
    ) -> Partition:
        """A partition over all of a lineage of its own (no other partition
        appends to it): a fresh build, or an entry changed in place."""
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
            flagged,
            npostings,
            lineage,
            earliest_expiry(lineage.memories),
            hidden,
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


def _postings_of(memories: Sequence[Memory]) -> dict[str, tuple[IntArray, FloatArray]]:
    """The keyword index of these entries: term -> (entry indices ascending,
    their weights)."""
    lists: dict[str, tuple[list[int], list[float]]] = {}
    for index, memory in enumerate(memories):
        for term, weight in term_weights(memory):
            indices, values = lists.setdefault(term, ([], []))
            indices.append(index)
            values.append(weight)
    return {
        term: (np.array(indices, dtype=np.int64), np.array(values, dtype=np.float64))
        for term, (indices, values) in lists.items()
    }


def _without_entry(
    postings: dict[str, tuple[IntArray, FloatArray]], weights: TermWeights, position: int
) -> dict[str, tuple[IntArray, FloatArray]]:
    """A copy of these postings without the entry at `position` (whose term
    weights these are): a term it alone held is gone."""
    postings = dict(postings)
    for term, _weight in weights:
        indices, values = postings[term]
        keep = indices != position
        if keep.any():
            postings[term] = (indices[keep], values[keep])
        else:
            del postings[term]
    return postings


def _add_entry(
    postings: dict[str, tuple[IntArray, FloatArray]], weights: TermWeights, position: int
) -> None:
    """Put the entry at `position` (with these term weights) into these
    postings, in index order: each term's arrays are new, never written."""
    for term, weight in weights:
        indices, values = postings.get(term, (_NO_INDICES, _NO_WEIGHTS))
        at = int(np.searchsorted(indices, position))
        postings[term] = (np.insert(indices, at, position), np.insert(values, at, weight))


_NO_INDICES: IntArray = np.array([], dtype=np.int64)
_NO_WEIGHTS: FloatArray = np.array([], dtype=np.float64)
for _empty in (_NO_INDICES, _NO_WEIGHTS):
    _empty.flags.writeable = False
# Shared by every empty partition: never written (every change copies).
_NO_POSTINGS: dict[str, tuple[IntArray, FloatArray]] = {}
_NO_FLAGS: dict[str, str] = {}
_NO_USAGE = Usage()
