"""Shared fixtures: a real daemon on a free port over a real SQLite file, or
over a real PostgreSQL database of a throwaway cluster.

Modules marked `contract` (`pytestmark = pytest.mark.contract`) run every
test against both backends; the rest run on SQLite, the embedded default.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.api.server import Addresses, Sidecar
from sidecar.config import settings as config_mod
from sidecar.core.clock import system_clock
from sidecar.core.metrics import Metrics
from sidecar.domain.engine import MemoryEngine
from sidecar.ops import daemon
from sidecar.storage.store import Store
from tests import pg

# The bounds every wait takes (tests/waits.py), for the tests to import from here.
from tests.waits import CALL_SECONDS as CALL_SECONDS
from tests.waits import START_SECONDS as START_SECONDS
from tests.waits import TIMEOUT_SCALE as TIMEOUT_SCALE
from tests.waits import WAIT_SECONDS as WAIT_SECONDS

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("sqlite", "postgresql")
T = TypeVar("T")


@dataclass
class Running:
    sidecar: Sidecar
    store: Store
    addresses: Addresses
    channel: grpc.Channel
    stub: pb_grpc.MemoryServiceStub
    db_path: Path
    # The --db the daemon was given: db_path, or a PostgreSQL DSN.
    db: str = ""

    def add(
        self, content: str, timeout: float = CALL_SECONDS, **fields: Any
    ) -> pb.AddMemoryResponse:
        request = pb.AddMemoryRequest(content=content, **fields)
        response: pb.AddMemoryResponse = self.stub.AddMemory(request, timeout=timeout)
        return response

    def list(self, timeout: float = CALL_SECONDS, **fields: Any) -> pb.GetMemoriesResponse:
        response: pb.GetMemoriesResponse = self.stub.GetMemories(
            pb.GetMemoriesRequest(**fields), timeout=timeout
        )
        return response

    def turn(self, session_id: str, message: str = "", **fields: Any) -> pb.InjectForTurnResponse:
        request = pb.InjectForTurnRequest(session_id=session_id, user_message=message, **fields)
        response: pb.InjectForTurnResponse = self.stub.InjectForTurn(request, timeout=CALL_SECONDS)
        return response

    def db_queries(self) -> float:
        """SQL statements the store has run so far (from the metrics registry)."""
        families = text_string_to_metric_families(
            generate_latest(self.sidecar.metrics.registry).decode()
        )
        return sum(
            sample.value
            for family in families
            if family.name == "memory_db_queries"
            for sample in family.samples
            if sample.name == "memory_db_queries_total"
        )


def start_sidecar(
    db_path: Path,
    yaml_text: str = "",
    environ: dict[str, str] | None = None,
    *,
    db: str = "",
    clock: WallClock | None = None,
    **server: Any,
) -> Running:
    """A real Sidecar on 127.0.0.1:0 with its own store and channel.

    `db` (a DSN) overrides `db_path`, which then only names the config file;
    `clock` is the store's wall clock (what has expired), the real one unless given.
    """
    cfg_file = None
    if yaml_text:
        cfg_file = db_path.parent / f"{db_path.stem}-config.yaml"
        cfg_file.write_text(yaml_text)
    db = db or str(db_path)
    flags = {"db": db, "listen": "127.0.0.1:0", **server}
    cfg = config_mod.load(cfg_file, environ=environ or {}, flags=flags)
    metrics = Metrics(CollectorRegistry())
    store = daemon.open_store(cfg, metrics, clock or system_clock)
    store.open()
    sidecar = Sidecar(cfg, store, metrics=metrics)
    addresses = sidecar.start()
    channel = grpc.insecure_channel(addresses.api)
    return Running(
        sidecar, store, addresses, channel, pb_grpc.MemoryServiceStub(channel), db_path, db
    )


def stop_sidecar(running: Running) -> None:
    running.channel.close()
    running.sidecar.stop(grace=1)
    running.store.close()


@pytest.fixture(autouse=True)
def _no_sidecar_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own MEMORY_SIDECAR_* settings must not leak into tests."""
    for key in list(os.environ):
        if key.startswith("MEMORY_SIDECAR_"):
            monkeypatch.delenv(key)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (`make test`): three workers per core, as much of the suite
    waits on sockets, child processes and feeds rather than computing (on 2
    cores: 4 workers took 145 s, 6 took 121 s, 8 took 124 s).
    PYTEST_XDIST_AUTO_NUM_WORKERS still decides where it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return 3 * len(os.sched_getaffinity(0))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "contract: runs against every storage backend")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames and metafunc.definition.get_closest_marker("contract"):
        metafunc.parametrize("backend", BACKENDS)


