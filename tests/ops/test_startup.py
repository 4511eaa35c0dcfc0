"""Start-up against a database that is not there yet: the daemon listens,
answers NOT_SERVING and waits (sidecar.ops.startup), and fails at once, in one
line with a reason, on what waiting cannot mend."""

from __future__ import annotations

import functools
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.api.server import Sidecar
from sidecar.config import settings
from sidecar.core.errors import (
    ConfigError,
    DatabaseBusy,
    DatabaseIOError,
    DatabaseReadOnly,
    DatabaseRefused,
    DatabaseUnavailable,
    DataLoss,
    StoreError,
    Unavailable,
)
from sidecar.core.metrics import Metrics
from sidecar.ops.daemon import open_store, serve
from sidecar.ops.startup import Backoff, transient, wait_for_database
from sidecar.storage.changes import ChangeFeed
from sidecar.storage.store import Store
from tests import pg
from tests.conftest import (
    CALL_SECONDS,
    START_SECONDS,
    WAIT_SECONDS,
    Daemon,
    error_info,
    eventually,
    refused,
    require_tool,
    run_sidecar,
    sqlite_file,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_LISTENING = re.compile(r"listening api=(\S+) health=(\S+) metrics=(\S+) mcp=(\S+);")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        return int(stub.Check(request, timeout=CALL_SECONDS).status)


@pytest.fixture
def waiting() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.close()


@pytest.fixture
def bindir() -> Path:
    found = pg.bindir()
    require_tool(str(found) if found else None, "PostgreSQL (Debian's postgresql package)")
    assert found is not None
    return found


def failed_at_once(stderr: str) -> str:
    """The one line a start-up failure ends with, checking it was not
    retried (nor waited for: no "listening" line, no traceback)."""
    assert "database not ready" not in stderr
    assert "listening api=" not in stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    # Log lines before it (sidecar.core.tokens says how it counts) start with a time.
    assert not lines[-1][:1].isdigit(), stderr
    return lines[-1]


def environ(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMORY_SIDECAR_")}
    env.update({f"MEMORY_SIDECAR_{k.upper()}": v for k, v in settings.items()})
    return env


def mcp_post(url: str, token: str) -> tuple[int, dict[str, Any]]:
    """An MCP initialize request: the HTTP status and the JSON body."""
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.netloc, timeout=CALL_SECONDS)
    try:
        hello = {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"},
        }
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello})
        headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
        }
        connection.request("POST", address.path, body, headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def test_waits_not_serving_for_postgresql_then_serves(
    bindir: Path, waiting: list[Daemon], tmp_path: Path
) -> None:
    # A cluster initialised but not started: nothing listens on its port yet.
    cluster = pg.Cluster(bindir, port=free_port())
    cluster.init()
    token_file = tmp_path / "token"
    token_file.write_text("old-token\n")
    old = [("authorization", "Bearer old-token")]
    new = [("authorization", "Bearer new-token")]
    try:
        daemon = Daemon(
            *("--db", cluster.tcp_dsn(), "--listen", "127.0.0.1:0"),
            *("--health-listen", "127.0.0.1:0", "--mcp-listen", "127.0.0.1:0"),
            *("--auth-token-file", str(token_file)),
            # The watcher never comes round while the test runs: the
            # rotation below counts from SERVING all the same.
            env=environ(auth_reload_seconds="3600"),
        )
        waiting.append(daemon)
        api, health_address, _, mcp = daemon.until(_LISTENING.pattern).groups()
        daemon.until("database not ready \\(DATABASE_UNAVAILABLE")
        # Both listeners answer: NOT_SERVING, for the server and the service.
        for address in (health_address, api):
            assert health(address) == NOT_SERVING
            assert health(address, "memory.v1.MemoryService") == NOT_SERVING
        # The MCP listener answers too, refusing as the API does.
        status, answer = mcp_post(mcp, "old-token")
        assert status == 503, answer
        assert answer["error"]["data"]["reason"] == "DATABASE_UNAVAILABLE", answer
        assert "waits for its database" in answer["error"]["message"]
        assert mcp_post(mcp, "wrong-token")[0] == 401  # the token first, as on the API
        # The API says why, with the reason a client retries on.
        with grpc.insecure_channel(api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            add = functools.partial(stub.AddMemory, metadata=old)
            error = refused(add, pb.AddMemoryRequest(content="early"), timeout=CALL_SECONDS)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(error).reason == "DATABASE_UNAVAILABLE"
            assert "waits for its database" in (error.details() or "")
            assert "Connection refused" in (error.details() or "")  # what the last attempt met
            stream = stub.ExportMemories(
                pb.ExportMemoriesRequest(), timeout=CALL_SECONDS, metadata=old
            )
            error = refused(list, stream)
            assert error_info(error).reason == "DATABASE_UNAVAILABLE"

        # The token is rotated while the daemon waits (the old one revoked).
        token_file.write_text("new-token\n")
        cluster.serve()

        def serving() -> bool:
            if health(health_address) == SERVING:
                return True
            assert daemon.process.poll() is None, "\n".join(daemon.log)
            return False

        eventually(
            serving, lambda: "SERVING:\n" + "\n".join(daemon.log), within=START_SECONDS, pause=0.1
        )
        assert health(api, "memory.v1.MemoryService") == SERVING
        with grpc.insecure_channel(api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            request = pb.AddMemoryRequest(content="after")
            error = refused(stub.AddMemory, request, timeout=CALL_SECONDS, metadata=old)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.AddMemory(request, timeout=CALL_SECONDS, metadata=new).created
            listed = stub.GetMemories(
                pb.GetMemoriesRequest(), metadata=new, timeout=CALL_SECONDS
            ).memories
            assert [m.content for m in listed] == ["after"]
        status, answer = mcp_post(mcp, "new-token")
        assert status == 200, answer
        assert answer["result"]["serverInfo"], answer
        assert mcp_post(mcp, "old-token")[0] == 401
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait() == 0, "\n".join(daemon.log)
    finally:
        if (cluster.data / "postmaster.pid").exists():
            cluster.stop()
        else:
            shutil.rmtree(cluster.root, ignore_errors=True)


def test_gives_up_at_the_startup_timeout_in_one_line_with_the_reason() -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    result = run_sidecar(
        "serve", "--db", dsn, "--listen", "127.0.0.1:0", env=environ(startup_timeout_seconds="1")
    )
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("memory-sidecar: DATABASE_UNAVAILABLE: gave up after 1 s "), last
    assert "server.startup_timeout_seconds" in last
    assert "Connection refused" in last
    # It did wait: at least one attempt was retried.
    assert "database not ready" in result.stderr
    assert "Traceback" not in result.stderr


def test_sigterm_while_an_attempt_hangs_exits_cleanly(waiting: list[Daemon]) -> None:
    # A "server" that accepts and never answers: libpq waits for its greeting
    # up to the connect timeout (busy_timeout_ms: a minute here).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        daemon = Daemon(
            "--db",
            f"postgresql://postgres@127.0.0.1:{port}/postgres",
            "--listen",
            "127.0.0.1:0",
            env=environ(busy_timeout_ms="60000"),
        )
        waiting.append(daemon)
        silent.settimeout(START_SECONDS)
        connection, _ = silent.accept()  # the attempt is under way
        with connection:
            daemon.process.send_signal(signal.SIGTERM)
            # Well inside the attempt's minute.
            assert daemon.wait() == 0, "\n".join(daemon.log)
    assert any("stopped before the database was ready" in line for line in daemon.log)
    assert not any("Traceback" in line for line in daemon.log)


def test_sigterm_while_waiting_between_attempts_exits_cleanly(waiting: list[Daemon]) -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    daemon = Daemon("--db", dsn, "--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0")
    waiting.append(daemon)
    _, health_address, _, _ = daemon.until(_LISTENING.pattern).groups()
    assert health(health_address) == NOT_SERVING
    daemon.process.send_signal(signal.SIGTERM)
    assert daemon.wait() == 0, "\n".join(daemon.log)
    assert daemon.log[-1].endswith("stopped before the database was ready"), daemon.log


def test_a_refused_login_fails_at_once(postgres: pg.Cluster) -> None:
    postgres.sql("CREATE ROLE startup_role LOGIN PASSWORD 'right'")
    dsn = postgres.dsn(user="startup_role")
    result = run_sidecar(
        "serve", "--db", dsn, "--listen", "127.0.0.1:0", env=environ(db_password="wrong")
    )
    assert result.returncode == 1
    line = failed_at_once(result.stderr)
    assert line.startswith("memory-sidecar: DATABASE_UNAVAILABLE: cannot reach the database")
    assert "password authentication failed" in line
    assert "wrong" not in line


def test_a_schema_newer_than_the_code_fails_at_once(tmp_path: Path) -> None:
    db = tmp_path / "memory.db"
    store = Store(str(db))
    store.open()
    store.close()
    with sqlite_file(db) as conn:
        conn.execute("UPDATE schema_version SET version = 99")
    conn.close()
    result = run_sidecar("serve", "--db", str(db), "--listen", "127.0.0.1:0")
    assert result.returncode == 1
    line = failed_at_once(result.stderr)
    assert line.startswith("memory-sidecar: STORE_UNUSABLE: ")
    assert "newer than this memory-sidecar understands" in line


def test_a_negative_startup_timeout_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("server: {startup_timeout_seconds: -1}\n")
    with pytest.raises(ConfigError) as caught:
        settings.load(path, environ={})
    assert caught.value.key == "server.startup_timeout_seconds"
    result = run_sidecar("serve", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "memory-sidecar: config: server.startup_timeout_seconds: must be between 0 and 86400,"
        " got -1.0"
    )
    assert settings.Config().server.startup_timeout_seconds == 120


# --- the pieces -----------------------------------------------------------------


def test_what_waiting_can_mend() -> None:
    unreachable = DatabaseUnavailable("refused")
    assert transient(unreachable, "postgresql")
    assert transient(DatabaseBusy("locked"), "sqlite")
    read_only = DatabaseReadOnly("standby")
    assert transient(read_only, "postgresql")  # a standby, until promoted
    assert not transient(read_only, "sqlite")  # a file's mode
    assert not transient(DatabaseRefused("bad password"), "postgresql")
    assert not transient(DataLoss("damaged"), "sqlite")
    assert not transient(DatabaseIOError("a failing disk"), "sqlite")
    assert not transient(StoreError("newer schema"), "postgresql")
    assert not transient(ConfigError("server.db", "bad"), "postgresql")
    assert not transient(RuntimeError("a bug"), "postgresql")


def test_back_off_doubles_to_its_cap_with_jitter() -> None:
    backoff = Backoff(first=0.25, cap=5.0, rng=random.Random(7))
    delays = [backoff.delay() for _ in range(12)]
    steps = [0.25, 0.5, 1.0, 2.0, 4.0] + [5.0] * 7
    for delay, step in zip(delays, steps, strict=True):
        assert step / 2 <= delay <= step
    # Two replicas' delays differ.
    other = Backoff(first=0.25, cap=5.0, rng=random.Random(8))
    assert [other.delay() for _ in range(12)] != delays


def test_wait_for_database_retries_then_succeeds_and_raises_what_lasts() -> None:
    failures = [DatabaseUnavailable("down")] * 3
    told: list[str] = []

    def attempt() -> None:
        if failures:
            raise failures.pop()

    quick = Backoff(first=0.001, cap=0.001)
    stop = threading.Event()
    assert wait_for_database(
        attempt, backend="postgresql", timeout=0, stop=stop, waiting=told.append, backoff=quick
    )
    assert told == ["down"] * 3

    def lasting() -> None:
        raise DatabaseRefused("password authentication failed")

    with pytest.raises(DatabaseRefused):
        wait_for_database(lasting, backend="postgresql", timeout=0, stop=stop, backoff=quick)

    def down() -> None:
        raise DatabaseUnavailable("down")

    now = [0.0]

    def clock() -> float:
        now[0] += 10
        return now[0]

    with pytest.raises(Unavailable) as caught:
        wait_for_database(
            down, backend="postgresql", timeout=15, stop=stop, backoff=quick, clock=clock
        )
    assert caught.value.reason == "DATABASE_UNAVAILABLE"
    assert caught.value.message.startswith("gave up after 15 s")
    stop.set()
    assert not wait_for_database(down, backend="postgresql", timeout=0, stop=stop, backoff=quick)


# --- the daemon in this process (a fault injected) ---------------------------------


class InProcess:
    """daemon.serve() on a thread of this process, stopped by an event."""

    def __init__(self, db: str, **values: str) -> None:
        self.health = f"127.0.0.1:{free_port()}"
        flags = {"db": db, "listen": "127.0.0.1:0", "health_listen": self.health}
        self.config = settings.load(None, environ=environ(**values), flags=flags)
        self.stop = threading.Event()
        self.outcome: list[object] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.outcome.append(serve(self.config, stop=self.stop))
        except BaseException as exc:
            self.outcome.append(exc)

    def serving(self) -> bool:
        """Whether it reports SERVING (True) or serve() ends first (False);
        fails when neither happens within START_SECONDS."""

        def state() -> str | None:
            if not self._thread.is_alive():
                return "ended"
            try:
                if health(self.health) == SERVING:
                    return "serving"
            except grpc.RpcError:
                pass  # not listening yet
            return None

        settled = eventually(
            state, "serve() reports SERVING or ends", within=START_SECONDS, pause=0.05
        )
        return settled == "serving"

    def end(self) -> object:
        """Stop it; what serve() returned or raised."""
        self.stop.set()
        self._thread.join(WAIT_SECONDS)
        assert not self._thread.is_alive()
        return self.outcome[0]


def one_backend(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if backend == "postgresql":
        cluster: pg.Cluster = request.getfixturevalue("postgres")
        return cluster.new_database()
    return str(tmp_path / "memory.db")


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_passing_failure_to_connect_after_a_first_open_is_retried(
    backend: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The store opens at once; the change feed then finds no free slot once.
    real = ChangeFeed.start
    failures = [DatabaseBusy("no free connection slot")]

    def start(feed: ChangeFeed) -> None:
        if failures:
            raise failures.pop()
        real(feed)

    monkeypatch.setattr(ChangeFeed, "start", start)
    running = InProcess(one_backend(backend, request, tmp_path))
    assert running.serving(), running.outcome
    assert not failures
    assert "database not ready (DATABASE_BUSY: no free connection slot)" in caplog.text
    assert running.end() == 0


def test_a_login_the_listener_is_refused_fails_at_once(
    postgres: pg.Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import psycopg

    from sidecar.storage._postgres import PostgresBackend

    dsn = postgres.new_database()
    postgres.sql("CREATE ROLE listener_role LOGIN PASSWORD 'right'")

    def refused_login(backend: PostgresBackend, heartbeat: float) -> Any:
        # As if the password had changed between the store's open and this.
        return psycopg.connect(dsn.replace("postgres@", "listener_role@"), password="wrong")

    monkeypatch.setattr(PostgresBackend, "_listener_connect", refused_login)
    running = InProcess(dsn, startup_timeout_seconds="5")  # if it waited
    outcome = running.end() if running.serving() else running.outcome[0]
    assert isinstance(outcome, DatabaseRefused), outcome
    assert "password authentication failed" in outcome.message
    assert "database not ready" not in caplog.text


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_attempt_left_behind_by_a_stop_starts_no_feed(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    cfg = settings.load(
        None,
        environ={},
        flags={"db": one_backend(backend, request, tmp_path), "listen": "127.0.0.1:0"},
    )
    store = open_store(cfg)
    sidecar = Sidecar(cfg, store, metrics=Metrics(CollectorRegistry()))
    sidecar.listen()
    sidecar.stop(0)  # SIGTERM while an attempt was under way...
    store.open()  # ... which then goes on, on its thread
    with pytest.raises(Unavailable):
        sidecar.connect()
    feed = sidecar.engine.inside().feed
    assert feed is not None
    assert feed._thread is None
    assert getattr(feed, "_connection", None) is None
    store.close()


def test_ready_that_fails_stops_what_it_started(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    flags = {"db": str(tmp_path / "m.db"), "listen": "127.0.0.1:0", "auth_token_file": str(token)}
    cfg = settings.load(None, environ={}, flags=flags)
    store = open_store(cfg)
    store.open()
    sidecar = Sidecar(cfg, store, metrics=Metrics(CollectorRegistry()))
    sidecar.listen()
    sidecar.connect()

    def broken() -> None:
        raise RuntimeError("cannot start the event log's retention")

    sidecar.engine.inside().watches.start = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        sidecar.ready()
    sidecar.stop(0)  # as the daemon does after a failed start
    # Each was told to stop and ends at its next wake-up, which a loaded
    # machine may not schedule before the assertion: wait for the ends.
    started = {"janitor", "auth-reload", "change-feed"}
    for thread in threading.enumerate():
        if thread.name in started:
            thread.join(WAIT_SECONDS)
    names = {thread.name for thread in threading.enumerate() if thread.is_alive()}
    assert not names & started, names
    store.close()
