"""What only PostgreSQL has: a lost listener, replicas migrating together,
passwords, and a server that cannot be reached."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from sidecar.config import settings as config_mod
from sidecar.core.errors import ConfigError
from sidecar.core.memory import Scope, Tier
from sidecar.core.metrics import Metrics
from sidecar.domain.engine import MemoryEngine
from sidecar.storage import archive
from sidecar.storage._pg_listener import NotifyListener
from sidecar.storage._postgres import LISTENER_NAME, redacted
from sidecar.storage.schema import SCHEMA_VERSION
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry, TierPolicy
from tests import pg
from tests.conftest import MakeSidecar, Running, eventually, run_sidecar
from tests.test_replicas import SCOPE, shown


@pytest.fixture
def backend() -> str:
    return "postgresql"


def feed_sample(running: Running, name: str) -> float:
    value = running.sidecar.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_a_killed_listener_reconnects_and_catches_up(
    make_sidecar: MakeSidecar, postgres: pg.Cluster
) -> None:
    a, b = make_sidecar(), make_sidecar()
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: shown(b, "s", "uses uv"), "B shows A's write")
    assert feed_sample(b, "memory_change_feed_connects_total") == 1

    stop = threading.Event()
    written: list[str] = []

    def writer() -> None:
        n = 0
        while not stop.is_set() and n < 400:
            a.add(f"fact number {n}", scope=SCOPE)
            written.append(f"fact number {n}")
            n += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        eventually(lambda: len(written) >= 5, "writes are under way")
        database = a.db.split("/")[-1].split("?")[0]
        killed = postgres.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            f" WHERE application_name = '{LISTENER_NAME}' AND datname = '{database}'"
        )
        assert len(killed) == 2  # both daemons' listeners
        eventually(lambda: len(written) >= 40, "writes go on meanwhile")
    finally:
        stop.set()
        thread.join()
    eventually(
        lambda: feed_sample(b, "memory_change_feed_connects_total") == 2, "B's listener reconnects"
    )
    assert feed_sample(b, "memory_change_feed_failures_total") >= 1
    last = written[-1]
    eventually(lambda: last in b.turn("s", scope=SCOPE).system_block, "B catches up")
    block = b.turn("s", scope=SCOPE).system_block
    assert all(fact in block for fact in written)
    eventually(lambda: feed_sample(b, "memory_change_feed_verified") == 1, "B trusts caches again")
    before = b.db_queries()
    assert b.turn("s", scope=SCOPE).cache_hit
    assert b.db_queries() == before


def test_without_a_live_feed_every_turn_checks_the_database(
    postgres: pg.Cluster, tmp_path: Path
) -> None:
    """An unverified feed (never connected here) never lets a stale cache be served."""
    dsn = postgres.new_database()
    cfg = config_mod.load(flags={"db": dsn})
    writer = Store(dsn)
    writer.open()
    metrics = Metrics(CollectorRegistry())
    reader_store = Store(dsn, on_query=metrics.db_query)
    engine = MemoryEngine(cfg, reader_store, metrics=metrics, changes=True)
    feed = engine.inside().feed
    assert feed is not None
    assert not feed.verified
    scope, policy = Scope("coder", "ada"), TierPolicy(2200)
    try:
        assert engine.inject(scope, "s").system_block == ""
        for n in range(3):
            writer.add(NewEntry(scope, Tier.MEMORY, f"note {n}"), policy)
            # No feed delivered anything, yet the very next turn shows it.
            assert f"note {n}" in engine.inject(scope, "s").system_block
        gone = writer.list_memories(scope, [Tier.MEMORY])[0][0]
        writer.delete(scope, gone.id)
        assert "note 0" not in engine.inject(scope, "s").system_block
        assert [m.content for m, _ in engine.search(scope, "note", [Tier.MEMORY], limit=5)] == [
            "note 1",
            "note 2",
        ]
        selects = metrics.registry.get_sample_value(
            "memory_db_queries_total", {"operation": "select"}
        )
        engine.inject(scope, "s")
        after = metrics.registry.get_sample_value(
            "memory_db_queries_total", {"operation": "select"}
        )
        assert after is not None
        assert selects is not None
        assert after > selects
    finally:
        writer.close()
        reader_store.close()


def test_a_listener_gone_quiet_is_unverified_after_three_heartbeats() -> None:
    """A heartbeat that never comes back (a silently dead server) marks the feed unverified."""
    now = [100.0]
    heard: list[tuple[str, str, int, int]] = []

    class Quiet:
        """A connection whose heartbeat never returns in time: it raises."""

        def execute(self, sql: str) -> None:
            if sql == "SELECT 1":
                raise OSError("no answer from the server")

        def notifies(self, timeout: float) -> list[object]:
            now[0] += timeout
            return []

        def cursor(self) -> Quiet:
            return self

        def __enter__(self) -> Quiet:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def stream(self, sql: str) -> list[tuple[str, str, int, int]]:
            return [("coder", "memory", 7, 0)]

        def close(self) -> None:
            return None

    feed = NotifyListener(
        Quiet,
        lambda *news: heard.append(news),
        heartbeat=1.0,
        publish=lambda payload: None,
        clock=lambda: now[0],
    )
    feed.run_once()  # connects, LISTENs, re-reads every state row
    assert feed.verified
    assert heard == [("coder", "memory", 7, 0)]
    now[0] += 2.8  # three heartbeats after the first cycle began (its wait took 0.1)
    assert feed.verified
    feed.run_once()  # the heartbeat is due, and fails
    assert not feed.verified
    assert feed.failures == 1
    feed.run_once()  # reconnects and catches up
    assert feed.verified
    assert feed.connects == 2
    assert heard == [("coder", "memory", 7, 0)] * 2


def test_replicas_starting_together_migrate_once(postgres: pg.Cluster) -> None:
    dsn = postgres.new_database()
    stores = [Store(dsn) for _ in range(6)]
    start = threading.Barrier(len(stores))

    def open_store(store: Store) -> int:
        start.wait()
        return store.open()

    with ThreadPoolExecutor(max_workers=len(stores)) as pool:
        versions = list(pool.map(open_store, stores))
    for store in stores:
        store.close()
    assert versions == [SCHEMA_VERSION] * len(stores)
    assert postgres.sql("SELECT version FROM schema_version", dsn.split("/")[-1].split("?")[0]) == [
        (SCHEMA_VERSION,)
    ]


def _role_database(postgres: pg.Cluster, password: str) -> tuple[str, str]:
    """A database owned by a role that must log in with this password."""
    dsn, _, role = postgres.owned_database(password)
    return dsn, role


def test_the_password_comes_from_a_file_and_never_shows(
    postgres: pg.Cluster, tmp_path: Path, make_sidecar: MakeSidecar
) -> None:
    password = "correct horse battery staple"
    dsn, _role = _role_database(postgres, password)
    secret = tmp_path / "password"
    secret.write_text(password + "\n")
    running = make_sidecar(db=dsn, db_password_file=str(secret))
    assert running.add("The repo uses uv", scope=SCOPE).created
    assert password not in repr(running.sidecar.config)
    assert password not in running.store.path

    # The same through the environment, and a wrong one refused with a clear message.
    env_ok = run_sidecar("check", "--db", dsn, env=_env({"MEMORY_SIDECAR_DB_PASSWORD": password}))
    assert env_ok.returncode == 0, env_ok.stderr
    wrong = run_sidecar("check", "--db", dsn, env=_env({"MEMORY_SIDECAR_DB_PASSWORD": "nope"}))
    assert wrong.returncode != 0
    assert "password authentication failed" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    assert "nope" not in wrong.stderr


def _env(extra: dict[str, str]) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMORY_SIDECAR_")}
    return {**env, **extra}


def test_a_password_in_the_dsn_is_redacted_in_the_log(postgres: pg.Cluster) -> None:
    dsn, role = _role_database(postgres, "s3cret-pw")
    with_password = dsn.replace(f"{role}@", f"{role}:s3cret-pw@")
    assert "s3cret-pw" not in redacted(with_password)
    assert redacted(with_password).startswith(f"postgresql://{role}:***@/")
    assert "s3cret" not in redacted("postgresql://u@h/db?password=s3cret&sslmode=require")

    from tests.conftest import spawn_daemon

    daemon = spawn_daemon("--db", with_password, "--listen", "127.0.0.1:0")
    try:
        assert any("serving" in line for line in daemon.log)
        assert not any("s3cret-pw" in line for line in daemon.log)
    finally:
        daemon.close()
    assert not any("s3cret-pw" in line for line in daemon.log)


def test_an_unreachable_server_is_a_one_line_error(tmp_path: Path) -> None:
    dsn = f"postgresql://memory@/memory?host={tmp_path / 'nowhere'}"
    # Start-up waits for it (tests/ops/test_startup.py), here for a second.
    env = _env({"MEMORY_SIDECAR_STARTUP_TIMEOUT_SECONDS": "1"})
    result = run_sidecar("serve", "--db", dsn, "--listen", "127.0.0.1:0", env=env)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("memory-sidecar: DATABASE_UNAVAILABLE: gave up after 1 s"), last
    assert "cannot reach the database" in last
    assert "Traceback" not in result.stderr


def test_a_password_needs_a_dsn(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("x")
    with pytest.raises(ConfigError, match=r"needs server\.db to be a postgresql"):
        config_mod.load(flags={"db": str(tmp_path / "m.db"), "db_password_file": str(secret)})
    secret.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        config_mod.load(flags={"db": "postgresql://u@h/db", "db_password_file": str(secret)})
    with pytest.raises(ConfigError, match="in the file or in"):
        config_mod.load(
            environ={"MEMORY_SIDECAR_DB_PASSWORD": "x"},
            flags={"db": "postgresql://u@h/db", "db_password_file": str(tmp_path / "password")},
        )


def test_backup_points_at_pg_dump(make_sidecar: MakeSidecar, tmp_path: Path) -> None:
    running = make_sidecar()
    result = run_sidecar("backup", str(tmp_path / "copy.db"), "--db", running.db)
    assert result.returncode != 0
    assert "pg_dump" in result.stderr


def test_busy_partitions_answer_unavailable(
    make_sidecar: MakeSidecar, postgres: pg.Cluster
) -> None:
    """A row lock held past the busy timeout is DATABASE_BUSY, not INTERNAL."""
    running = make_sidecar(busy_timeout_ms=200)
    running.add("The repo uses uv", scope=SCOPE)
    import psycopg

    from tests.conftest import error_info, refused

    with psycopg.connect(running.db) as holder:
        holder.execute(
            "SELECT 1 FROM tier_state WHERE owner = 'coder' AND tier = 'memory' FOR UPDATE"
        )
        error = refused(running.add, "Deploys go through ArgoCD", scope=SCOPE)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(error).reason == "DATABASE_BUSY"
    assert [m.content for m in running.list(scope=SCOPE).memories] == ["The repo uses uv"]


def test_the_duplicate_check_uses_its_index_after_a_bulk_load(postgres: pg.Cluster) -> None:
    # Without statistics the planner's generic plan for "first entry with
    # this digest" walked the partition in seq order: 1 ms per write at
    # 10,000 entries. A bulk load refreshes the statistics.
    from datetime import UTC, datetime

    from sidecar.core.memory import Memory

    dsn = postgres.new_database()
    store = Store(dsn)
    store.open()
    now = datetime.now(UTC)
    archive.restore(
        store,
        (
            ("big", Memory(f"m{i}", Tier.MEMORY, f"fact {i}", "", 0.5, now, now))
            for i in range(10_000)
        ),
    )
    store.close()
    database = dsn.split("/")[-1].split("?")[0]
    query = (
        "SELECT seq FROM memories WHERE owner = $1 AND tier = $2"
        " AND content_sha256 = $3 AND content = $4 ORDER BY seq LIMIT 1"
    )
    import psycopg

    with psycopg.connect(postgres.dsn(database), autocommit=True) as connection:
        connection.execute("SET plan_cache_mode = force_generic_plan")
        connection.execute(f"PREPARE identical(text, text, text, text) AS {query}")
        plan = "\n".join(
            row[0]
            for row in connection.execute(
                "EXPLAIN EXECUTE identical('big', 'memory', 'x', 'x')"
            ).fetchall()
        )
    assert "idx_memories_content" in plan, plan


def test_a_listener_that_reconnects_lets_frozen_sessions_take_the_current_view(
    make_sidecar: MakeSidecar, postgres: pg.Cluster
) -> None:
    """Session events sent while a listener was away are lost with its
    connection: after the reconnect every session takes the current view
    once, as if it had heard a compaction."""
    frozen = "defaults: {snapshot_refresh: on_compaction}\n"
    a, b = make_sidecar(frozen), make_sidecar(frozen)
    a.add("The repo uses uv", scope=SCOPE)
    eventually(lambda: shown(b, "s", "uses uv"), "B shows A's write")
    a.add("Deploys go through ArgoCD", scope=SCOPE)
    # A new session each time: one that asked before B heard of the write
    # stays frozen on what it saw (on_compaction), however long one waits.
    new_sessions = (f"t{n}" for n in itertools.count())
    eventually(
        lambda: "ArgoCD" in b.turn(next(new_sessions), scope=SCOPE).system_block,
        "B has A's write",
    )
    assert "ArgoCD" not in b.turn("s", scope=SCOPE).system_block  # frozen

    database = b.db.split("/")[-1].split("?")[0]
    postgres.sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        f" WHERE application_name = '{LISTENER_NAME}' AND datname = '{database}'"
    )
    eventually(
        lambda: feed_sample(b, "memory_change_feed_connects_total") == 2, "B's listener reconnects"
    )
    eventually(lambda: feed_sample(b, "memory_change_feed_verified") == 1, "B trusts caches again")
    turn = b.turn("s", scope=SCOPE)
    assert "ArgoCD" in turn.system_block
    # Then frozen again until the next compaction.
    assert b.turn("s", scope=SCOPE).cache_hit


def test_a_fence_sent_while_the_listener_reconnects_is_proved() -> None:
    """A fence sent before the new connection LISTENs is lost with its
    notification: the re-read after the LISTENs must prove it."""
    sent: list[str] = []

    class Deaf:
        """A connection that hears nothing (what was sent before LISTEN)."""

        def execute(self, sql: str) -> None:
            return None

        def notifies(self, timeout: float) -> list[object]:
            return []

        def cursor(self) -> Deaf:
            return self

        def __enter__(self) -> Deaf:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def stream(self, sql: str) -> list[tuple[str, str, int, int]]:
            return []

        def close(self) -> None:
            return None

    tickets: list[int] = []

    def connect() -> Deaf:
        # A read's fence, sent while the connection is being opened.
        tickets.append(feed.fence())
        return Deaf()

    feed = NotifyListener(connect, lambda *news: None, heartbeat=1.0, publish=sent.append)
    feed.run_once()
    assert sent
    assert tickets == [1]
    assert feed.wait(tickets[0], 0, timeout=0)
