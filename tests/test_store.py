"""Store internals a client cannot see: connection set-up."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sidecar.store import Store

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
