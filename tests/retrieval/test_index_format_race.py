"""A compact partition's index is persisted (index_format.to_bytes) by a
background thread while requests write the tier: what it writes is one
consistent snapshot, as of the partition it was handed.

The writes change the storage's `appended` words, its categories and its
tombstones under the storage's lock; to_bytes must read them under it too.
A dict iterated in C (list(d.items()), sorted(d)) lets no other thread in,
but the collector runs Python code in the middle of one (a weakref
callback, a finalizer: the server has both), and another thread's write
can come in there; here a gc callback stands for that code, and waits
there for a write.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from sidecar.core.memory import Memory, Tier, Usage
from sidecar.retrieval import index_format
from sidecar.retrieval.compact import CompactPartition
from sidecar.retrieval.keywords import terms
from sidecar.storage.index import IndexSource
from tests.retrieval.test_compact import START, Twin
from tests.waits import WAIT_SECONDS

WRITES = 300


def _memory(seq: int) -> Memory:
    # A word of its own (so `appended` grows at every add), now and then a
    # category not seen before.
    category = f"c{seq // 7}" if seq % 3 else ""
    # Many words each: `appended` soon outgrows the tuples Python keeps
    # for reuse, so a loop over it allocates (and the collector runs).
    words = " ".join(f"w{k}v{seq}" for k in range(12))
    content = f"note zq{seq}x on deploys: {words}"
    return Memory(f"m{seq}", Tier.MEMORY, content, category, 1.0, START, START, seq=seq)


class Interleaved:
    """Writes land in the middle of to_bytes: whenever the collector runs
    in the indexing thread (Python code it runs, as the server's weakref
    callbacks and finalizers do, in the middle of a C loop over a dict),
    that thread waits there for the writer's next write, unless it holds
    the storage's lock (the writer could not write then)."""

    def __init__(self, twin: Twin) -> None:
        self.twin = twin
        self.writes = 0
        self.done = False
        self.changed = threading.Condition()
        self.indexer: threading.Thread | None = None

    def wrote(self, *, last: bool = False) -> None:
        with self.changed:
            self.writes += 1
            self.done = last
            self.changed.notify_all()

    def collected(self, phase: str, info: dict[str, int]) -> None:
        if threading.current_thread() is not self.indexer:
            return
        if phase != "start" or self.twin.compact.storage.lock.locked():
            return
        with self.changed:
            seen = self.writes
            self.changed.wait_for(lambda: self.writes != seen or self.done, WAIT_SECONDS)


@pytest.fixture
def interleaved() -> Iterator[Interleaved]:
    threshold = gc.get_threshold()
    state = Interleaved(Twin([_memory(seq) for seq in range(1, 40)]))
    # A collection every few allocations: many in each loop over a dict.
    gc.set_threshold(20)
    gc.callbacks.append(state.collected)
    try:
        yield state
    finally:
        gc.callbacks.remove(state.collected)
        gc.set_threshold(*threshold)


def test_an_index_taken_while_the_tier_is_written_is_one_of_its_partition(
    interleaved: Interleaved,
) -> None:
    """Each index persisted while a writer adds (new words, new categories)
    and removes entries restores to exactly the entries of the partition it
    was taken from: none it lacks, none past its generation."""
    twin = interleaved.twin
    # What each generation holds (a model of the tier, kept by the writer).
    live = {twin.generation: frozenset(twin.rows)}
    failed: list[BaseException] = []

    def write() -> None:
        try:
            for seq in range(40, 40 + WRITES):
                twin.add(_memory(seq))
                live[twin.generation] = frozenset(twin.rows)
                if seq % 4 == 0:
                    twin.change(twin.rows[seq - 20], None)
                    live[twin.generation] = frozenset(twin.rows)
                interleaved.wrote()
        except BaseException as exc:  # pragma: no cover - reported below
            failed.append(exc)
        finally:
            interleaved.wrote(last=True)

    writer = threading.Thread(target=write, name="writer")
    taken: list[tuple[CompactPartition, bytes]] = []
    interleaved.indexer = threading.current_thread()
    writer.start()
    try:
        while not interleaved.done:
            partition = twin.compact
            taken.append((partition, index_format.to_bytes(partition)))
    finally:
        interleaved.indexer = None
        writer.join(WAIT_SECONDS)
    assert not writer.is_alive()
    assert not failed, failed
    assert twin.reloads == 0  # one storage all along, written in place
    assert len(taken) > 1
    for partition, data in taken:
        _restores_exactly(partition, data, live[partition.generation])


def _restores_exactly(partition: CompactPartition, data: bytes, seqs: frozenset[int]) -> None:
    """The index restores to the entries `seqs` (those of its partition's
    generation); the newest of them (those written as it was taken) each
    found by its own word, in its own category."""
    source = IndexSource(
        data, partition.generation, [], [], Usage(0, partition.count), partition.generation, 0
    )
    restored = index_format.restore(Tier.MEMORY, "a", source, partition.fetch_rows)
    assert restored.generation == partition.generation
    assert restored.count == len(seqs) == partition.count
    assert sorted(restored.seq.tolist()) == sorted(seqs)
    for position, seq in list(enumerate(restored.seq.tolist()))[-30:]:
        (word,) = terms(f"zq{seq}x")
        found = restored.term(word)
        assert found is not None, seq
        assert found.positions.tolist() == [position], seq
        expected = _memory(seq).category
        assert restored.category_mask(expected)[position], seq
