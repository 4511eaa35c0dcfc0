"""The daemon as an operator runs it: listeners, health, reflection, signals."""

from __future__ import annotations

import signal
import socket
import sqlite3
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    MakeSidecar,
    error_info,
    eventually,
    refused,
    run_sidecar,
    spawn_daemon,
    sqlite_file,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(
            stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_SECONDS).status
        )


def test_serve_health_reflection_and_clean_sigterm(tmp_path: Path) -> None:
    db = tmp_path / "memory.db"
    daemon = spawn_daemon(
        "--db",
        str(db),
        "--listen",
        "127.0.0.1:0",
        "--health-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    )
    try:
        for address in (daemon.api, daemon.health):
            assert health_status(address) == SERVING
            assert health_status(address, "memory.v1.MemoryService") == SERVING

        with grpc.insecure_channel(daemon.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            stub.AddMemory(pb.AddMemoryRequest(content="survives restarts"), timeout=CALL_SECONDS)
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            answers = reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                timeout=CALL_SECONDS,
            )
            services = {s.name for a in answers for s in a.list_services_response.service}
        assert {"memory.v1.MemoryService", "grpc.health.v1.Health"} <= services

        # The health listener serves health and nothing else.
        with grpc.insecure_channel(daemon.health) as channel:
            error = refused(
                pb_grpc.MemoryServiceStub(channel).GetMemories,
                pb.GetMemoriesRequest(),
                timeout=CALL_SECONDS,
            )
            assert error.code() == grpc.StatusCode.UNIMPLEMENTED

        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait() == 0, "\n".join(daemon.log)
    finally:
        daemon.close()
    assert any("stopped" in line for line in daemon.log)
    # Closing the last connection checkpoints and removes the WAL.
    assert not Path(f"{db}-wal").exists()
    with sqlite_file(db) as conn:
        assert conn.execute("SELECT content FROM memories").fetchall() == [("survives restarts",)]
    conn.close()


def test_unix_socket_listener(tmp_path: Path) -> None:
    sock = tmp_path / "api.sock"
    daemon = spawn_daemon("--db", str(tmp_path / "m.db"), "--listen", f"unix:{sock}")
    try:
        assert daemon.api == f"unix:{sock}"
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            added = stub.AddMemory(
                pb.AddMemoryRequest(content="over a socket"), timeout=CALL_SECONDS
            )
            assert added.created
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait() == 0
    finally:
        daemon.close()


@pytest.mark.parametrize("flag", ["--listen", "--health-listen"])
def test_a_port_in_use_is_a_clear_error(
    tmp_path: Path, flag: str, make_sidecar: MakeSidecar
) -> None:
    # A sidecar holds the port, as a second sidecar in the same pod would find
    # it: the same server and listeners as a daemon's, in this process.
    first = make_sidecar(name="first.db").addresses.api
    args = ["--db", str(tmp_path / "second.db"), "--listen", "127.0.0.1:0", flag, first]
    result = run_sidecar("serve", *args)
    assert result.returncode == 1
    assert "cannot listen for" in result.stderr
    assert first in result.stderr
    assert health_status(first) == SERVING
    # Refused before any database is made, in one line of its own (not
    # after gRPC's raw "add_port.cc" log line).
    assert not (tmp_path / "second.db").exists()
    lines = [line for line in result.stderr.splitlines() if " INFO " not in line]
    assert lines == [
        f"memory-sidecar: BIND_FAILED: cannot listen for "
        f"{'the API' if flag == '--listen' else 'health checks'} on {first}: "
        "Address already in use"
    ]


def test_metrics_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_sidecar(
            "serve",
            "--db",
            str(tmp_path / "m.db"),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            f"127.0.0.1:{port}",
        )
    assert result.returncode == 1
    assert f"cannot listen for metrics on 127.0.0.1:{port}" in result.stderr


def test_stop_drains_in_flight_calls_and_refuses_new_ones(
    tmp_path: Path, make_sidecar: MakeSidecar
) -> None:
    running = make_sidecar(health_listen="127.0.0.1:0", grace_seconds=30)
    # Hold the write lock from outside, so an AddMemory is in flight (waiting
    # on the busy timeout) when the stop begins.
    blocker = sqlite3.connect(running.db_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    # The event log's retention pass, begun now, waits on that lock too (up
    # to busy_timeout_ms): stop() must refuse new calls without waiting for it.
    retention = running.sidecar.engine.inside().watches.retention
    retention.stop()
    retention.start()
    result: dict[str, object] = {}

    def slow_add() -> None:
        result["response"] = running.add("written during shutdown")

    writer = threading.Thread(target=slow_add)
    writer.start()
    # Wait until the server has the call in hand (it then waits on the lock).
    registry = running.sidecar.metrics.registry
    labels = {
        "grpc_type": "unary",
        "grpc_service": "memory.v1.MemoryService",
        "grpc_method": "AddMemory",
    }
    eventually(
        lambda: registry.get_sample_value("grpc_server_started_total", labels),
        "the AddMemory call reaches the server",
    )
    stopper = threading.Thread(target=running.sidecar.stop)
    stopper.start()
    eventually(
        lambda: (
            running.sidecar.health.Check(health_pb2.HealthCheckRequest(), None).status
            == NOT_SERVING
        ),
        "the server reports NOT_SERVING",
    )
    assert running.addresses.health is not None
    assert health_status(running.addresses.health) == NOT_SERVING
    # stop() goes straight on to refusing new calls: a call may still slip
    # in just after NOT_SERVING (a loaded machine stretches that moment),
    # none once refusing has begun, while the in-flight call still waits.
    late = grpc.insecure_channel(running.addresses.api)

    def refusal() -> grpc.StatusCode | None:
        try:
            pb_grpc.MemoryServiceStub(late).GetMemories(
                pb.GetMemoriesRequest(), timeout=CALL_SECONDS
            )
        except grpc.RpcError as error:
            return error.code()
        return None

    code = eventually(refusal, "new calls are refused", pause=0.05)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert writer.is_alive(), "the in-flight call must still be waiting"
    late.close()

    blocker.execute("COMMIT")
    blocker.close()
    writer.join(WAIT_SECONDS)
    stopper.join(WAIT_SECONDS)
    assert not stopper.is_alive()
    response = result["response"]
    assert isinstance(response, pb.AddMemoryResponse)
    assert response.created
    running.store.close()
    with sqlite_file(running.db_path) as conn:
        rows = conn.execute("SELECT content FROM memories").fetchall()
    conn.close()
    assert rows == [("written during shutdown",)]


def test_stop_waits_for_a_compact_index_being_saved(make_sidecar: MakeSidecar) -> None:
    # The store closes after stop(): under a thread still saving an index,
    # SQLite's connection closed mid-commit crashed the process.
    running = make_sidecar(
        "defaults: {memory_char_limit: 0}\n"
        "server: {compact_tier_entries: 10, busy_timeout_ms: 2000}"
    )
    scope = pb.Scope(agent_id="big")
    for k in range(12):
        running.add(f"note {k}: the worker deploys on friday", scope=scope)
    blocker = sqlite3.connect(running.db_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    # Held compactly from here; the index save this starts waits on the lock.
    request = pb.SearchMemoriesRequest(scope=scope, query="deploys friday")
    assert running.stub.SearchMemories(request, timeout=CALL_SECONDS).hits
    assert running.sidecar.engine.indexing()
    stopper = threading.Thread(target=running.sidecar.stop, kwargs={"grace": 0})
    stopper.start()
    time.sleep(0.3)
    assert stopper.is_alive(), "stop() returned while an index was being saved"
    blocker.execute("COMMIT")
    blocker.close()
    stopper.join(WAIT_SECONDS)
    assert not stopper.is_alive()
    assert not running.sidecar.engine.indexing()


def test_a_lock_held_past_the_busy_timeout_is_unavailable(
    tmp_path: Path, make_sidecar: MakeSidecar
) -> None:
    running = make_sidecar("server: {busy_timeout_ms: 100}")
    blocker = sqlite3.connect(running.db_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        error = refused(running.add, "blocked", timeout=CALL_SECONDS)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(error).reason == "DATABASE_BUSY"
    assert running.add("unblocked").created


def test_a_burst_of_sigterms_stops_the_daemon_cleanly(tmp_path: Path) -> None:
    # `make run` stopped with its process group: make forwards the SIGTERM
    # its child already got. A second signal while the first was being
    # handled deadlocked the daemon's main thread (one `make run` stop in
    # five, tests/test_readme.py); here signals arrive all through the
    # shutdown, and it must still drain and stop once.
    daemon = spawn_daemon("--db", str(tmp_path / "m.db"), "--listen", "127.0.0.1:0")
    try:
        # Signals for as long as it runs (up to a few seconds), each a
        # moment after the last: some land while a handler is running.
        deadline = time.monotonic() + 3
        while daemon.process.poll() is None and time.monotonic() < deadline:
            daemon.process.send_signal(signal.SIGTERM)
            time.sleep(0.0001)
        # Drained and stopped (a signal after serve returned may end the
        # exit itself: the default action is back by then).
        assert daemon.wait() in (0, -signal.SIGTERM)
        assert any(line.endswith("INFO sidecar: stopped") for line in daemon.log), daemon.log
    finally:
        daemon.close()


def test_the_mcp_url_is_logged_on_a_line_of_its_own(tmp_path: Path) -> None:
    daemon = spawn_daemon(
        "--db",
        str(tmp_path / "memory.db"),
        "--listen",
        "127.0.0.1:0",
        "--mcp-listen",
        "127.0.0.1:0",
    )
    try:
        assert daemon.mcp.startswith("http://127.0.0.1:")
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait() == 0, "\n".join(daemon.log)
    finally:
        daemon.close()
    (line,) = [line for line in daemon.log if "MCP (streamable HTTP) at" in line]
    assert line.endswith(
        f"MCP (streamable HTTP) at {daemon.mcp}; `memory-sidecar mcp-config --host HOST` "
        "prints an entry for Claude Code, Claude Desktop or Cursor"
    )


def test_insecure_off_loopback_warns_of_what_is_off_for_each_listener(tmp_path: Path) -> None:
    pytest.importorskip("mcp.server")
    daemon = spawn_daemon(
        "--db",
        str(tmp_path / "memory.db"),
        "--listen",
        "0.0.0.0:0",
        "--mcp-listen",
        "0.0.0.0:0",
        "--insecure",
        timeout=120,
    )
    daemon.close()
    warned = [line for line in daemon.log if " WARNING sidecar: insecure: " in line]
    assert [line.split(" WARNING sidecar: ")[1] for line in warned] == [
        "insecure: the API on 0.0.0.0:0 is reachable from other hosts and requires no token",
        "insecure: MCP on 0.0.0.0:0 is reachable from other hosts, requires no token and "
        "checks no Host or Origin header (no DNS-rebinding protection)",
    ]
    # On loopback insecure changes nothing, and nothing is said.
    daemon = spawn_daemon(
        "--db",
        str(tmp_path / "memory.db"),
        "--listen",
        "127.0.0.1:0",
        "--mcp-listen",
        "127.0.0.1:0",
        "--insecure",
        timeout=120,
    )
    daemon.close()
    assert not [line for line in daemon.log if " WARNING sidecar: insecure" in line]
    # The descriptor limit and the HTTP listeners' caps, in one line.
    (limit,) = [line for line in daemon.log if "INFO sidecar: descriptor limit " in line]
    assert "HTTP connections at most mcp=" in limit
