"""The WAL checkpoint thread (sidecar.storage.checkpoint): the store's writers
leave checkpoints to it, it keeps the WAL bounded, it stops with the store,
and a fault in it is one warning line and a retry.

Every wait is on a condition the thread's counts show (tests/waits.py),
never on a time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.core.memory import Scope, Tier
from sidecar.storage import checkpoint
from sidecar.storage.checkpoint import Checkpointer
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry, TierPolicy
from tests.conftest import eventually

UNLIMITED = TierPolicy(0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(str(tmp_path / "m.db"))
    opened.open()
    yield opened
    opened.close()


def _checkpointer(store: Store) -> Checkpointer:
    found: Checkpointer = store.tables.backend.checkpointer  # type: ignore[attr-defined]
    return found


def _add(store: Store, count: int, prefix: str, chars: int = 200) -> None:
    for i in range(count):
        store.add(NewEntry(Scope("agent"), Tier.MEMORY, f"{prefix} {i} " + "x" * chars), UNLIMITED)


def _pass_after(loop: Checkpointer) -> tuple[int, int]:
    """The (WAL frames, frames copied) of a pass begun after this call."""
    passes = loop.passes
    eventually(lambda: loop.passes > passes + 1, "a checkpoint pass")
    return loop.last


def test_writers_leave_checkpoints_to_the_thread(store: Store) -> None:
    with store.tables.db.connection_context():
        pages = store.tables.db.execute_sql("PRAGMA wal_autocheckpoint").fetchone()[0]
    assert pages == checkpoint.BACKSTOP_PAGES
    assert _checkpointer(store).alive()


def test_the_next_write_starts_the_wal_over_once_the_thread_copied_it(store: Store) -> None:
    loop = _checkpointer(store)
    _add(store, 20, "small")
    # Its content overflows onto some 100 pages: the WAL holds at least those.
    _add(store, 1, "large", chars=400_000)
    frames, copied = _pass_after(loop)
    assert frames == copied > 90
    # Every frame copied, no reader on them: this write starts the WAL over,
    # and it alone is in it.
    _add(store, 1, "next")
    frames, copied = _pass_after(loop)
    assert 0 < frames == copied < 50


def test_the_backstop_bounds_the_wal_while_the_thread_is_stopped(store: Store) -> None:
    loop = _checkpointer(store)
    loop.stop()
    # Over twice the backstop's pages (40 MB), with no thread to checkpoint them.
    _add(store, 800, "burst", chars=50_000)
    loop.checkpoint()
    assert loop.last[0] <= checkpoint.BACKSTOP_PAGES + 100
    assert os.path.getsize(store.path + "-wal") <= 2 * checkpoint.WAL_FILE_LIMIT


def test_the_thread_stops_with_the_store(tmp_path: Path) -> None:
    opened = Store(str(tmp_path / "m.db"))
    opened.open()
    loop = _checkpointer(opened)
    eventually(lambda: loop.passes > 0, "a first pass")
    opened.close()
    assert not loop.alive()
    # Closing the last connection checkpointed the WAL and removed it.
    assert not Path(str(tmp_path / "m.db") + "-wal").exists()


def test_a_fault_is_one_warning_line_and_a_retry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A directory where the database should be: every pass fails to open it.
    missing = tmp_path / "not-a-file"
    missing.mkdir()
    loop = Checkpointer(str(missing), interval=0.01)
    caplog.set_level(logging.WARNING, logger="sidecar.checkpoint")
    loop.start()
    try:
        eventually(lambda: loop.failures >= 3, "three failed passes")
        assert loop.alive()
    finally:
        loop.stop()
    assert not loop.alive()
    warnings = [r for r in caplog.records if r.name == "sidecar.checkpoint"]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert warnings[0].exc_info is None
    assert "\n" not in warnings[0].getMessage()


def test_it_works_again_once_the_fault_clears(tmp_path: Path) -> None:
    path = tmp_path / "later.db"
    path.mkdir()  # not a database yet
    loop = Checkpointer(str(path))
    loop.checkpoint()
    assert (loop.failing, loop.passes) == (1, 0)
    path.rmdir()
    opened = Store(str(path))
    opened.open()
    try:
        loop.checkpoint()
        assert (loop.failing, loop.passes) == (0, 1)
    finally:
        loop.stop()
        opened.close()
