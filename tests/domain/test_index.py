"""The compact index's saves: paced, so a tier written without pause does
not spend the requests' CPU saving itself back to back."""

from __future__ import annotations

from pathlib import Path

from sidecar.core.memory import Scope, Tier
from sidecar.domain.index import Indexer
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry, TierPolicy
from tests.conftest import eventually

SCOPE = Scope("agent")
KEY = (Tier.MEMORY, SCOPE.agent_id)


class Stepping:
    """A clock that moves one second at every reading, and jumps on demand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _written(store: Store, *texts: str) -> None:
    for text in texts:
        store.add(NewEntry(SCOPE, Tier.MEMORY, text), TierPolicy(0))


def _saved(store: Store, indexer: Indexer) -> int:
    """The generation of the partition's persisted index (0: none), once no save is under way."""
    eventually(lambda: not indexer.busy(), "the save ends")
    source = store.indexes.source(*KEY)
    return 0 if source is None else source.indexed


def test_the_next_save_waits_pace_times_as_long_as_the_last_took(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "m.db"))
    store.open()
    clock = Stepping()
    # Due after every write (every=1), each save reading the clock twice:
    # it took at least a second, so the next may start 100 s after it ends.
    indexer = Indexer(store, now=clock, every=1, pace=100.0)
    try:
        _written(store, "The repo uses uv", "CI runs on every push")
        indexer.maybe_index(KEY, indexer.load(*KEY))  # none yet: saved at once
        first = _saved(store, indexer)
        assert first > 0
        _written(store, "Deploys go out on Tuesdays")
        lacking = indexer.load(*KEY)
        assert lacking.generation > first
        assert lacking.unindexed >= 1
        indexer.maybe_index(KEY, lacking)  # due, but resting
        assert _saved(store, indexer) == first
        clock.now += 1000.0
        indexer.maybe_index(KEY, lacking)
        assert _saved(store, indexer) == lacking.generation
    finally:
        indexer.stop(60)
        store.close()
