"""Ranking: a limit cuts the full ranking exactly, plain Python and numpy
agree, entries are found by their dates, and the semantic blend."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core.memory import Memory, Tier, Usage
from sidecar.retrieval import ranking
from sidecar.retrieval.keywords import keywords
from sidecar.retrieval.partition import Partition
from sidecar.retrieval.ranking import Weights, rank
from tests.retrieval.test_partition import WORDS, build, memory, text


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
        python, vector = (
            rank(
                partitions,
                query,
                Weights(),
                vectorized=vectorized,
                match_all=match_all,
                category=category,
                limit=limit,
            )
            for vectorized in (False, True)
        )
        assert python == vector


def test_entries_are_found_whichever_partition_holds_them() -> None:
    # Partitions end to end, empty ones among them: each hit is its own entry.
    first = build([memory(1, "alpha beta"), memory(2, "gamma")])
    second = build([memory(3, "alpha"), memory(4, "beta alpha")])
    partitions = [build([]), first, build([]), second, build([])]
    for vectorized in (False, True):
        hits = rank(partitions, ["alpha", "beta"], Weights(), vectorized=vectorized)
        assert sorted(m.id for m, _ in hits) == ["m1", "m3", "m4"]


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
