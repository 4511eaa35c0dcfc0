"""Start-up against a database that is not there yet: the daemon listens,
answers NOT_SERVING and waits (sidecar.startup), and fails at once, in one
line with a reason, on what waiting cannot mend."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar import config
from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.errors import (
    ConfigError,
    DatabaseRefused,
    DataLoss,
    FailedPrecondition,
    StoreError,
    Unavailable,
)
from sidecar.startup import Backoff, transient, wait_for_database
from sidecar.store import Store
from tests import pg
from tests.conftest import error_info, refused, require_tool, run_sidecar, sqlite_file

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_LISTENING = re.compile(r"listening api=(\S+) health=(\S+) metrics=(\S+);")
# A liveness bound for what the daemon must do, never a timing claim.
PATIENCE = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        return int(stub.Check(request, timeout=5).status)


class Waiting:
    """`memory-sidecar serve` as a process, its log read as it comes (so a
    long wait never fills the pipe)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line.rstrip("\n"))

    def until(self, pattern: str) -> re.Match[str]:
        """The first log line matching `pattern`, waiting for it."""
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            for line in list(self.log):
                found = re.search(pattern, line)
                if found:
                    return found
            assert self.process.poll() is None, "exited:\n" + "\n".join(self.log)
            time.sleep(0.05)
        raise AssertionError(f"never logged {pattern!r}:\n" + "\n".join(self.log))

    def wait(self) -> int:
        code = self.process.wait(PATIENCE)
        self._reader.join(PATIENCE)
        assert self.process.stderr is not None
        self.process.stderr.close()
        return code

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.wait()


@pytest.fixture
def waiting() -> Iterator[list[Waiting]]:
    started: list[Waiting] = []
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
    # Log lines before it (sidecar.tokens says how it counts) start with a time.
    assert not lines[-1][:1].isdigit(), stderr
    return lines[-1]


def environ(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMORY_SIDECAR_")}
    env.update({f"MEMORY_SIDECAR_{k.upper()}": v for k, v in settings.items()})
    return env


def test_waits_not_serving_for_postgresql_then_serves(bindir: Path, waiting: list[Waiting]) -> None:
    # A cluster initialised but not started: nothing listens on its port yet.
    cluster = pg.Cluster(bindir, port=free_port())
    cluster.init()
    try:
        daemon = Waiting(
            "--db", cluster.tcp_dsn(), "--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0"
        )
        waiting.append(daemon)
        api, health_address, _ = daemon.until(_LISTENING.pattern).groups()
        daemon.until("database not ready \\(DATABASE_UNAVAILABLE")
        # Both listeners answer: NOT_SERVING, for the server and the service.
        for address in (health_address, api):
            assert health(address) == NOT_SERVING
            assert health(address, "memory.v1.MemoryService") == NOT_SERVING
        # The API says why, with the reason a client retries on.
        with grpc.insecure_channel(api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            error = refused(stub.AddMemory, pb.AddMemoryRequest(content="early"), timeout=5)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(error).reason == "DATABASE_UNAVAILABLE"
            assert "waits for its database" in error.details()
            assert "Connection refused" in error.details()  # what the last attempt met
            stream = stub.ExportMemories(pb.ExportMemoriesRequest(), timeout=5)
            error = refused(list, stream)
            assert error_info(error).reason == "DATABASE_UNAVAILABLE"

        cluster.serve()
        deadline = time.monotonic() + PATIENCE
        while health(health_address) != SERVING:
            assert time.monotonic() < deadline, "never SERVING:\n" + "\n".join(daemon.log)
            assert daemon.process.poll() is None, "\n".join(daemon.log)
            time.sleep(0.1)
        assert health(api, "memory.v1.MemoryService") == SERVING
        with grpc.insecure_channel(api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            assert stub.AddMemory(pb.AddMemoryRequest(content="after"), timeout=10).created
            assert [m.content for m in stub.GetMemories(pb.GetMemoriesRequest()).memories] == [
                "after"
            ]
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


def test_sigterm_while_an_attempt_hangs_exits_cleanly(waiting: list[Waiting]) -> None:
    # A "server" that accepts and never answers: libpq waits for its greeting
    # up to the connect timeout (busy_timeout_ms: a minute here).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        daemon = Waiting(
            "--db",
            f"postgresql://postgres@127.0.0.1:{port}/postgres",
            "--listen",
            "127.0.0.1:0",
            env=environ(busy_timeout_ms="60000"),
        )
        waiting.append(daemon)
        silent.settimeout(PATIENCE)
        connection, _ = silent.accept()  # the attempt is under way
        with connection:
            daemon.process.send_signal(signal.SIGTERM)
            # Well inside the attempt's minute.
            assert daemon.wait() == 0, "\n".join(daemon.log)
    assert any("stopped before the database was ready" in line for line in daemon.log)
    assert not any("Traceback" in line for line in daemon.log)


def test_sigterm_while_waiting_between_attempts_exits_cleanly(waiting: list[Waiting]) -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    daemon = Waiting("--db", dsn, "--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0")
    waiting.append(daemon)
    _, health_address, _ = daemon.until(_LISTENING.pattern).groups()
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
        config.load(path, environ={})
    assert caught.value.key == "server.startup_timeout_seconds"
    result = run_sidecar("serve", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "memory-sidecar: config: server.startup_timeout_seconds: must be between 0 and 86400,"
        " got -1.0"
    )
    assert config.Config().server.startup_timeout_seconds == 120


# --- the pieces -----------------------------------------------------------------


def test_what_waiting_can_mend() -> None:
    unreachable = Unavailable("refused", reason="DATABASE_UNAVAILABLE")
    assert transient(unreachable, "postgresql")
    assert transient(Unavailable("locked", reason="DATABASE_BUSY"), "sqlite")
    read_only = FailedPrecondition("standby", reason="DATABASE_READ_ONLY")
    assert transient(read_only, "postgresql")  # a standby, until promoted
    assert not transient(read_only, "sqlite")  # a file's mode
    assert not transient(DatabaseRefused("bad password"), "postgresql")
    assert not transient(DataLoss("damaged"), "sqlite")
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
    failures = [Unavailable("down", reason="DATABASE_UNAVAILABLE")] * 3
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
        raise Unavailable("down", reason="DATABASE_UNAVAILABLE")

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