@pytest.fixture
def backend() -> str:
    """The storage backend; contract tests are parametrized over every one."""
    return "sqlite"


@pytest.fixture(scope="session")
def postgres() -> Iterator[pg.Cluster]:
    """A throwaway PostgreSQL cluster, started once per test session."""
    found = pg.bindir()
    require_tool(str(found) if found else None, "PostgreSQL (Debian's postgresql package)")
    assert found is not None
    cluster = pg.Cluster(found)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def databases(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[str], str]]:
    """name -> the --db of that name for this test's backend (the same name,
    the same database). PostgreSQL databases are emptied for reuse after the
    test (see pg.Cluster.recycle), once the daemons using them have stopped."""
    made: dict[str, str] = {}

    def database(name: str) -> str:
        if name not in made:
            if backend == "postgresql":
                made[name] = request.getfixturevalue("postgres").new_database()
            else:
                made[name] = str(tmp_path / name)
        return made[name]

    yield database
    if backend == "postgresql" and made:
        cluster = request.getfixturevalue("postgres")
        for dsn in made.values():
            cluster.recycle(dsn)


@pytest.fixture
def make_sidecar(
    tmp_path: Path, databases: Callable[[str], str]
) -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def make(
        yaml_text: str = "",
        *,
        name: str = "memory.db",
        environ: dict[str, str] | None = None,
        clock: WallClock | None = None,
        **server: Any,
    ) -> Running:
        db = server.pop("db", None) or databases(name)
        running = start_sidecar(tmp_path / name, yaml_text, environ, db=db, clock=clock, **server)
        started.append(running)
        return running

    yield make
    for running in reversed(started):
        stop_sidecar(running)


@pytest.fixture(scope="module")
def loaded_model() -> Any:
    """A LocalEncoder held while the module runs: the daemons' encoders
    share its weights instead of loading them once per backend."""
    from sidecar.retrieval.embedding import LocalEncoder  # the semantic extra

    return LocalEncoder()


@pytest.fixture
def sidecar(make_sidecar: Callable[..., Running]) -> Running:
    return make_sidecar()


