"""Large tiers: an index kept in flat arrays, entries read back from the database.

A tier with many entries (server.compact_tier_entries, 20,000 by default) is
not held as Memory objects. What ranking needs stays in memory, compactly:
per entry its seq, confidence, recency and category; per term the entries
that hold it and how often (int32 positions, uint16 counts). The few entries
a search, a turn or a frozen block actually returns are read from the
database by seq. About 30 bytes per entry and 6 per (term, entry) pair,
where a `partition.Partition` holds about 400 per entry and 16 per pair.

Ranking is the same as a Partition's, to the bit (tests/retrieval/test_compact.py):
with length normalisation off (partition.B == 0) a term's BM25 weight depends
only on its count in the entry, so the weight table below holds exactly
the floats `partition.term_weights` computes, and rank() adds them up in the
same order.

Like Partitions, successive CompactPartitions of a tier share storage: the
newest one appends in place past the end every older one sees. A removal
is a tombstone (the generation that removed the entry), so older ones
still see the entry; an update is a tombstone plus an appended entry with
the same seq (seq orders ties, so its rank is unchanged). Postings are one
base segment (CSR: a term's rows are offsets[id]:offsets[id + 1]) built at
load, plus per-term arrays for what was appended since: a word's first
few appended postings as tuples (one allocation-light step per add, and
immutable, so a reader needs no lock), then numpy buffers with room to grow.

The index is persisted (sidecar.retrieval.index_format; the engine decides when):
the entries in seq order and a fresh base segment, as of one generation,
and a load replays the writes logged since.

Owns: the compact layout (Storage's per-entry arrays, the Vocabulary of
hashed words, the base segment and what was appended since, tombstones),
the term counts an entry is indexed by, WEIGHTS (a count's BM25 weight),
and appending to and removing from the shared storage. Must not touch: the
database (a partition's rows come from the `scan` and `fetch_rows` it is
given; of the storage layer it uses only Record), the
persisted form (sidecar.retrieval.index_format), when to load or persist
(its callers decide), or ranking: rank() (sidecar.retrieval.ranking)
reads it as it reads a full partition.
"""

from __future__ import annotations

import array
import functools
import hashlib
import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from sidecar.core.clock import from_micros, to_micros
from sidecar.core.memory import Memory, Tier, Usage
from sidecar.retrieval.keywords import text_terms
from sidecar.retrieval.partition import K1, B, date_terms
from sidecar.retrieval.ranking import Postings, top_by_confidence
from sidecar.storage._statements import Record

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
CountArray = npt.NDArray[np.uint16]
BoolArray = npt.NDArray[np.bool_]

# Counts above this are kept as this (an entry would need 65,535 copies of
# one word: 8,192 characters is the default content limit).
MAX_COUNT = np.iinfo(np.uint16).max
if B:  # pragma: no cover - a guard for whoever turns normalisation on
    raise ImportError("compact tiers store term counts: they need partition.B == 0")
# partition.term_weights' expression, with its norm at b = 0.
_NORM = K1 * (1 - B + B * 0)
WEIGHTS: FloatArray = np.array(
    [0.0, *(tf * (K1 + 1) / (tf + _NORM) for tf in range(1, MAX_COUNT + 1))], dtype=np.float64
)
ALIVE = np.iinfo(np.int64).max
# A word appended since the base segment: its dict slot, its string, two
# small arrays and their tuple.
_APPENDED_TERM_BYTES = 400
# A word's first appended postings are tuples up to this many (most words
# appended since the base segment never get more: an id, a uuid's parts),
# then numpy buffers twice as long. Tuples cost an add no numpy allocation;
# the weight kept (appended_bytes) counts them as the buffers they replace.
_SMALL = 8
_FIRST_CAPACITY = 4
_MICROS_PER_DAY = 86_400_000_000

# A word's appended postings: (positions, counts) tuples while few, else
# (positions, counts, filled): buffers of which the first `filled` are set.
Held = tuple[tuple[int, ...], tuple[int, ...]] | tuple[Int32Array, CountArray, int]

Fetch = Callable[[Tier, str, Sequence[int]], list[Memory]]
# A slot of Storage's per-entry columns: seq, confidence, recency, category
# and removed_at.
_COLUMN_BYTES = sum(
    np.dtype(t).itemsize for t in (np.int64, np.float64, np.float64, np.int32, np.int64)
)


