"""The full partition: incremental updates equal a fresh build, and older
partitions never see what is written after them."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TypedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core.memory import Memory, Tier, Usage
from sidecar.retrieval.partition import Partition

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "common",
    "shared",
    "river",
    "stone",
    "cloud",
    "ember",
    "frost",
    "grove",
    "harbor",
    "island",
    "jungle",
]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def memory(seq: int, text: str, confidence: float = 1.0, category: str = "") -> Memory:
    stamp = T0 + timedelta(seconds=seq)
    return Memory(f"m{seq}", Tier.MEMORY, text, category, confidence, stamp, stamp, seq)


class Hooks(TypedDict):
    """What a Partition asks for each entry it takes in."""

    scan: Callable[[Memory], str | None]
    count_tokens: Callable[[str], int]


def flag(memory: Memory) -> str | None:
    """A stand-in scanner: flags entries that mention embers."""
    return "ember" if "ember" in memory.content else None


def build(memories: list[Memory], generation: int = 0) -> Partition:
    usage = Usage.of(len(m.content) for m in memories)
    return Partition.build(Tier.MEMORY, "o", generation, memories, usage, scan=flag)


def same(a: Partition, b: Partition) -> None:
    assert a.memories == b.memories
    assert a.postings.keys() == b.postings.keys()
    for term, (indices, values) in a.postings.items():
        assert indices.tolist() == b.postings[term][0].tolist()
        assert values.tolist() == b.postings[term][1].tolist()
    for column in ("confidence", "recency", "seq"):
        assert getattr(a, column).tolist() == getattr(b, column).tolist()
    assert a.findings == b.findings
    assert a.flagged == b.flagged
    assert a.tokens == b.tokens
    assert a.npostings == b.npostings == sum(len(i) for i, _ in a.postings.values())


def text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_incremental_updates_equal_a_fresh_build(seed: int) -> None:
    rng = random.Random(seed)
    entries = [memory(i, text(rng)) for i in range(rng.randint(0, 6))]
    partition = build(entries)
    seq = len(entries)
    hooks: Hooks = {"scan": flag, "count_tokens": lambda s: len(s) // 4}
    # Every partition made on the way, with what it holds: appends share
    # storage with older partitions, which must never see them.
    history = [(partition, list(entries), 0)]
    for step in range(1, 16):
        action = rng.choice(["add", "add", "update", "delete", "fork"]) if entries else "add"
        if action == "fork":
            # An older partition written again: it may not append in place.
            partition, old_entries, _ = rng.choice(history)
            entries = list(old_entries)
            action = "add"
        if action == "add":
            seq += 1
            new = memory(seq, text(rng))
            entries.append(new)
            partition = partition.added(new, step, Usage(), **hooks)
        elif action == "update":
            position = rng.randrange(len(entries))
            old = entries[position]
            new = memory(old.seq, text(rng), rng.random())
            entries[position] = new
            partition = partition.changed(old.id, new, step, Usage(), **hooks)
        else:
            old = entries.pop(rng.randrange(len(entries)))
            partition = partition.changed(old.id, None, step, Usage(), **hooks)
        same(partition, build(entries, step))
        history.append((partition, list(entries), step))
    for older, held, step in history:
        same(older, build(held, step))


def test_an_older_partition_is_untouched_by_updates() -> None:
    first = build([memory(1, "alpha beta")])
    second = first.added(
        memory(2, "alpha gamma"), 1, Usage(), scan=lambda m: None, count_tokens=len
    )
    assert len(first.postings["alpha"][0]) == 1
    assert len(second.postings["alpha"][0]) == 2
    assert "gamma" not in first.postings


HOOKS = Hooks(scan=flag, count_tokens=lambda text: len(text) // 4)


def test_what_a_partition_was_loaded_without_stays_with_its_updates() -> None:
    """`hidden` (the latest expiry of the entries a load left out) is the
    load's: an add, an edit or a delete applied in place keeps it, so a
    clock set back before it still finds the partition stale."""
    hidden = T0.timestamp()
    for entries in ([], [memory(1, "alpha beta"), memory(2, "gamma")]):
        loaded = Partition.build(Tier.MEMORY, "o", 1, entries, Usage(), hidden=hidden)
        assert loaded.hidden == hidden
        added = loaded.added(memory(3, "delta river"), 2, Usage(), **HOOKS)
        edited = added.changed("m3", memory(3, "delta stone"), 3, Usage(), **HOOKS)
        deleted = edited.changed("m3", None, 4, Usage(), **HOOKS)
        assert [p.hidden for p in (added, edited, deleted)] == [hidden] * 3
    assert Partition.build(Tier.MEMORY, "o", 1, [], Usage()).hidden == float("-inf")
