"""MaxScore pruning changes nothing: a large tier's ranking equals scoring
every entry."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from sidecar.core.memory import Memory, Tier, Usage
from sidecar.retrieval import pruning
from sidecar.retrieval.compact import CompactPartition
from sidecar.retrieval.partition import Partition
from sidecar.retrieval.ranking import Weights, rank
from sidecar.storage._statements import Record, record_of
from tests.retrieval.test_partition import build, memory


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
    # (pruning.pruned); it must give exactly what scoring them all gives,
    # ties, categories, left-out entries and both blends included.
    answered = []
    pruned = pruning.pruned

    def counted(*arguments: object, **named: object) -> object:
        found = pruned(*arguments, **named)  # type: ignore[arg-type]
        answered.append(found is not None)
        return found

    monkeypatch.setattr(pruning, "pruned", counted)
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
    # Many of these queries hold a rare word, and a third were pruned; the
    # rest hold one of w0-w9, each in a tenth or more of the entries (short
    # words were no terms when this was written, and 200 were pruned then).
    assert len(answered) == 300
    assert sum(answered) > 90
