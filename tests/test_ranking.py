"""The index: incremental updates equal a fresh build; pruning changes nothing."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import ranking
from sidecar._statements import Record
from sidecar.compact import CompactPartition, record_of
from sidecar.keywords import keywords
from sidecar.memory import Memory, Tier, Usage
from sidecar.ranking import Partition, Weights, rank

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
    hooks = {"scan": flag, "count_tokens": lambda s: len(s) // 4}
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


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    limit=st.integers(1, 12),
    similarity=st.sampled_from([0.6, 1.0, 0.2]),
)
def test_a_limit_cuts_the_full_ranking_exactly(seed: int, limit: int, similarity: float) -> None:
    rng = random.Random(seed)
    # Skewed vocabulary: a few words in most entries, a long tail of rare ones.
    tail = [f"rare{i}" for i in range(60)]
    entries = []
    for i in range(rng.randint(1, 120)):
        words = rng.sample(WORDS[:4], rng.randint(0, 3)) + rng.sample(tail, rng.randint(0, 3))
        entries.append(
            memory(i, " ".join(words) or "alpha", round(rng.random(), 1), rng.choice(["", "x"]))
        )
    partitions = [build(entries[: len(entries) // 2]), build(entries[len(entries) // 2 :])]
    query = rng.sample(WORDS[:4] + tail, rng.randint(1, 5))
    weights = Weights(similarity, 1 - similarity)
    for category in ("", "x"):
        full = rank(partitions, query, weights, category=category)
        assert rank(partitions, query, weights, category=category, limit=limit) == full[:limit]


def test_match_all_needs_every_keyword() -> None:
    p = build([memory(1, "alpha beta"), memory(2, "alpha"), memory(3, "beta gamma alpha")])
    hits = rank([p], ["alpha", "beta"], Weights(), match_all=True)
    assert [m.id for m, _ in hits] == ["m1", "m3"]
    assert rank([p], ["alpha", "zeta"], Weights(), match_all=True) == []


@pytest.mark.parametrize("limit", [None, 2])
def test_no_keywords_rank_by_confidence_then_recency(limit: int | None) -> None:
    p = build([memory(1, "a", 0.5), memory(2, "b", 0.9), memory(3, "c", 0.5)])
    ranked = [m.id for m, _ in rank([p], [], Weights(), limit=limit)]
    assert ranked == ["m2", "m3", "m1"][:limit]


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    limit=st.one_of(st.none(), st.integers(1, 12)),
    match_all=st.booleans(),
    keywordless=st.booleans(),
)
def test_python_and_numpy_ranking_agree(
    seed: int, limit: int | None, match_all: bool, keywordless: bool
) -> None:
    rng = random.Random(seed)
    entries = [
        memory(i, text(rng), round(rng.random(), 1), rng.choice(["", "x"]))
        for i in range(rng.randint(1, 60))
    ]
    cut = rng.randint(0, len(entries))
    partitions = [build(entries[:cut]), build(entries[cut:])]
    query = [] if keywordless else rng.sample(WORDS, rng.randint(1, 4))
    for category in ("", "x"):
        arguments = {"match_all": match_all, "category": category, "limit": limit}
        python = rank(partitions, query, Weights(), vectorized=False, **arguments)
        vector = rank(partitions, query, Weights(), vectorized=True, **arguments)
        assert python == vector


def test_entries_are_found_by_the_month_and_year_they_were_written() -> None:
    def written(seq: int, text: str, when: datetime) -> Memory:
        return Memory(f"m{seq}", Tier.MEMORY, text, "", 1.0, when, when, seq)

    july = datetime(2023, 7, 14, tzinfo=UTC)
    entries = [
        written(1, "Signed up for a pottery class", july),
        written(2, "Went to a pottery fair", datetime(2024, 3, 2, tzinfo=UTC)),
        written(3, "Started running again", july),
        written(4, "Met the new neighbours", datetime(2023, 8, 1, tzinfo=UTC)),
    ]
    partition = Partition.build(Tier.MEMORY, "o", 1, entries, Usage())
    for vectorized in (False, True):
        hits = rank(
            [partition], keywords(["What did I do in July 2023?"]), Weights(), vectorized=vectorized
        )
        assert {m.id for m, _ in hits[:2]} == {"m1", "m3"}
        pottery = rank([partition], keywords(["pottery in July"]), Weights(), vectorized=vectorized)
        assert pottery[0][0].id == "m1"


def compact(memories: list[Memory], removed: int) -> CompactPartition:
    """A compact partition of these entries, the first `removed` then removed."""
    rows = {m.seq: m for m in memories}

    def scan(consume: Callable[[list[Record]], None]) -> tuple[Usage, int]:
        consume([record_of(m) for m in memories])
        return Usage(), 1

    def fetch(tier: Tier, owner: str, seqs: Sequence[int]) -> list[Memory]:
        return [rows[s] for s in seqs if s in rows]

    partition = CompactPartition.load(Tier.MEMORY, "o", scan, fetch)
    for generation, gone in enumerate(memories[:removed], start=2):
        del rows[gone.seq]
        changed = partition.changed(gone, None, generation, Usage())
        assert changed is not None
        partition = changed
    return partition


@pytest.mark.parametrize("held", ["full", "compact"])
def test_pruned_ranking_equals_scoring_every_entry(
    monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    # A large tier's ranking skips the entries that cannot place
    # (ranking._pruned); it must give exactly what scoring them all gives,
    # ties, categories, left-out entries and both blends included.
    answered = []
    pruned = ranking._pruned

    def counted(*arguments: object, **named: object) -> object:
        found = pruned(*arguments, **named)  # type: ignore[arg-type]
        answered.append(found is not None)
        return found

    monkeypatch.setattr(ranking, "_pruned", counted)
    rng = random.Random(11)
    # Zipf-like: the k-th word is in about 1/k of the entries.
    vocabulary = [f"w{k}" for k in range(300)]
    zipf = [1 / (k + 1) for k in range(len(vocabulary))]
    entries = [
        memory(
            i,
            " ".join(rng.choices(vocabulary, weights=zipf, k=rng.randint(1, 9))),
            rng.choice([0.2, 0.5, 0.5, 0.8, 1.0]),
            rng.choice(["", "", "x"]),
        )
        for i in range(1500)
    ]
    partitions: list[Partition | CompactPartition] = [build(entries[:1000])]
    partitions.append(build(entries[1000:]) if held == "full" else compact(entries[1000:], 40))
    for _ in range(300):
        query = rng.sample(vocabulary[:8], rng.randint(0, 3)) + rng.sample(
            vocabulary, rng.randint(1, 3)
        )
        similarity = rng.choice([0.6, 0.6, 1.0, 0.0, 0.3])
        weights = Weights(similarity, 1 - similarity)
        category = rng.choice(["", "", "x"])
        limit = rng.choice([1, 3, 10, 40])
        leave_out = frozenset(rng.sample(range(1500), rng.choice([0, 0, 5])))
        answers = [
            rank(
                partitions,
                query,
                weights,
                category=category,
                limit=limit,
                leave_out=leave_out,
                vectorized=True,
                prune=prune,
            )
            for prune in (False, True)
        ]
        assert answers[0] == answers[1]
    # Most of these queries hold a rare word: most were pruned.
    assert len(answered) == 300
    assert sum(answered) > 200


def _blended(cosines: list[float], weight: float = 0.5, floor: float = 0.35) -> dict[str, float]:
    entries = [
        memory(1, "river stone"),
        memory(2, "river"),
        memory(3, "river cloud"),
        memory(4, "harbor"),  # no keyword: a hit only by meaning
        memory(5, "island"),
    ]
    scores = ranking.SemanticScores(np.array(cosines, dtype=np.float64), weight, floor)
    found = rank([build(entries)], ["river", "stone"], Weights(), semantic=scores)
    return {m.id: score for m, score in found}


def test_the_blend_reads_how_far_apart_cosines_are_not_where_they_lie() -> None:
    # One model's cosines, and another's that crowd near the top (as e5's
    # do, 0.7-0.95) in the same order: the same ranking and the same scores,
    # once the floor is set for each.
    small = [0.20, 0.10, 0.60, 0.50, 0.05]
    crowded = [0.80 + c / 5 for c in small]
    ranked = _blended(small)
    assert ranked == pytest.approx(_blended(crowded, floor=0.80 + 0.35 / 5))
    assert list(ranked) == list(_blended(crowded, floor=0.80 + 0.35 / 5))
    # m4 matched by meaning alone, m5 (under the floor) did not; m3's
    # closeness in meaning lifts it over m1's extra keyword.
    assert list(ranked) == ["m3", "m1", "m4", "m2"]


def test_an_entry_without_a_vector_neither_matches_by_meaning_nor_sets_the_scale() -> None:
    embedded = _blended([0.80, 0.90, 0.95, 0.93, 0.10], floor=0.9)
    unembedded = _blended([0.80, math.nan, 0.95, 0.93, 0.10], floor=0.9)
    # m2 keeps its keyword score and gets nothing for meaning; the others'
    # scale is still 0.80-0.95, as if a 0 stood in for m2 it would not be.
    assert unembedded["m1"] == embedded["m1"]
    assert unembedded["m1"] != _blended([0.80, 0.0, 0.95, 0.93, 0.10], floor=0.9)["m1"]
    assert unembedded["m2"] < embedded["m2"]
    # Without a vector, no match by meaning.
    assert "m4" not in _blended([0.80, 0.90, 0.95, math.nan, 0.10], floor=0.9)
    assert list(_blended([math.nan] * 5)) == ["m1", "m2", "m3"]  # keywords alone


def test_spread_scales_known_cosines_to_zero_and_one() -> None:
    spread = ranking.spread(np.array([0.2, 0.6, math.nan, 0.4])).tolist()
    assert spread == pytest.approx([0.0, 1.0, 0.0, 0.5])
    assert ranking.spread(np.array([0.7, 0.7])).tolist() == [1.0, 1.0]
    assert ranking.spread(np.array([math.nan])).tolist() == [0.0]
