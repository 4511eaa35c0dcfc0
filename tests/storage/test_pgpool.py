"""PostgreSQL's connection slots, contested: replicas give back what they do
not use, the change feed's listener always comes back, and a call that
finds no free slot says so (DATABASE_BUSY), as the expiry sweep does in one
WARNING line.

A dedicated cluster with max_connections 20: 17 slots for the sidecars'
role, 3 reserved for the superuser, through which the test watches
pg_stat_activity. The waits are liveness bounds, never timing claims.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests import pg
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    Running,
    WallClock,
    error_info,
    refused,
    require_tool,
    start_sidecar,
    stop_sidecar,
)
from tests.conftest import eventually as conftest_eventually
from tests.ops.test_startup import InProcess
from tests.test_background_faults import assert_one_line_each, warnings_of

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
PASSWORD = "slots"
SLOTS = 17  # max_connections 20, less superuser_reserved_connections 3
BOUND_SECONDS = WAIT_SECONDS
# Writes under load keep succeeding (and holding their tier's row lock).
BIG_TIERS = "defaults: {memory_char_limit: 10000000}"
POOLED = "memory-sidecar"
LISTENER = "memory-sidecar-listener"


@pytest.fixture(scope="module")
def small() -> Iterator[pg.Cluster]:
    found = pg.bindir()
    require_tool(str(found) if found else None, "PostgreSQL (Debian's postgresql package)")
    assert found is not None
    cluster = pg.Cluster(found, max_connections=SLOTS + 3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def database(cluster: pg.Cluster) -> tuple[str, str]:
    """A fresh database owned by an ordinary role (no reserved slots); its
    DSN and name."""
    dsn, name, _ = cluster.owned_database(PASSWORD)
    return dsn, name


def superuser(cluster: pg.Cluster, statement: str) -> list[tuple[object, ...]]:
    """The statement's rows, through the reserved slots. Connections being
    refused hold a slot each for a moment, so even the reserved ones can be
    briefly all taken ("too many clients"): try again."""
    import psycopg

    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        try:
            return cluster.sql(statement)
        except psycopg.OperationalError:
            time.sleep(0.05)
    return cluster.sql(statement)


def backends(cluster: pg.Cluster, name: str, application: str) -> int:
    rows = superuser(
        cluster,
        "SELECT count(*) FROM pg_stat_activity"
        f" WHERE datname = '{name}' AND application_name = '{application}'",
    )
    return int(str(rows[0][0]))


def taken(cluster: pg.Cluster) -> int:
    """Slots held by ordinary roles, everything the sidecars can use."""
    rows = superuser(
        cluster,
        "SELECT count(*) FROM pg_stat_activity a JOIN pg_roles r ON r.rolname = a.usename"
        " WHERE NOT r.rolsuper AND a.backend_type = 'client backend'",
    )
    return int(str(rows[0][0]))


def grab(dsn: str) -> list[Any]:
    """Every slot free at the moment, held (as another client would)."""
    import psycopg

    held: list[Any] = []
    while True:
        try:
            held.append(psycopg.connect(dsn, password=PASSWORD, autocommit=True))
        except psycopg.OperationalError:
            return held


def eventually(check: Callable[[], bool], what: str) -> None:
    conftest_eventually(check, what, within=BOUND_SECONDS, pause=0.1)


def replica(tmp_path: Path, dsn: str, index: int, yaml_text: str = "", **server: Any) -> Running:
    return start_sidecar(
        tmp_path / f"replica-{index}.db",
        yaml_text,
        environ={"MEMORY_SIDECAR_DB_PASSWORD": PASSWORD},
        db=dsn,
        **server,
    )


def serves(running: Running, text: str) -> bool:
    return text in running.turn("s", "anything", scope=SCOPE).system_block


@pytest.fixture
def replicas(small: pg.Cluster, tmp_path: Path) -> Iterator[tuple[list[Running], str, str]]:
    """Three replicas on one fresh database; its name and DSN."""
    dsn, name = database(small)
    started: list[Running] = []
    try:
        for i in range(3):
            started.append(replica(tmp_path, dsn, i, BIG_TIERS, db_pool_idle_seconds=1))
        yield started, name, dsn
    finally:
        for running in started:
            stop_sidecar(running)


def test_listeners_come_back_and_idle_slots_are_given_back_under_contention(
    small: pg.Cluster, replicas: tuple[list[Running], str, str]
) -> None:
    started, name, dsn = replicas
    hogs: list[Any] = []
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def writer(running: Running, n: int) -> None:
        # Eight tiers, each written through every replica: a replica writes
        # them in parallel, and writers queue on each tier's row lock across
        # replicas, holding a connection meanwhile, so the pools grow until
        # the server is full.
        scope = pb.Scope(agent_id=f"agent-{n // 3}", user_id="ada")
        i = 0
        while not stop.is_set():
            i += 1
            try:
                running.add(f"fact {n}-{i}", scope=scope, timeout=CALL_SECONDS)
                outcome = "ok"
            except grpc.RpcError as error:
                outcome = error_info(error).reason
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

    threads = [
        threading.Thread(target=writer, args=(running, n), daemon=True)
        for n, running in enumerate(started * 8)
    ]
    try:
        for thread in threads:
            thread.start()
        eventually(lambda: taken(small) >= SLOTS, "the replicas take every slot")
        assert backends(small, name, LISTENER) == 3

        # The reproduction: the listeners dropped while the slots
        # are contested, and the ones they held taken by someone else.
        superuser(
            small,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            f" WHERE application_name = '{LISTENER}'",
        )
        hogs.extend(grab(dsn))
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_SECONDS)
        for held in hogs:
            held.close()
    try:
        eventually(
            lambda: backends(small, name, LISTENER) == 3,
            f"every listener reconnects ({outcomes}; {len(hogs)} slots taken by others)",
        )
    finally:
        for hog in hogs:
            hog.close()

    # Idle, each replica gives its pool's slots back (the listeners stay).
    eventually(
        lambda: backends(small, name, POOLED) == 0,
        "idle pool connections are closed after db_pool_idle_seconds",
    )
    assert backends(small, name, LISTENER) == 3
    # And the feeds are live again: what one replica writes, the others serve.
    started[0].add("The repo uses uv", scope=SCOPE)
    eventually(lambda: serves(started[1], "uses uv"), "replica 2 serves the write")
    eventually(lambda: serves(started[2], "uses uv"), "replica 3 serves the write")


def test_a_call_that_finds_no_free_slot_is_database_busy(small: pg.Cluster, tmp_path: Path) -> None:

    dsn, name = database(small)
    running = replica(tmp_path, dsn, 0, db_pool_idle_seconds=0.2, change_heartbeat_ms=100)
    hogs: list[Any] = []
    try:
        eventually(lambda: backends(small, name, POOLED) == 0, "the pool is empty")
        # Someone else takes every slot left.
        hogs.extend(grab(dsn))
        assert taken(small) == SLOTS

        error = refused(running.add, "The repo uses uv", scope=SCOPE)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(error).reason == "DATABASE_BUSY", error.details()
        assert "no free connection slot" in (error.details() or "")

        # A slot comes free: so do calls. (The server frees it when the
        # closed connection's backend has exited, a moment after the close.)
        hogs.pop().close()
        eventually(lambda: taken(small) < SLOTS, "the closed connection's slot is free")
        assert running.add("The repo uses uv", scope=SCOPE).created
    finally:
        for hog in hogs:
            hog.close()
        stop_sidecar(running)


def test_the_expiry_sweep_that_finds_no_free_slot_warns_in_one_line_and_sweeps_later(
    small: pg.Cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sidecar")
    clock = WallClock()
    dsn, name = database(small)
    # Sweeps far apart next to how long the pool keeps a connection idle
    # (the listener's heartbeat closes it): each pass needs a slot anew.
    running = replica(
        tmp_path,
        dsn,
        0,
        clock=clock,
        db_pool_idle_seconds=0.2,
        change_heartbeat_ms=100,
        expiry_sweep_seconds=1,
        expiry_grace_seconds=0,
    )
    hogs: list[Any] = []

    def failed_twice() -> bool:
        # Someone else takes every slot free, again as the pool gives its back.
        hogs.extend(grab(dsn))
        return len(warnings_of(caplog, "sidecar.server")) >= 2

    try:
        running.add("The staging cluster is down today", scope=SCOPE, ttl_seconds=1)
        eventually(lambda: backends(small, name, POOLED) == 0, "the pool is empty")
        clock.move(2)
        # Two failed passes: the loop went on after the first.
        eventually(failed_twice, "two warnings")
        assert_one_line_each(warnings_of(caplog, "sidecar.server"), "expiry sweep", "no free")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        for hog in hogs:
            hog.close()
        hogs.clear()
        # Slots free again, a later pass removes the row.
        eventually(
            lambda: not running.list(scope=SCOPE, include_expired=True).memories,
            "the sweep removes it",
        )
    finally:
        for hog in hogs:
            hog.close()
        stop_sidecar(running)


def test_the_pool_closes_what_stayed_idle_and_holds_for_the_listener(small: pg.Cluster) -> None:
    from playhouse.pool import MaxConnectionsExceeded

    from sidecar.storage._pgpool import Pool

    dsn, name = database(small)
    now = [0.0]
    pool = Pool(
        dsn,
        max_connections=4,
        idle_seconds=10,
        timeout=1,
        clock=lambda: now[0],
        password=PASSWORD,
        application_name=POOLED,
    )
    together = threading.Barrier(3)

    def call() -> None:
        with pool.connection_context():
            pool.execute_sql("SELECT 1")
            together.wait(WAIT_SECONDS)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    together.wait(WAIT_SECONDS)
    for thread in threads:
        thread.join(WAIT_SECONDS)
    assert pool.idle_count() == 2
    assert backends(small, name, POOLED) == 2

    now[0] = 9.0
    assert pool.reap() == 0
    now[0] = 10.5
    assert pool.reap() == 2
    eventually(lambda: backends(small, name, POOLED) == 0, "the idle connections are closed")

    # Held for the listener: no new connection (a call waits, then fails).
    assert pool.make_room() == 0
    with pytest.raises(MaxConnectionsExceeded):
        pool.connect()
    pool.release()
    with pool.connection_context():
        assert pool.execute_sql("SELECT 1").fetchone() == (1,)
    pool.close_all()


def test_the_pool_hands_the_listener_an_idle_connection_or_the_next_checked_in(
    small: pg.Cluster,
) -> None:
    from sidecar.storage._pgpool import Pool

    dsn, name = database(small)
    pool = Pool(
        dsn,
        max_connections=4,
        idle_seconds=60,
        timeout=1,
        password=PASSWORD,
        application_name=POOLED,
    )
    # None in use, none idle: nothing to wait for.
    assert pool.surrender(BOUND_SECONDS) is None

    with pool.connection_context():
        pool.execute_sql("SELECT 1")
    idle = pool.surrender(BOUND_SECONDS)
    assert idle is not None
    assert pool.idle_count() == 0
    idle.close()

    # In use by a call: the listener gets it when the call checks it in,
    # and no other call gets a connection meanwhile.
    checked_out = threading.Event()
    check_in = threading.Event()
    handed: list[Any] = []

    def call() -> None:
        with pool.connection_context():
            pool.execute_sql("SELECT 1")
            checked_out.set()
            check_in.wait(BOUND_SECONDS)

    def claim() -> None:
        handed.append(pool.surrender(BOUND_SECONDS))

    caller = threading.Thread(target=call)
    caller.start()
    assert checked_out.wait(BOUND_SECONDS)
    claimer = threading.Thread(target=claim)
    claimer.start()
    eventually(pool.would_wait, "the pool is held for the listener")
    check_in.set()
    caller.join(BOUND_SECONDS)
    claimer.join(BOUND_SECONDS)
    assert handed[0] is not None
    assert not handed[0].closed
    assert handed[0].execute("SELECT 1").fetchone() == (1,)
    assert pool.idle_count() == 0
    assert not pool.would_wait()
    handed[0].close()
    eventually(lambda: backends(small, name, POOLED) == 0, "the handed connection closed")
    pool.close_all()


def test_a_listener_that_finds_no_slot_at_start_up_lets_the_pool_go(
    small: pg.Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import psycopg

    from sidecar.storage._pgpool import Pool
    from sidecar.storage._postgres import PostgresBackend

    dsn, name = database(small)
    real = PostgresBackend._listener_connect
    # The listener's first connect and the one after make_room both find no
    # slot (another process took the ones the pool gave back), and the pool
    # has no connection to hand over: start() fails with the pool held, and
    # the next attempt's open needs it.
    refusals = [2]
    monkeypatch.setattr(Pool, "surrender", lambda pool, timeout: None)

    def connect(backend: PostgresBackend, heartbeat: float) -> Any:
        if refusals[0]:
            refusals[0] -= 1
            raise psycopg.OperationalError("connection failed: FATAL:  sorry, too many clients")
        return real(backend, heartbeat)

    monkeypatch.setattr(PostgresBackend, "_listener_connect", connect)
    running = InProcess(dsn, db_password=PASSWORD, startup_timeout_seconds="15")
    served = running.serving()
    listeners = backends(small, name, LISTENER) if served else 0
    outcome = running.end()
    assert served, outcome
    assert outcome == 0
    assert "database not ready (DATABASE_BUSY: the database server has no free" in caplog.text
    assert listeners == 1


def test_session_events_are_not_broadcast_at_once_while_the_pool_is_held(
    small: pg.Cluster, tmp_path: Path
) -> None:
    # A pool timeout far beyond the calls' deadlines: waiting it out would be
    # DEADLINE_EXCEEDED, not an answer.
    dsn, _ = database(small)
    running = replica(tmp_path, dsn, 0, busy_timeout_ms=600_000)
    try:
        pool = running.store._db

        def held_empty() -> bool:
            # What the listener does when it finds no free slot; held with
            # none in use, no connection can come back idle meanwhile.
            pool.make_room()
            with pool._pool_lock:
                return not pool._in_use and pool.idle_count() == 0

        eventually(held_empty, "the pool is held with no connection")
        compaction = running.stub.NotifyCompaction(
            pb.NotifyCompactionRequest(session_id="s", scope=SCOPE), timeout=CALL_SECONDS
        )
        assert not compaction.broadcast
        ended = running.stub.EndSession(
            pb.EndSessionRequest(session_id="s", scope=SCOPE), timeout=CALL_SECONDS
        )
        assert not ended.broadcast

        pool.release()
        compaction = running.stub.NotifyCompaction(
            pb.NotifyCompactionRequest(session_id="s", scope=SCOPE), timeout=CALL_SECONDS
        )
        assert compaction.broadcast
    finally:
        stop_sidecar(running)


def test_listeners_get_back_in_while_sixty_writers_keep_every_slot_taken(
    small: pg.Cluster, replicas: tuple[list[Running], str, str]
) -> None:
    # Issue 34: at the default pool size, 60 writers keep every slot busy;
    # a listener that drops meanwhile must get back in before they stop.
    started, name, dsn = replicas
    stop = threading.Event()
    done = [0]
    lock = threading.Lock()
    hogs: list[Any] = []

    def hog() -> None:
        # Another client (another replica's pool, say) takes every slot
        # the moment it comes free, for as long as the writers write.
        while not stop.is_set():
            hogs.extend(grab(dsn))
            stop.wait(0.01)

    def writer(running: Running, n: int) -> None:
        scope = pb.Scope(agent_id=f"agent-{n // 3}", user_id="ada")
        i = 0
        while not stop.is_set():
            i += 1
            with contextlib.suppress(grpc.RpcError):
                running.add(f"fact {n}-{i}", scope=scope, timeout=CALL_SECONDS)
                with lock:
                    done[0] += 1

    def writes() -> int:
        with lock:
            return done[0]

    def terminate_listeners() -> None:
        superuser(
            small,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            f" WHERE datname = '{name}' AND application_name = '{LISTENER}'",
        )

    def shown(running: Running, text: str) -> bool:
        try:
            return serves(running, text)
        except grpc.RpcError:  # DATABASE_BUSY: the writers hold every slot
            return False

    def added(running: Running, text: str) -> bool:
        try:
            running.add(text, scope=SCOPE, timeout=CALL_SECONDS)
        except grpc.RpcError:
            return False
        return True

    a, b = started[0], started[1]
    threads = [
        threading.Thread(target=writer, args=(running, n), daemon=True)
        for n, running in enumerate(started * 20)
    ]
    try:
        for thread in threads:
            thread.start()
        eventually(lambda: taken(small) >= SLOTS, "the writers take every slot")
        threads.append(threading.Thread(target=hog, daemon=True))
        threads[-1].start()
        for attempt in range(2):
            terminate_listeners()
            eventually(
                lambda: backends(small, name, LISTENER) == 3,
                f"every listener is back while the slots stay taken (round {attempt + 1})",
            )
            assert not stop.is_set()
        before = writes()
        eventually(lambda: added(a, "The repo uses uv"), "A takes a write")
        eventually(lambda: shown(b, "uses uv"), "B's frozen block shows A's write")
        # Still saturated: the writers kept writing meanwhile.
        eventually(lambda: writes() > before, "the writers keep writing")
        assert taken(small) >= SLOTS
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_SECONDS)
        for held in hogs:
            held.close()
