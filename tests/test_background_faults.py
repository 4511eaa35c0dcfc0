"""Background loops meeting a known database fault: the expiry sweep, the
event log's retention and the compact index's saves each log one WARNING
line with the reason and that they will try again, no traceback, and go on.

The fault is real: another connection holds SQLite's write lock past the
daemon's busy timeout, which the store reports as DatabaseBusy.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.core.memory import Tier
from sidecar.domain.watch import Retention
from sidecar.retrieval.compact import CompactPartition
from sidecar.storage.store import Store
from tests.conftest import MakeSidecar, WallClock, eventually

SCOPE = pb.Scope(agent_id="coder", user_id="ada")


@contextlib.contextmanager
def write_locked(path: Path) -> Iterator[None]:
    """SQLite's write lock held by another connection meanwhile: readers
    go on (WAL), every write waits out its busy timeout and fails."""
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
        other.execute("ROLLBACK")
    finally:
        other.close()


def warnings_of(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


def assert_one_line_each(records: list[logging.LogRecord], *words: str) -> None:
    """Every record a WARNING of one line naming the reason and the retry,
    with no traceback attached."""
    assert records
    for record in records:
        message = record.getMessage()
        assert record.levelno == logging.WARNING, message
        assert record.exc_info is None, message
        assert record.stack_info is None, message
        assert "\n" not in message
        for word in ("DATABASE_BUSY", "trying again", *words):
            assert word in message, message


def test_the_expiry_sweep_warns_of_a_busy_database_and_sweeps_later(
    make_sidecar: MakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar")
    clock = WallClock()
    sidecar = make_sidecar(
        clock=clock, expiry_sweep_seconds=0.05, expiry_grace_seconds=0, busy_timeout_ms=20
    )
    sidecar.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=1)
    clock.move(2)
    with write_locked(sidecar.db_path):
        # Two failed passes: the loop went on after the first.
        eventually(lambda: len(warnings_of(caplog, "sidecar.server")) >= 2, "two warnings")
    assert_one_line_each(warnings_of(caplog, "sidecar.server"), "expiry sweep")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # The lock gone, a later pass removes the row.
    eventually(
        lambda: not sidecar.list(scope=SCOPE, include_expired=True).memories, "the sweep removes it"
    )


def test_the_event_logs_retention_warns_of_a_busy_database_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar")
    clock = WallClock()
    store = Store(str(tmp_path / "m.db"), busy_timeout_ms=20, clock=clock)
    store.open()
    retention = Retention(store.events, 60, interval=0.01, clock=clock)
    try:
        with write_locked(tmp_path / "m.db"):
            retention.start()
            eventually(lambda: len(warnings_of(caplog, "sidecar.watches")) >= 2, "two warnings")
        assert_one_line_each(warnings_of(caplog, "sidecar.watches"), "event log")
        # The lock gone, a pass goes through: nothing more is logged.
        clock.now += timedelta(seconds=1)
        assert retention.run_once(clock()) == 0
    finally:
        retention.stop()
        store.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_compact_index_save_warns_of_a_busy_database_and_is_tried_again(
    make_sidecar: MakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar")
    sidecar = make_sidecar(
        "defaults: {memory_char_limit: 0}", compact_tier_entries=4, busy_timeout_ms=20
    )
    for i in range(5):
        sidecar.add(f"Standing fact number {i}", scope=SCOPE)
    partitions = sidecar.sidecar.engine.inside().partitions
    with write_locked(sidecar.db_path):
        held = partitions.get((Tier.MEMORY, SCOPE.agent_id))
        assert isinstance(held, CompactPartition)
        eventually(lambda: not partitions.indexer.busy(), "the save ends")
    saves = [r for r in warnings_of(caplog, "sidecar.indexer") if "persist" in r.getMessage()]
    assert len(saves) == 1
    assert_one_line_each(saves, "compact index")
    # Refused now, so tried again after INDEX_RETRY_SECONDS.
    assert held.storage.refused_at > float("-inf")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
