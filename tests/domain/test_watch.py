"""The watch hub over a real store: polling without a verified feed, the lag
counted from the watch's start, retention off."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sidecar.config.settings import ServerSettings
from sidecar.core.errors import ResourceExhausted
from sidecar.core.memory import Scope, Tier
from sidecar.domain.watch import Sync, Watches
from sidecar.storage.events import Event
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry, TierPolicy
from tests.conftest import (
    WAIT_SECONDS,
)

SCOPE = Scope("coder", "ada")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(str(tmp_path / "m.db"))
    opened.open()
    yield opened
    opened.close()


def add(store: Store, content: str) -> str:
    return store.add(NewEntry(SCOPE, Tier.MEMORY, content), TierPolicy(0)).memory.id


def test_without_a_verified_feed_a_watch_polls_the_log(store: Store) -> None:
    waiting = threading.Event()

    class Unverified:
        @property
        def verified(self) -> bool:
            waiting.set()  # asked as the watch goes to sleep
            return False

    hub = Watches(store.events, ServerSettings(), feed=Unverified())
    with hub.open(SCOPE, list(Tier)) as watch:
        events = watch.events(0)
        assert isinstance(next(events), Sync)
        got: list[Event | Sync] = []
        reader = threading.Thread(target=lambda: got.append(next(events)), daemon=True)
        reader.start()
        assert waiting.wait(WAIT_SECONDS)
        # Written behind the hub's back: nothing wakes the watch.
        memory_id = add(store, "written by another process")
        reader.join(WAIT_SECONDS)
        assert isinstance(got[0], Event)
        assert got[0].memory_id == memory_id
        watch.cancel()
        assert list(events) == []


def test_catching_up_is_never_too_slow_but_falling_behind_is(store: Store) -> None:
    hub = Watches(store.events, ServerSettings(watch_buffer_events=5))
    first = store.add(NewEntry(SCOPE, Tier.MEMORY, "the first"), TierPolicy(0)).generation
    history = [add(store, f"history {n}") for n in range(20)]
    with hub.open(SCOPE, list(Tier)) as watch:
        events = watch.events(first)
        received = [next(events) for _ in range(3)]
        # News while catching up: the history behind it does not count.
        news = add(store, "news")
        hub.wake((Tier.MEMORY, "coder"), 0)
        received += [next(events) for _ in range(len(history) - 3 + 1)]
        assert [e.memory_id for e in received if isinstance(e, Event)] == [*history, news]
        # A burst, of which the consumer takes one and then dawdles while
        # six more land: more than the buffer behind.
        burst = [add(store, f"burst {n}") for n in range(5)]
        hub.wake((Tier.MEMORY, "coder"), 0)
        taken = [next(events)]
        for n in range(6):
            add(store, f"while away {n}")
        hub.wake((Tier.MEMORY, "coder"), 0)
        with pytest.raises(ResourceExhausted) as raised:
            taken.extend(events)
        assert raised.value.reason == "WATCH_TOO_SLOW"
        assert [e.memory_id for e in taken if isinstance(e, Event)] == burst
        resume = int(raised.value.metadata["resume_generation"])
        assert resume == taken[-1].generation


def test_retention_zero_keeps_every_event(store: Store) -> None:
    hub = Watches(store.events, ServerSettings(event_retention_seconds=0))
    add(store, "kept")
    assert hub.retention.run_once(datetime.now(UTC) + timedelta(days=3650)) == 0
    assert store.events.backlog([(Tier.MEMORY, "coder")], 0, 10) == 1
