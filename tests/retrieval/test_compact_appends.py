"""Writes appended to a compact partition (sidecar.retrieval.compact) leave
it exactly as a partition indexed from scratch from the same rows: the
same postings, ranking and scores, and the same persisted bytes.

Appended postings take several forms as a word gathers them (tuples while
few, then buffers that double): words here pass through each form, and
the older partitions sharing the storage still see only what was theirs.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

import pytest

from sidecar.core.memory import Memory, Tier, Usage
from sidecar.retrieval import index_format
from sidecar.retrieval.compact import MAX_COUNT, CompactPartition
from sidecar.retrieval.ranking import Weights, rank
from sidecar.storage._statements import Record, record_of
from sidecar.storage.index import IndexSource

pytestmark = pytest.mark.contract

START = datetime(2023, 1, 30, 23, 0, tzinfo=UTC)
# Words that reach 1, 4, 8, 9, 16 and more appended postings.
COMMON = ["deploy", "kubernetes", "tea", "coffee", "uv", "svc-7"]
CATEGORIES = ["", "env", "pref"]
QUERIES = [
    ["deploy"],
    ["tea", "coffee"],
    ["uv", "svc-7", "kubernetes"],
    ["2023"],
    ["march2023", "deploy"],
    ["note3", "tea"],
    ["zz"],
    ["nothing"],
]


def _memory(seq: int, rng: random.Random) -> Memory:
    words = rng.choices(COMMON, k=rng.randint(1, 7))
    # A word of its own (a word's first appended posting), repeats (counts
    # above 1), and dates across months and years (their date terms).
    content = " ".join([*words, f"note{seq}", *(["tea"] * rng.randint(0, 3))])
    created = START + timedelta(days=13 * seq, microseconds=seq)
    # Edited later, now and then: recency is the update's time.
    updated = created + timedelta(seconds=seq % 3 * 7.5)
    # Categories first appear in seq order, as a load from the rows meets them.
    category = CATEGORIES[min(seq // 20, 2)] if seq % 2 else ""
    return Memory(
        f"m{seq}", Tier.MEMORY, content, category, 0.5 + seq % 3 / 4, created, updated, seq=seq
    )


def _scan(
    memories: Sequence[Memory], generation: int
) -> Callable[[Callable[[list[Record]], None]], tuple[Usage, int]]:
    def scan(consume: Callable[[list[Record]], None]) -> tuple[Usage, int]:
        records = [record_of(m, "a") for m in sorted(memories, key=lambda m: m.seq)]
        for start in range(0, len(records), 7):
            consume(records[start : start + 7])
        return Usage.of(len(m.content) for m in memories), generation

    return scan


class Rows:
    """A tier's rows, and the compact partition written along with them."""

    def __init__(self, memories: list[Memory]) -> None:
        self.rows = {m.seq: m for m in memories}
        self.generation = 1
        self.compact = CompactPartition.load(Tier.MEMORY, "a", _scan(memories, 1), self.fetch)

    def fetch(self, tier: Tier, owner: str, seqs: Sequence[int]) -> list[Memory]:
        return [self.rows[s] for s in seqs if s in self.rows]

    def write(self, memory: Memory, replaces: Memory | None = None) -> None:
        self.generation += 1
        self.rows[memory.seq] = memory
        if replaces is None:
            written = self.compact.added(memory, self.generation, Usage())
        else:
            written = self.compact.changed(replaces, memory, self.generation, Usage())
        assert written is not None
        self.compact = written

    def scratch(self) -> CompactPartition:
        """The same rows, indexed from scratch."""
        rows = list(self.rows.values())
        return CompactPartition.load(Tier.MEMORY, "a", _scan(rows, self.generation), self.fetch)


def _answers(partition: CompactPartition) -> list[list[tuple[str, float]]]:
    found = []
    for words in QUERIES:
        for category in ("", "env"):
            hits = rank([partition], words, Weights(), category=category, limit=None)
            found.append([(m.id, score) for m, score in hits])
    return found


def _postings(partition: CompactPartition, word: str) -> dict[int, float]:
    """A word's weight in each entry holding it, by seq."""
    held = partition.term(word)
    if held is None:
        return {}
    seqs = partition.seq[held.positions].tolist()
    return dict(zip(seqs, held.all().tolist(), strict=True))


def test_appended_writes_index_exactly_as_a_load_of_the_same_rows() -> None:
    rng = random.Random(11)
    tier = Rows([_memory(seq, rng) for seq in range(1, 31)])
    older: list[tuple[CompactPartition, list[list[tuple[str, float]]]]] = []
    for seq in range(31, 111):
        tier.write(_memory(seq, rng))
        if seq % 9 == 0:
            # An update: a tombstone and the entry appended again.
            target = tier.rows[seq - 20]
            tier.write(dataclasses.replace(target, content=f"{target.content} deploy"), target)
        if seq % 25 == 0:
            older.append((tier.compact, _answers(tier.scratch())))
    # More copies of a word than a count holds: kept as MAX_COUNT.
    tier.write(dataclasses.replace(_memory(111, rng), content="zz " * (MAX_COUNT + 5)))

    scratch = tier.scratch()
    assert tier.compact.count == scratch.count
    assert _answers(tier.compact) == _answers(scratch)
    words = {*COMMON, "2023", "2024", "march2023", "note5", "note77", "zz", "nothing"}
    for word in words:
        assert _postings(tier.compact, word) == _postings(scratch, word), word
    # Persisted: the same bytes as the index of the rows, and read back,
    # the same answers.
    saved = index_format.to_bytes(tier.compact)
    assert saved == index_format.to_bytes(scratch)
    source = IndexSource(
        saved, tier.generation, [], [], Usage(0, scratch.count), tier.generation, 0
    )
    restored = index_format.restore(Tier.MEMORY, "a", source, tier.fetch)
    assert _answers(restored) == _answers(scratch)
    # Older partitions, written past since, answer as they did (the rows
    # they would read back are the current ones: their answers' ids and
    # scores are compared).
    for partition, answers in older:
        assert _answers(partition) == answers


def test_the_weight_of_appended_words_is_counted_as_before() -> None:
    # The cache weighs a storage by nbytes at every write: 400 bytes a word
    # appended since the base segment, and 6 a posting for each doubling of
    # its room past the first 4 postings (4, 8, 16, 32...).
    rng = random.Random(5)
    tier = Rows([_memory(seq, rng) for seq in range(1, 4)])
    before = tier.compact.storage.appended_bytes
    for seq in range(4, 45):
        tier.write(Memory(f"m{seq}", Tier.MEMORY, "tea", "", 1.0, START, START, seq=seq))
    storage = tier.compact.storage
    # 41 postings each of "tea", "2023" and "january2023".
    assert storage.appended_bytes - before == 3 * (400 + (4 + 8 + 16 + 32) * 6)
    columns = sum(c.nbytes for c in (storage.seq, storage.confidence, storage.recency))
    columns += storage.category.nbytes + storage.removed_at.nbytes
    segment = storage.positions.nbytes + storage.counts.nbytes + storage.offsets.nbytes
    expected = columns + segment + storage.vocabulary.nbytes + storage.appended_bytes
    assert storage.nbytes == expected
