"""sidecar.domain.engine: adds of one partition from this process share a
commit (SQLite's group commit), and the cached partition follows each."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.config import settings as config_mod
from sidecar.core.memory import Scope, Tier
from sidecar.core.metrics import Metrics
from sidecar.domain.engine import MemoryEngine
from sidecar.retrieval.partition import Partition
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry
from tests.conftest import WAIT_SECONDS, Clock, eventually

SCOPE = Scope(agent_id="coder", user_id="ada")
KEY = (Tier.MEMORY, SCOPE.agent_id)
FACTS = [
    "the deploy runs from the release branch",
    "staging lives in the eu-west cluster",
    "tests need a local postgres",
    "the linter is ruff, formatted at 100 columns",
]


@pytest.fixture
def engine_and_store(tmp_path: Path) -> Iterator[tuple[MemoryEngine, Store]]:
    path = tmp_path / "config.yaml"
    path.write_text("defaults: {memory_char_limit: 0}\n")
    store = Store(str(tmp_path / "m.db"))
    store.open()
    engine = MemoryEngine(
        config_mod.load(path, environ={}), store, metrics=Metrics(CollectorRegistry()), now=Clock()
    )
    yield engine, store
    assert engine.stop_indexing(WAIT_SECONDS)
    store.close()


def test_adds_of_one_partition_share_a_commit_and_the_cache_follows_each(
    engine_and_store: tuple[MemoryEngine, Store],
) -> None:
    engine, store = engine_and_store
    engine.add(NewEntry(SCOPE, Tier.MEMORY, "the first fact, cached before the group"))
    held = threading.Event()

    def hold() -> bool:
        # The partition's stripe is not held while the add waits for its
        # commit: the adds of the same partition below queue behind it.
        held.set()
        eventually(lambda: store.group_commit.waiting() == len(FACTS), "the adds to queue")
        return True

    opener = threading.Thread(
        target=engine.add,
        args=(NewEntry(SCOPE, Tier.MEMORY, "opens the group"),),
        kwargs={"still_wanted": hold},
    )
    opener.start()
    assert held.wait(WAIT_SECONDS)
    threads = [
        threading.Thread(target=engine.add, args=(NewEntry(SCOPE, Tier.MEMORY, fact),))
        for fact in FACTS
    ]
    for thread in threads:
        thread.start()
    for thread in [opener, *threads]:
        thread.join(WAIT_SECONDS)
        assert not thread.is_alive()
    assert store.group_commit.largest == len(FACTS)
    # Each write of the group was applied to the cached partition in turn:
    # it is current, and holds them all, without a reload.
    cached = engine.inside().partitions.cached(KEY)
    assert isinstance(cached, Partition)
    assert cached.generation == store.generations([KEY])[KEY]
    assert engine.inside().partitions.is_fresh(cached)
    assert sorted(m.content for m in cached.memories) == sorted(
        ["the first fact, cached before the group", "opens the group", *FACTS]
    )
