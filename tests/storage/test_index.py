"""A compact index's persistence (sidecar.storage.index): saved only when the
change log can complete it, and read back with the changes since."""

from __future__ import annotations

import pytest

from sidecar.core.memory import Tier
from tests.conftest import MakeSidecar, Running
from tests.retrieval.test_compact import SCOPE, _hits, _state

pytestmark = pytest.mark.contract


def test_an_index_is_saved_only_when_it_can_be_complete(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 0}", name="save.db")
    key = (Tier.MEMORY, "agent")
    running.add("uv is the package manager", scope=SCOPE)
    before = running.store.generations([key])[key]
    # Nothing is logged yet: an index could never be completed.
    assert not running.store.indexes.save(Tier.MEMORY, "agent", before, [b"x"])
    assert _state(running) == (0, 0)
    running.store.indexes.start_logging(Tier.MEMORY, "agent")
    running.add("the worker deploys with helm", scope=SCOPE)
    # Logged from `before` on: an index as of `before` is completed by the log.
    assert running.store.indexes.save(Tier.MEMORY, "agent", before, [b"not an index"])
    assert _state(running) == (before, 1)
    assert not running.store.indexes.save(Tier.MEMORY, "agent", before, [b"not newer", b"!"])
    # A refused attempt leaves the index in use as it was.
    assert running.store.indexes.source(Tier.MEMORY, "agent").data == b"not an index"
    running.add("the cron runs nightly", scope=SCOPE)
    assert _state(running) == (before, 2)
    # An unreadable index is set aside: the tier is indexed from its rows.
    compact = make_sidecar(
        "defaults: {memory_char_limit: 0}\nserver: {compact_tier_entries: 1}", name="save.db"
    )
    assert _hits(compact, "cron nightly")[0].memory.content == "the cron runs nightly"


def _rows(running: Running) -> list[tuple[int, int]]:
    """(generation, part) of every row of the agent's memory tier's index table."""
    db = running.store.tables.db
    with db.connection_context():
        cursor = db.execute_sql(
            f"SELECT generation, part FROM tier_index WHERE owner = {db.param}"
            " ORDER BY generation, part",
            ("agent",),
        )
        return [(int(g), int(p)) for g, p in cursor.fetchall()]


def _generation(running: Running) -> int:
    return running.store.generations([(Tier.MEMORY, "agent")])[(Tier.MEMORY, "agent")]


def _logging(running: Running) -> int:
    """Log the tier's changes (as the first test does), and return a
    generation an index can be saved as of."""
    running.add("uv is the package manager", scope=SCOPE)
    logged_from = _generation(running)
    running.store.indexes.start_logging(Tier.MEMORY, "agent")
    running.add("the api is served by uvicorn", scope=SCOPE)
    return logged_from


def test_a_saved_index_stays_under_its_generation_and_replaces_every_older_one(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 0}", name="parts.db")
    first = _logging(running)
    assert running.store.indexes.save(Tier.MEMORY, "agent", first, [b"one-a", b"one-b"])
    # The parts are in use where they were written: no key rewritten.
    assert _rows(running) == [(first, 0), (first, 1)]
    assert running.store.indexes.source(Tier.MEMORY, "agent").data == b"one-aone-b"
    running.add("the worker deploys with helm", scope=SCOPE)
    second = _generation(running)
    assert running.store.indexes.save(Tier.MEMORY, "agent", second, [b"two"])
    assert _rows(running) == [(second, 0)]
    assert _state(running) == (second, 0)
    assert running.store.indexes.source(Tier.MEMORY, "agent").data == b"two"


def test_parts_left_behind_are_never_read_and_go_with_the_next_save(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 0}", name="left.db")
    first = _logging(running)
    assert running.store.indexes.save(Tier.MEMORY, "agent", first, [b"in use"])
    backend = running.store.tables.backend
    db = running.store.tables.db
    with db.connection_context(), backend.write_transaction():
        # An attempt cut off before its switch (newer than the index in
        # use), and one an older version staged under a negative key.
        assert backend.stage_index_part("agent", "memory", first + 2, 0, b"cut off")
        assert backend.stage_index_part("agent", "memory", -77, 0, b"older version's")
    assert running.store.indexes.source(Tier.MEMORY, "agent").data == b"in use"
    # Another attempt at a generation whose part is taken stores nothing.
    assert not running.store.indexes.save(Tier.MEMORY, "agent", first + 2, [b"x", b"y"])
    assert running.store.indexes.source(Tier.MEMORY, "agent").data == b"in use"
    for text in ("the cron runs nightly", "builds run on arm64", "tests use pytest", "ruff lints"):
        running.add(text, scope=SCOPE)
    newest = _generation(running)
    assert newest > first + 2
    assert running.store.indexes.save(Tier.MEMORY, "agent", newest, [b"newest"])
    assert _rows(running) == [(newest, 0)]


def test_a_refused_save_drops_only_its_own_parts(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 0}", name="refused.db")
    first = _logging(running)
    running.add("the worker deploys with helm", scope=SCOPE)
    second = _generation(running)
    assert running.store.indexes.save(Tier.MEMORY, "agent", second, [b"newer"])
    # Older than the index in use: staged, refused at the switch, dropped.
    assert not running.store.indexes.save(Tier.MEMORY, "agent", first, [b"older", b"parts"])
    assert _rows(running) == [(second, 0)]
    assert running.store.indexes.source(Tier.MEMORY, "agent").data == b"newer"