def term_counts(content: str, created_micros: int) -> dict[str, int]:
    """An entry's terms and how often each occurs (partition.term_weights'
    counts, in the same order: the content's terms first seen first, then
    its date's)."""
    counts: dict[str, int] = {}
    get = counts.get
    for term in text_terms(content):
        counts[term] = get(term, 0) + 1
    # A UTC day lies in one month: its date terms are looked up, not formatted.
    for term in _day_terms(created_micros // _MICROS_PER_DAY):
        counts[term] = get(term, 0) + 1
    return counts


@functools.lru_cache(maxsize=1024)
def _day_terms(day: int) -> tuple[str, ...]:
    """The date terms of entries created on this day (days since the epoch, UTC)."""
    return tuple(date_terms(from_micros(day * _MICROS_PER_DAY)))


def held_postings(held: Held, size: int) -> tuple[Int32Array, CountArray]:
    """A word's appended postings below position `size`, as arrays."""
    if len(held) == 2:
        positions, tally = held
        visible = bisect_left(positions, size)
        return (
            np.array(positions[:visible], dtype=np.int32),
            np.array(tally[:visible], dtype=np.uint16),
        )
    buffer, tallies, filled = held
    visible = int(np.searchsorted(buffer[:filled], size))
    return buffer[:visible], tallies[:visible]


def word_hash(word: str) -> int:
    """A word's 64-bit hash, the same in every process (str's hash is not)."""
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), signed=True)


class Vocabulary:
    """The base segment's words, about 30 bytes each where a dict of str to
    int holds about 120: their 64-bit hashes sorted, and the words' UTF-8
    text end to end, to tell a word from another with the same hash. A
    word's id is its place in that order."""

    __slots__ = ("bounds", "hashes", "text")

    def __init__(self, hashes: Int64Array, bounds: Int64Array, text: bytes) -> None:
        self.hashes, self.bounds, self.text = hashes, bounds, text

    @classmethod
    def sorted(cls, words: Sequence[str]) -> tuple[Vocabulary, Int64Array]:
        """A Vocabulary of these words, and where it puts them: the i-th word
        of the Vocabulary is words[order[i]]. Each word is hashed once."""
        hashes = np.array([word_hash(w) for w in words], dtype=np.int64)
        order: Int64Array = np.argsort(hashes, kind="stable")
        encoded = [words[i].encode() for i in order.tolist()]
        bounds: Int64Array = np.zeros(len(words) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=bounds[1:])
        return cls(hashes[order], bounds, b"".join(encoded)), order

    def words(self) -> list[str]:
        text, bounds = self.text, self.bounds.tolist()
        return [text[bounds[i] : bounds[i + 1]].decode() for i in range(len(self.hashes))]

    def get(self, word: str) -> int | None:
        wanted = word_hash(word)
        at = int(np.searchsorted(self.hashes, wanted))
        encoded = word.encode()
        while at < len(self.hashes) and self.hashes[at] == wanted:
            if self.text[self.bounds[at] : self.bounds[at + 1]] == encoded:
                return at
            at += 1
        return None

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        return self.hashes.nbytes + self.bounds.nbytes + len(self.text)


