"""Store internals a client cannot see: connection set-up."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.storage.store import Store
from tests.conftest import (
    WAIT_SECONDS,
)

NORMAL, FULL = 1, 2


@pytest.mark.parametrize(("durability", "synchronous"), [("normal", NORMAL), ("full", FULL)])
def test_every_pooled_connection_gets_the_pragmas(
    tmp_path: Path, durability: str, synchronous: int
) -> None:
    store = Store(str(tmp_path / "m.db"), synchronous=durability, busy_timeout_ms=1234)
    store.open()
    seen: list[dict[str, int | str]] = []
    # Threads that hold connections at the same time force the pool to open
    # several, and each must be set up the same way.
    barrier = threading.Barrier(4)

    def probe() -> None:
        barrier.wait()
        seen.append(store.connection_settings())

    threads = [threading.Thread(target=probe) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()
    assert len(seen) == 4
    expected = {
        "journal_mode": "wal",
        "synchronous": synchronous,
        "busy_timeout": 1234,
        "foreign_keys": 1,
    }
    assert all(settings == expected for settings in seen)


def test_an_unknown_durability_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="synchronous must be one of"):
        Store(str(tmp_path / "m.db"), synchronous="sometimes")


@pytest.mark.contract
def test_close_waits_for_a_connection_another_thread_still_uses(
    databases: Callable[[str], str],
) -> None:
    # Closing a connection under a running statement crashed the process
    # (libpq freed beneath a WatchMemories read at shutdown).
    store = Store(databases("close.db"))
    store.open()
    holding, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def reader() -> None:
        with store._db.connection_context():
            holding.set()
            release.wait(WAIT_SECONDS)
            seen.append(store._db.execute_sql("SELECT 1").fetchone()[0])

    thread = threading.Thread(target=reader)
    thread.start()
    assert holding.wait(WAIT_SECONDS)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() did not wait for the connection in use"
    release.set()
    thread.join(WAIT_SECONDS)
    closer.join(WAIT_SECONDS)
    assert not closer.is_alive()
    assert seen == [1]
