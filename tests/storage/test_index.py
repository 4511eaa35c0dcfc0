"""A compact index's persistence (sidecar.storage.index): saved only when the
change log can complete it, and read back with the changes since."""

from __future__ import annotations

import pytest

from sidecar.core.memory import Tier
from tests.conftest import MakeSidecar
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