class Storage:
    """What one tier's successive compact partitions share."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.size = 0
        self.generation = 0
        # Per entry: seq, confidence, recency (updated_at in seconds, as
        # Partition keeps it), category id, and the generation that removed
        # it (ALIVE while it is there). Buffers with room to grow.
        self.seq: Int64Array = np.empty(0, dtype=np.int64)
        self.confidence: FloatArray = np.empty(0, dtype=np.float64)
        self.recency: FloatArray = np.empty(0, dtype=np.float64)
        self.category: Int32Array = np.empty(0, dtype=np.int32)
        self.removed_at: Int64Array = np.empty(0, dtype=np.int64)
        self.removals = 0
        self.categories: dict[str, int] = {"": 0}
        # The base segment.
        self.vocabulary, _ = Vocabulary.sorted(())
        # The persisted index this storage started from or last saved (its
        # generation; 0: none), and how many writes it had applied then.
        self.indexed = 0
        self.indexed_ops = 0
        # When a first index could not be saved (see MemoryEngine._index).
        self.refused_at = float("-inf")
        self.offsets: Int64Array = np.zeros(1, dtype=np.int64)
        self.positions: Int32Array = np.empty(0, dtype=np.int32)
        self.counts: CountArray = np.empty(0, dtype=np.uint16)
        # Appended since: term -> its postings (Held).
        self.appended: dict[str, Held] = {}
        # What `appended` holds, kept up to date (the cache weighs every write).
        self.appended_bytes = 0
        self.npostings = 0

    def _columns(self) -> tuple[npt.NDArray[Any], ...]:
        return (self.seq, self.confidence, self.recency, self.category, self.removed_at)

    def grow(self, needed: int) -> None:
        """Room for `needed` entries (doubling; views of the old buffers stay valid)."""
        capacity = len(self.seq)
        if needed <= capacity:
            return
        capacity = max(needed, 2 * capacity, 1024)
        grown = []
        for column in self._columns():
            bigger = np.empty(capacity, dtype=column.dtype)
            bigger[: self.size] = column[: self.size]
            grown.append(bigger)
        self.seq, self.confidence, self.recency, self.category, self.removed_at = grown

    def category_id(self, category: str) -> int:
        found = self.categories.get(category)
        if found is None:
            found = self.categories[category] = len(self.categories)
        return found

    def put(self, position: int, record: Record) -> None:
        self._place(position, record.seq, record.confidence, record.updated_at, record.category)

    def _place(
        self, position: int, seq: int, confidence: float, updated_at: int, category: str
    ) -> None:
        self.seq[position] = seq
        self.confidence[position] = confidence
        self.recency[position] = updated_at / 1_000_000
        self.category[position] = self.category_id(category)
        self.removed_at[position] = ALIVE

    def append(self, position: int, memory: Memory) -> None:
        """Put a new entry at `position` (there is room) and index it: what
        put and append_postings do with its record (record_of), with its
        times converted once when they are the same (a new entry's are)."""
        created = to_micros(memory.created_at)
        updated = created if memory.updated_at == memory.created_at else None
        if updated is None:
            updated = to_micros(memory.updated_at)
        self._place(position, memory.seq, memory.confidence, updated, memory.category)
        self.append_postings(position, term_counts(memory.content, created))

    def append_postings(self, position: int, counts: Mapping[str, int]) -> None:
        appended = self.appended
        grown = 0
        for term, count in counts.items():
            if count > MAX_COUNT:
                count = MAX_COUNT
            held = appended.get(term)
            # Each case makes one assignment: a reader sees the old postings
            # or the new ones, and never a buffer slot change below the
            # `filled` it was handed (tuples never change).
            if held is None:
                appended[term] = ((position,), (count,))
                grown += _APPENDED_TERM_BYTES
                continue
            if len(held) == 2:
                positions, tally = held
                filled = len(positions)
                if filled < _SMALL:
                    if filled == _FIRST_CAPACITY:
                        grown += filled * 6  # the first buffers it stands for doubled
                    appended[term] = ((*positions, position), (*tally, count))
                else:
                    appended[term] = _buffers(positions, tally, position, count)
                    grown += filled * 6
                continue
            buffer, tallies, filled = held
            if filled == len(buffer):
                buffer = np.concatenate([buffer, np.empty(filled, dtype=np.int32)])
                tallies = np.concatenate([tallies, np.empty(filled, dtype=np.uint16)])
                grown += filled * 6
            buffer[filled] = position
            tallies[filled] = count
            appended[term] = (buffer, tallies, filled + 1)
        self.appended_bytes += grown
        self.npostings += len(counts)

    @property
    def nbytes(self) -> int:
        # The cache weighs the partition at every write: the columns, which
        # grow together, are counted by their capacity.
        return (
            len(self.seq) * _COLUMN_BYTES
            + self.positions.nbytes
            + self.counts.nbytes
            + self.offsets.nbytes
            + self.vocabulary.nbytes
            + self.appended_bytes
        )


def _buffers(
    positions: tuple[int, ...], tally: tuple[int, ...], position: int, count: int
) -> tuple[Int32Array, CountArray, int]:
    """A word's tuples of postings, full, as buffers twice as long with
    one more posting."""
    filled = len(positions)
    grown_positions = np.empty(2 * filled, dtype=np.int32)
    grown_tally = np.empty(2 * filled, dtype=np.uint16)
    grown_positions[:filled] = positions
    grown_tally[:filled] = tally
    grown_positions[filled] = position
    grown_tally[filled] = count
    return grown_positions, grown_tally, filled + 1


@dataclass(frozen=True, slots=True, eq=False)
class CompactPartition:
    """One owner's entries of one tier, as of one generation (see the module)."""

    tier: Tier
    owner: str
    generation: int
    usage: Usage
    # Positions 0..size-1 of the storage are this partition's; `count` of
    # them are not removed (as of `generation`).
    size: int
    count: int
    storage: Storage = field(repr=False)
    fetch_rows: Fetch = field(repr=False)
    # Writes applied to the storage up to this partition (see `unindexed`).
    ops: int = 0
    # Never any: findings are looked for in the entries a call returns.
    flagged: dict[str, str] = field(default_factory=dict, repr=False)
    # Never stale by expiry (a Partition's `expires`): the entries it
    # returns are read back, and an expired one is not; the sweep's
    # removals reach it as deletes do. Nor by a clock set back (a
    # Partition's `hidden`): an entry expired but not removed is read back
    # again then.
    expires = math.inf
    hidden = -math.inf

    # --- building -----------------------------------------------------------

    @classmethod
    def load(
        cls,
        tier: Tier,
        owner: str,
        scan: Callable[[Callable[[list[Record]], None]], tuple[Usage, int]],
        fetch_rows: Fetch,
    ) -> CompactPartition:
        """Index a partition whose rows `scan` hands over in batches (in
        insertion order) and whose usage and generation it then returns."""
        storage = Storage()
        # Machine ints, not lists of int objects: at a million entries the
        # (word, entry) pairs are ~15 million, 60 MB here, 500 MB as lists.
        term_ids = array.array("i")
        entry_ids = array.array("i")
        tallies = array.array("H")
        # Word -> id while loading; then the compact Vocabulary.
        vocabulary: dict[str, int] = {}

        def consume(records: list[Record]) -> None:
            start = storage.size
            storage.grow(start + len(records))
            for offset, record in enumerate(records):
                position = start + offset
                storage.put(position, record)
                for term, count in term_counts(record.content, record.created_at).items():
                    term_id = vocabulary.get(term)
                    if term_id is None:
                        term_id = vocabulary[term] = len(vocabulary)
                    term_ids.append(term_id)
                    entry_ids.append(position)
                    tallies.append(min(count, MAX_COUNT))
            storage.size = start + len(records)

        usage, generation = scan(consume)
        words = list(vocabulary)
        vocabulary.clear()
        make_segment(
            storage,
            words,
            np.frombuffer(term_ids, dtype=np.int32).copy(),
            np.frombuffer(entry_ids, dtype=np.int32).copy(),
            np.frombuffer(tallies, dtype=np.uint16).copy(),
        )
        del term_ids[:], entry_ids[:], tallies[:]
        storage.generation = generation
        size = storage.size
        # Never persisted: everything it holds is unindexed.
        return cls(tier, owner, generation, usage, size, size, storage, fetch_rows, ops=size)

    @property
    def unindexed(self) -> int:
        """Writes this partition holds that its storage's persisted index
        lacks (meaningful once the storage has one: see storage.indexed)."""
        return self.ops - self.storage.indexed_ops

    def saved(self) -> None:
        """Its index was persisted (as of its generation)."""
        with self.storage.lock:
            if self.generation > self.storage.indexed:
                self.storage.indexed, self.storage.indexed_ops = self.generation, self.ops

    def _owns_end(self) -> bool:
        return self.storage.size == self.size and self.storage.generation == self.generation

    def added(self, memory: Memory, generation: int, usage: Usage) -> CompactPartition | None:
        """This partition with one more entry (None: it was not the newest; reload)."""
        return self._appended(memory, generation, usage, replaces=None)

    def changed(
        self, target: Memory, replacement: Memory | None, generation: int, usage: Usage
    ) -> CompactPartition | None:
        """This partition with `target` replaced (or removed, with None)."""
        return self._appended(replacement, generation, usage, replaces=target)

    def removed(
        self, seqs: Sequence[int], generation: int, usage: Usage
    ) -> CompactPartition | None:
        """This partition without the entries of these seqs (the expiry
        sweep's batch; None: it was not the newest, reload)."""
        storage = self.storage
        with storage.lock:
            if not self._owns_end() or storage.removals > self.count:
                return None
            alive = storage.removed_at[: self.size] == ALIVE
            found = np.flatnonzero(np.isin(storage.seq[: self.size], seqs) & alive)
            storage.removed_at[found] = generation
            storage.removals += len(found)
            storage.generation = generation
        return CompactPartition(
            self.tier,
            self.owner,
            generation,
            usage,
            self.size,
            self.count - len(found),
            storage,
            self.fetch_rows,
            ops=self.ops + 1,
        )

    def _appended(
        self, memory: Memory | None, generation: int, usage: Usage, *, replaces: Memory | None
    ) -> CompactPartition | None:
        storage = self.storage
        with storage.lock:
            # Not the newest; or more removed (and replaced) entries than
            # live ones, which every search would go on paying for.
            if not self._owns_end() or storage.removals > self.count:
                return None
            count = self.count
            if replaces is not None:
                alive = storage.removed_at[: self.size] == ALIVE
                found = np.flatnonzero((storage.seq[: self.size] == replaces.seq) & alive)
                if not len(found):
                    return None
                # Older partitions still see it: they are older than `generation`.
                storage.removed_at[int(found[0])] = generation
                storage.removals += 1
                count -= 1
            size = self.size
            if memory is not None:
                storage.grow(size + 1)
                storage.append(size, memory)
                size += 1
                count += 1
            storage.size, storage.generation = size, generation
        return CompactPartition(
            self.tier,
            self.owner,
            generation,
            usage,
            size,
            count,
            storage,
            self.fetch_rows,
            ops=self.ops + 1,
        )

    # --- what ranking reads -------------------------------------------------

    @property
    def seq(self) -> Int64Array:
        return self.storage.seq[: self.size]

    @property
    def confidence(self) -> FloatArray:
        return self.storage.confidence[: self.size]

    @property
    def recency(self) -> FloatArray:
        return self.storage.recency[: self.size]

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    @property
    def npostings(self) -> int:
        return self.storage.npostings

    def alive(self) -> BoolArray | None:
        """Which positions this partition holds (None: all of them)."""
        if not self.storage.removals:
            return None
        removed_at: Int64Array = self.storage.removed_at[: self.size]
        return removed_at > self.generation

    def category_mask(self, category: str) -> BoolArray:
        wanted = self.storage.categories.get(category)
        if wanted is None:
            return np.zeros(self.size, dtype=bool)
        mask: BoolArray = self.storage.category[: self.size] == wanted
        return mask

    def term(self, term: str) -> Postings | None:
        """The positions holding `term` (of those this partition holds) and
        their counts, which index WEIGHTS."""
        storage = self.storage
        parts: list[tuple[Int32Array, CountArray]] = []
        term_id = storage.vocabulary.get(term)
        if term_id is not None:
            start, end = storage.offsets[term_id], storage.offsets[term_id + 1]
            parts.append((storage.positions[start:end], storage.counts[start:end]))
        held = storage.appended.get(term)
        if held is not None:
            parts.append(held_postings(held, self.size))
        if not parts:
            return None
        if len(parts) == 1:
            positions, tally = parts[0]
        else:
            positions = np.concatenate([p for p, _ in parts])
            tally = np.concatenate([t for _, t in parts])
        if storage.removals:
            keep = storage.removed_at[positions] > self.generation
            positions, tally = positions[keep], tally[keep]
        if not len(positions):
            return None
        return Postings(positions, tally, WEIGHTS)

    def fetch(self, positions: Sequence[int]) -> list[Memory | None]:
        """The entries at these positions, read from the database (None for
        one removed since)."""
        seqs = [int(self.storage.seq[p]) for p in positions]
        found = {m.seq: m for m in self.fetch_rows(self.tier, self.owner, seqs)}
        return [found.get(s) for s in seqs]

    def by_confidence(self, limit: int) -> list[int]:
        """The first `limit` positions it holds by confidence, then recency,
        then insertion (Partition.by_confidence's order)."""
        return top_by_confidence(self.confidence, self.recency, self.seq, self.alive(), limit)


def make_segment(
    storage: Storage,
    words: list[str],
    ids: Int32Array,
    positions: Int32Array,
    counts: CountArray,
) -> None:
    """Make (word id, position, count) triples, positions ascending, the
    storage's base segment: words in Vocabulary order, those without a
    position left out, each word's positions ascending (a stable sort)."""
    present = np.bincount(ids, minlength=len(words)) > 0
    kept = [w for w, here in zip(words, present.tolist(), strict=True) if here]
    storage.vocabulary, ranked = Vocabulary.sorted(kept)
    renumbered = np.full(len(words), -1, dtype=np.int32)
    renumbered[np.flatnonzero(present)[ranked]] = np.arange(len(ranked), dtype=np.int32)
    new_ids = renumbered[ids]
    order = np.argsort(new_ids, kind="stable")
    storage.positions = positions[order]
    storage.counts = counts[order]
    storage.offsets = np.zeros(len(ranked) + 1, dtype=np.int64)
    np.cumsum(np.bincount(new_ids, minlength=len(ranked)), out=storage.offsets[1:])
    storage.npostings = len(new_ids)
