"""What the listeners hold at most (sidecar.api.bounds): connections under
the descriptor limit, the time a request may take to arrive, refusals
counted."""

from __future__ import annotations

import resource
import socket
import urllib.request
from pathlib import Path

import grpc
import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.api.bounds import ACCEPT_BURST, HEALTH_CONNECTIONS, connection_caps
from sidecar.config.settings import ServerSettings
from tests.api.test_mcp_http import ACCEPT, INITIALIZE
from tests.conftest import START_SECONDS, MakeSidecar, Running, eventually, spawn_daemon

pytest.importorskip("mcp.server")

# systemd's default soft limit; hard too, so the daemon cannot raise it.
LIMIT = 1024
# More half-open connections than the daemon has descriptors.
FLOOD = 1100
# A request line and part of the headers, never finished.
PARTIAL_HEADERS = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-"


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def half_open(address: tuple[str, int], start: bytes = PARTIAL_HEADERS) -> socket.socket | None:
    """A connection that sends `start` and never finishes (None: refused at once)."""
    try:
        sock = socket.create_connection(address, timeout=30)
    except OSError:
        return None
    try:
        sock.sendall(start)
    except OSError:
        sock.close()
        return None
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (waits for it, up to the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def address_of(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").split("/")[0].rpartition(":")
    return host, int(port)


def initialized(url: str, timeout: float = 30) -> bool:
    """Whether an MCP initialize is answered (a raw HTTP client, as not an SDK)."""
    try:
        with httpx2.Client(timeout=timeout) as http:
            return http.post(url, headers=ACCEPT, json=INITIALIZE).status_code == 200
    except httpx2.HTTPError:
        return False


def refused(running: Running, listener: str, reason: str) -> float:
    value = running.sidecar.metrics.registry.get_sample_value(
        "memory_http_connections_refused_total", {"listener": listener, "reason": reason}
    )
    return value or 0.0


def scraped_refusals(metrics_address: str, listener: str, reason: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "memory_http_connections_refused_total" and sample.labels == {
                "listener": listener,
                "reason": reason,
            }:
                return float(sample.value)
    raise AssertionError("memory_http_connections_refused_total is not exported")


def test_the_caps_leave_a_reserve_under_the_descriptor_limit() -> None:
    server = ServerSettings()
    caps = connection_caps(server, LIMIT)
    pooled = 2 * server.max_workers + 4
    # What the HTTP listeners may hold, with an accept burst on top, leaves
    # three descriptors per database connection and more for gRPC.
    assert caps.mcp + caps.metrics + ACCEPT_BURST + 3 * pooled < LIMIT - 100
    assert connection_caps(ServerSettings(http_max_connections=5), LIMIT).mcp == 5
    # However low the limit, a listener takes a connection.
    assert connection_caps(server, 10).mcp == 1


def test_a_flood_of_half_open_connections_leaves_grpc_and_mcp_answering(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.yaml"
    # Long enough that the flood is held, not timed out, while gRPC is asked.
    config.write_text("server:\n  http_request_timeout_seconds: 600\n")
    daemon = spawn_daemon(
        "--config",
        str(config),
        "--db",
        str(tmp_path / "m.db"),
        "--listen",
        "127.0.0.1:0",
        "--mcp-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        preexec_fn=_limited,
        timeout=START_SECONDS,
    )
    held: list[socket.socket] = []
    try:
        assert any(f"descriptor limit {LIMIT} (not raised" in line for line in daemon.log)
        mcp = address_of(daemon.mcp)
        for _ in range(FLOOD):
            sock = half_open(mcp)
            if sock is not None:
                held.append(sock)
        # The flood holds all MCP takes: a new connection goes unanswered.
        eventually(lambda: not initialized(daemon.mcp, timeout=2), "MCP held by the flood")
        # A new gRPC connection and a write (the database's descriptors) while held.
        with grpc.insecure_channel(daemon.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            added = stub.AddMemory(
                pb.AddMemoryRequest(content="Still answering", scope=pb.Scope(agent_id="a")),
                timeout=10,
            )
        assert added.memory.id
        assert scraped_refusals(daemon.metrics, "mcp", "full") > 0
        for sock in held:
            sock.close()
        held.clear()
        eventually(lambda: initialized(daemon.mcp), "MCP answering after the flood")
    finally:
        for sock in held:
            sock.close()
        daemon.close()


def test_a_request_that_does_not_arrive_in_time_is_closed_and_counted(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar(
        mcp_listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", http_request_timeout_seconds=0.2
    )
    assert running.addresses.mcp is not None
    assert running.addresses.metrics is not None
    mcp = address_of(running.addresses.mcp)
    headers = half_open(mcp)
    body = half_open(
        mcp, b'POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"json'
    )
    scrape = half_open(address_of(running.addresses.metrics), b"GET /metrics HTTP/1.1\r\nHo")
    for sock in (headers, body, scrape):
        assert sock is not None
        with sock:
            assert closed_by_server(sock)
    assert refused(running, "mcp", "slow") == 2
    assert refused(running, "metrics", "slow") == 1
    # A request that arrives in time is answered.
    assert initialized(running.addresses.mcp)


def test_a_listener_at_its_cap_closes_new_connections_and_counts_them(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar(
        mcp_listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", http_max_connections=3
    )
    assert running.addresses.mcp is not None
    assert running.addresses.metrics is not None
    for listener, url in (("mcp", running.addresses.mcp), ("metrics", running.addresses.metrics)):
        address = address_of(url)
        held = [half_open(address) for _ in range(3)]
        try:
            extra = half_open(address)
            if extra is not None:
                with extra:
                    assert closed_by_server(extra)
            assert refused(running, listener, "full") == 1
        finally:
            for sock in held:
                if sock is not None:
                    sock.close()
    # Once the held ones close, a request is answered again.
    eventually(lambda: initialized(str(running.addresses.mcp)), "MCP answering again")


def drained(sock: socket.socket) -> int:
    """Bytes the server sent before it closed `sock` (waits for the close)."""
    received = 0
    try:
        while data := sock.recv(4096):
            received += len(data)
    except ConnectionResetError:
        pass
    return received


def test_the_health_listener_takes_grpc_cores_bounds(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(health_listen="127.0.0.1:0")
    assert running.addresses.health is not None
    host, _, port = running.addresses.health.rpartition(":")
    preface = b"PRI * HTTP/2.0\r\n"  # an HTTP/2 preface, unfinished
    held = [half_open((host, int(port)), preface) for _ in range(HEALTH_CONNECTIONS)]
    try:
        extra = half_open((host, int(port)), preface)
        if extra is not None:
            with extra:
                assert drained(extra) == 0  # closed as accepted, unanswered
    finally:
        for sock in held:
            if sock is not None:
                sock.close()
    # A handshake that does not finish in time is closed.
    quick = make_sidecar(
        name="quick.db", health_listen="127.0.0.1:0", http_request_timeout_seconds=0.2
    )
    assert quick.addresses.health is not None
    host, _, port = quick.addresses.health.rpartition(":")
    sock = half_open((host, int(port)), preface)
    assert sock is not None
    with sock:
        drained(sock)  # returns once the server closed it