class WallClock:
    """A store's wall clock that a test moves: it starts at the real time
    and stands still until moved, so an entry expires when the test says,
    with no waiting."""

    def __init__(self) -> None:
        self.now = system_clock()

    def __call__(self) -> datetime:
        return self.now

    def move(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


MakeEngine = Callable[..., tuple[MemoryEngine, Clock, Metrics]]


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[MakeEngine]:
    """An engine over a real store, with a clock the test moves by hand."""
    stores: list[Store] = []
    engines: list[MemoryEngine] = []

    def make(
        yaml_text: str = "",
        *,
        changes: bool = False,
        on_erasure: Sequence[Callable[[], object]] = (),
    ) -> tuple[MemoryEngine, Clock, Metrics]:
        path = tmp_path / "config.yaml"
        path.write_text(yaml_text)
        cfg = config_mod.load(path, environ={})
        metrics = Metrics(CollectorRegistry())
        store = Store(str(tmp_path / "m.db"), on_query=metrics.db_query)
        store.open()
        stores.append(store)
        clock = Clock()
        engine = MemoryEngine(
            cfg, store, metrics=metrics, now=clock, changes=changes, on_erasure=on_erasure
        )
        engines.append(engine)
        return engine, clock, metrics

    yield make
    # As the daemon's stop() does: a store closed under a compact index being
    # saved on a background thread crashes the process.
    for engine in engines:
        assert engine.stop_indexing(WAIT_SECONDS)
    for store in stores:
        store.close()


@contextlib.contextmanager
def sqlite_file(path: Path | str, **kwargs: Any) -> Iterator[sqlite3.Connection]:
    """A connection to an SQLite file, committed and closed on exit.

    `with sqlite3.connect(...) as conn` commits but leaves the connection
    open, which Python 3.13 warns about (ResourceWarning).
    """
    conn = sqlite3.connect(path, **kwargs)
    try:
        with conn:
            yield conn
    finally:
        conn.close()


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo carried in a failed call's google.rpc.Status."""
    status = rpc_status.from_call(error)
    assert status is not None, f"no google.rpc.Status on {error.code()}: {error.details()}"
    assert status.code == error.code().value[0]
    assert status.message == error.details()
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            assert info.domain == "memory.v1"
            return info
    raise AssertionError(f"no ErrorInfo in {status}")


# --- the daemon as a real subprocess -----------------------------------------

_SERVING = re.compile(r"serving api=(\S+) health=(\S+) metrics=(\S+)(?: mcp=(\S+))?")


class Daemon:
    """`python -m sidecar serve ARGS` as a process, its log read as it comes
    on a thread: a wait for a line is bounded even while the daemon is
    silent, and a long run never fills the pipe. The addresses are set by
    spawn_daemon, once it reports serving."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], Any] | None = None,
    ) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=preexec_fn,
        )
        self.log: list[str] = []
        self.api = self.health = self.metrics = ""
        # The MCP listener's URL, or "-" when it is off.
        self.mcp = "-"
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line.rstrip("\n"))

    def until(self, pattern: str, *, within: float = START_SECONDS) -> re.Match[str]:
        """The first log line matching `pattern`, waiting for it; fails at
        once if the daemon exits first."""

        def logged() -> re.Match[str] | None:
            exited = self.process.poll() is not None
            if exited:
                self._reader.join(WAIT_SECONDS)  # the last lines
            for line in list(self.log):
                found = re.search(pattern, line)
                if found:
                    return found
            assert not exited, "exited:\n" + "\n".join(self.log)
            return None

        return eventually(
            logged,
            lambda: f"logged {pattern!r}:\n" + "\n".join(self.log),
            within=within,
            pause=0.02,
        )

    def wait(self, timeout: float = START_SECONDS) -> int:
        """Wait for the exit; collect the rest of the log."""
        code = self.process.wait(timeout)
        self._reader.join(WAIT_SECONDS)
        assert self.process.stderr is not None
        self.process.stderr.close()
        return code

    def close(self) -> None:
        """Kill the daemon if a test left it running."""
        if self.process.poll() is None:
            self.process.kill()
        self.wait()


def spawn_daemon(
    *args: str, timeout: float = START_SECONDS, preexec_fn: Callable[[], Any] | None = None
) -> Daemon:
    """Run `python -m sidecar serve ARGS` and wait until it reports serving
    (`preexec_fn` runs in the child first, as a resource limit is set)."""
    daemon = Daemon(*args, preexec_fn=preexec_fn)
    try:
        match = daemon.until(_SERVING.pattern, within=timeout)
    except BaseException:
        daemon.close()
        raise
    daemon.api, daemon.health, daemon.metrics = match[1], match[2], match[3]
    daemon.mcp = match[4] or "-"
    return daemon


MakeSidecar = Callable[..., Running]


def refused(call: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The RpcError a call fails with (the test fails if it succeeds)."""
    with pytest.raises(grpc.RpcError) as raised:
        call(*args, **kwargs)
    return raised.value


def run_sidecar(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m sidecar ARGS` to completion, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
        env=env,
    )


def contents(running: Running, scope: pb.Scope, *, token: str = "", **fields: Any) -> list[str]:
    """The contents of what GetMemories lists for `scope` and `fields`, in
    its order; with `token`, asked as its bearer (as a daemon with tokens
    requires)."""
    metadata = [("authorization", f"Bearer {token}")] if token else None
    request = pb.GetMemoriesRequest(scope=scope, **fields)
    listed = running.stub.GetMemories(request, metadata=metadata, timeout=CALL_SECONDS)
    return [m.content for m in listed.memories]


def eventually(
    check: Callable[[], T | None],
    what: str | Callable[[], str],
    *,
    within: float = WAIT_SECONDS,
    pause: float = 0.01,
) -> T:
    """Wait for `check` (another daemon's news, a server's state) to hold:
    a liveness bound, not a timing claim. Returns the first truthy answer of
    `check`, which is asked again `pause` seconds after each falsy one; an
    assertion failing inside `check` fails the wait at once. After `within`
    seconds the wait fails naming `what` (a callable when the message needs
    the state at that moment, such as a log)."""
    deadline = time.monotonic() + within
    while not (answer := check()):
        assert time.monotonic() < deadline, (
            f"never happened: {what if isinstance(what, str) else what()}"
        )
        time.sleep(pause)
    return answer


def require_tool(path: str | None, what: str) -> str:
    """The tool's path; a skip on a developer's machine without it, a failure in CI."""
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{what} is missing in CI: .ci/run must install it")
        pytest.skip(f"{what} is not installed")
    return path
