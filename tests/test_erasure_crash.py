"""ForgetUser under a SIGKILL: a crash mid-erasure leaves all or nothing, and
a retry completes. Both backends (tests/test_erasure.py has the rest).
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.core.memory import Memory, Scope, Tier
from sidecar.storage import archive
from sidecar.storage.store import Store
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    eventually,
    spawn_daemon,
)
from tests.test_erasure import SECRET

pytestmark = pytest.mark.contract

# Enough that the erasure's transaction lasts long enough to be caught in
# it (`writing`), and that an erasure committed in parts would still be
# caught between two of them (`visible`): with each statement committed on
# its own, `visible` found the vectors gone and the rows left every time,
# down to 1,000 entries, on both backends.
BIG = 10_000


def seed(db: str) -> None:
    store = Store(db)
    store.open()
    now = datetime.now(UTC)
    entries = [
        ("ada", Memory(f"id-{k}", Tier.USER, f"{SECRET} #{k}", "", 1.0, now, now))
        for k in range(BIG)
    ]
    entries.append(("bob", Memory("bob", Tier.USER, "Bob's fact", "", 1.0, now, now)))
    archive.restore(store, entries)
    # And a vector and an idempotency key per entry: all of it goes, or none.
    # Set-based (one statement each, on either backend), not a Python loop.
    backend, database = store.tables.backend, store.tables.db
    with database.connection_context(), backend.write_transaction():
        database.execute_sql(
            "INSERT INTO memory_vectors (seq, model, content_sha256, vector)"
            f" SELECT seq, 'test', 'digest', {database.param} FROM memories WHERE owner = 'ada'",
            (b"\x00\x01",),
        )
        database.execute_sql(
            "INSERT INTO idempotency_keys (owner, tier, key, memory_id, content_sha256,"
            " created_at) SELECT 'ada', 'user', 'key-' || CAST(seq AS TEXT), 'id', 'digest', 0"
            " FROM memories WHERE owner = 'ada'"
        )
    store.close()


def left_of_ada(store: Store) -> tuple[int, int, int]:
    """Ada's entries, vectors and idempotency keys still stored."""
    db = store.tables.db
    with db.connection_context():
        return tuple(
            db.execute_sql(sql).fetchone()[0]
            for sql in (
                "SELECT COUNT(*) FROM memories WHERE owner = 'ada'",
                "SELECT COUNT(*) FROM memory_vectors",
                "SELECT COUNT(*) FROM idempotency_keys WHERE owner = 'ada'",
            )
        )


VISIBLE = f"SELECT COUNT(*) < {BIG} FROM memory_vectors"


@contextlib.contextmanager
def kill_point(db: str, when: str) -> Iterator[Callable[[], bool]]:
    """Whether it is time to kill the daemon: `writing`, once it holds a
    write transaction (mid-erasure); `visible`, once any of the erasure can
    be seen from outside (a commit: an erasure done in several would be
    caught half-way)."""
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as connection:
            sql = VISIBLE
            if when == "writing":
                sql = (
                    "SELECT COUNT(*) > 0 FROM pg_stat_activity"
                    " WHERE application_name = 'memory-sidecar' AND backend_xid IS NOT NULL"
                )
            yield lambda: bool(connection.execute(sql).fetchone()[0])  # type: ignore[index]
        return
    lite = sqlite3.connect(db, timeout=0, isolation_level=None)

    def writing() -> bool:
        try:
            lite.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            return True
        lite.execute("ROLLBACK")
        return False

    try:
        yield writing if when == "writing" else lambda: bool(lite.execute(VISIBLE).fetchone()[0])
    finally:
        lite.close()


@pytest.mark.parametrize("when", ["writing", "visible"])
def test_a_sigkill_mid_erasure_leaves_all_or_nothing_and_a_retry_completes(
    databases: Callable[[str], str], when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = databases("crash.db")
    seed(db)
    daemon = spawn_daemon("--db", db, "--listen", "127.0.0.1:0")
    outcome: list[object] = []
    try:
        channel = grpc.insecure_channel(daemon.api)
        stub = pb_grpc.MemoryServiceStub(channel)

        def call() -> None:
            try:
                outcome.append(
                    stub.ForgetUser(pb.ForgetUserRequest(user_id="ada"), timeout=CALL_SECONDS)
                )
            except grpc.RpcError as error:
                outcome.append(error.code())

        with kill_point(db, when) as due:
            caller = threading.Thread(target=call)
            caller.start()

            def started() -> bool:
                if due():
                    return True
                assert not outcome, "the call ended before its transaction was seen"
                return False

            # A pause far shorter than the erasure: a busy loop would take a
            # core from the daemon it waits for.
            eventually(started, "the erasure starts", pause=0.002)
            daemon.process.send_signal(signal.SIGKILL)
        caller.join(WAIT_SECONDS)
        channel.close()
    finally:
        daemon.close()
    assert outcome == [grpc.StatusCode.UNAVAILABLE]

    store = Store(db)
    store.open()
    try:
        left, vectors, keys = left_of_ada(store)
        audited = store.erasure.audit_log()
        assert store.integrity_check() == "ok"
        state = store.usage(Scope("coder", "ada"), [Tier.USER])
    finally:
        store.close()
    # All or nothing: every entry and no audit row, or neither.
    found = (left, vectors, keys, len(audited))
    assert found in ((BIG, BIG, BIG, 0), (0, 0, 0, 1)), found
    assert state[Tier.USER].entry_count == left

    # The retry waits out the feeds' settle time (four heartbeats on
    # PostgreSQL) before it answers: a short heartbeat makes that short. (The
    # first daemon keeps the default: its long wait after the commit is what
    # lets a kill land before the call returns.)
    monkeypatch.setenv("MEMORY_SIDECAR_CHANGE_HEARTBEAT_MS", "100")
    daemon = spawn_daemon("--db", db, "--listen", "127.0.0.1:0")
    try:
        with grpc.insecure_channel(daemon.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            retried = stub.ForgetUser(
                pb.ForgetUserRequest(user_id="ada"), timeout=CALL_SECONDS
            ).erasure
            assert retried.memories == left
            scope = pb.Scope(agent_id="coder", user_id="ada")
            assert not stub.GetMemories(
                pb.GetMemoriesRequest(scope=scope), timeout=CALL_SECONDS
            ).memories
            bob = pb.Scope(agent_id="coder", user_id="bob")
            assert (
                len(
                    stub.GetMemories(
                        pb.GetMemoriesRequest(scope=bob), timeout=CALL_SECONDS
                    ).memories
                )
                == 1
            )
    finally:
        daemon.close()
