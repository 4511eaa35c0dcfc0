"""What the listeners hold at most: descriptors, connections, time.

Every open connection holds a file descriptor. Without bounds, connections
that never finish their request (a partial request line, headers sent a
byte at a time) pile up until the process has no descriptor left, and then
the gRPC API, the database and the token files fail with it. So:

- The soft RLIMIT_NOFILE is raised to the hard limit at start
  (raise_descriptor_limit; sidecar.ops.daemon logs the outcome).
- Each HTTP listener (MCP on uvicorn, metrics on the standard library's
  server) closes a connection as soon as it is accepted once it holds its
  cap (connection_caps): the descriptor limit less a reserve for gRPC, the
  database's connections and the files, unless server.http_max_connections
  says less. uvicorn's own limit_concurrency would answer 503 but keep
  every socket, so the cap is taken in the protocol instead.
- A request's headers and body must arrive within
  server.http_request_timeout_seconds of the connection opening (or of the
  previous response on it), or the connection is closed: uvicorn has no
  timeout for a request it is still reading.
- The health listener (gRPC) takes gRPC core's own bounds
  (health_options): a handshake timeout and a cap on its connections.
- Every connection an HTTP listener closes this way is counted in
  memory_http_connections_refused_total, by listener and reason (full, slow).

Owns: the descriptor limit's raise, the caps and the reserve they keep, the
bounded uvicorn protocol, the bounded metrics server. Must not touch: what a
request does once read (sidecar.api.mcp_http, prometheus_client), binding
the listeners' addresses (sidecar.api.server), os.environ.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from sidecar.config.settings import ServerSettings
from sidecar.core.metrics import Metrics

# Descriptors kept back from the HTTP listeners' caps: gRPC's connections
# and its own descriptors, the token and certificate files, the encoder's
# model, logging; plus three per pooled database connection (an SQLite
# connection holds its file, its WAL and its shared memory).
RESERVE_DESCRIPTORS = 128
DESCRIPTORS_PER_DB_CONNECTION = 3
# Connections the event loop accepts in one go before the protocol can
# close those beyond the cap (uvicorn's backlog): they count against the
# descriptors too, briefly.
ACCEPT_BURST = 64
# The metrics listener's cap: a few scrapers at most.
METRICS_CONNECTIONS = 16
# The health listener's cap: a few probes (kubelet, a load balancer) at most.
HEALTH_CONNECTIONS = 16

Refused = Callable[[str], None]


def raise_descriptor_limit() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft
    limit before and after, and the hard limit. An unlimited hard limit
    is left alone (the kernel's nr_open caps the soft one below it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft, soft, hard
        return soft, hard, hard
    return soft, soft, hard


def descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE now (a very large number when unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


@dataclass(frozen=True, slots=True)
class Caps:
    """Connections each HTTP listener holds at most."""

    mcp: int
    metrics: int


def connection_caps(server: ServerSettings, limit: int | None = None) -> Caps:
    """The caps under the descriptor limit `limit` (the current one by
    default): MCP takes what the reserve, the metrics listener's cap and
    an accept burst leave, at least 1; http_max_connections lowers both."""
    limit = descriptor_limit() if limit is None else limit
    pool = server.db_pool_size or 2 * server.max_workers + 4
    reserve = RESERVE_DESCRIPTORS + DESCRIPTORS_PER_DB_CONNECTION * pool
    mcp = max(1, limit - reserve - METRICS_CONNECTIONS - ACCEPT_BURST)
    metrics = METRICS_CONNECTIONS
    if server.http_max_connections:
        mcp = min(mcp, server.http_max_connections)
        metrics = min(metrics, server.http_max_connections)
    return Caps(mcp=mcp, metrics=metrics)


def refusals(metrics: Metrics, listener: str) -> Refused:
    """What counts a listener's refusals, by reason (full, slow)."""
    children = {
        reason: metrics.http_refused.labels(listener, reason) for reason in ("full", "slow")
    }
    return lambda reason: children[reason].inc()


def health_options(server: ServerSettings) -> list[tuple[str, int]]:
    """gRPC core's bounds for the health listener: its connections, and
    the time a connection may take to finish its HTTP/2 handshake."""
    return [
        ("grpc.max_allowed_incoming_connections", HEALTH_CONNECTIONS),
        ("grpc.server_handshake_timeout_ms", int(server.http_request_timeout_seconds * 1000)),
    ]


def bounded_protocol(base: type[Any], cap: int, timeout: float, refused: Refused) -> type[Any]:
    """uvicorn's HTTP protocol `base` (httptools' or h11's), with a cap on
    open connections and a deadline for each request to arrive in full.

    The deadline is armed when the connection opens and again after each
    response; at it, a connection whose next request has not finished its
    headers (the cycle is the one armed for), or is still sending its body,
    is closed. A request read in full runs as long as it takes.
    """

    class Bounded(base):  # type: ignore[misc]
        _deadline: asyncio.TimerHandle | None = None
        _armed_for: object = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            if len(self.connections) >= cap:
                self.transport = transport
                refused("full")
                transport.abort()  # gives the descriptor back at once
                return
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._armed_for = self.cycle
            self._deadline = self.loop.call_later(timeout, self._late)

        def _late(self) -> None:
            self._deadline = None
            cycle = self.cycle
            if cycle is not self._armed_for and not cycle.more_body:
                return  # read in full: its response arms the next deadline
            if not self.transport.is_closing():
                refused("slow")
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

    return Bounded


class _Handler(WSGIRequestHandler):
    """One scrape: its request line and headers within the deadline, no log."""

    server: _MetricsServer

    def setup(self) -> None:
        super().setup()
        # Reads are bounded by the timer as a whole, not per recv (a byte
        # at a time would renew a per-recv timeout for ever).
        self._timer = threading.Timer(self.server.request_timeout, self._late)
        self._timer.daemon = True
        self._timer.start()

    _expired = False

    def _late(self) -> None:
        self._expired = True
        self.server.refused("slow")
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)  # ends the blocked read

    def parse_request(self) -> bool:
        parsed = super().parse_request() and not self._expired
        self._timer.cancel()  # a scrape is a GET: no body to wait for
        # The answer's writes, each within the timeout, to a client that reads.
        self.connection.settimeout(self.server.request_timeout)
        return parsed

    def finish(self) -> None:
        self._timer.cancel()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class _MetricsServer(ThreadingWSGIServer):
    """prometheus_client's threading server, closing connections beyond its cap."""

    cap = METRICS_CONNECTIONS
    request_timeout = 10.0
    refused: Refused = staticmethod(lambda reason: None)
    _open = 0
    _lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = self._open >= self.cap
            if not full:
                self._open += 1
        if full:
            self.refused("full")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open -= 1


def serve_metrics(
    host: str, port: int, metrics: Metrics, server: ServerSettings
) -> ThreadingWSGIServer:
    """Serve `metrics` at http://host:port/metrics on a thread of its own,
    bounded; stop it with shutdown() and server_close()."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    bounded = type(
        "MetricsServer",
        (_MetricsServer,),
        {
            "address_family": family,
            "cap": connection_caps(server).metrics,
            "request_timeout": server.http_request_timeout_seconds,
            "refused": staticmethod(refusals(metrics, "metrics")),
            "_lock": threading.Lock(),
        },
    )
    httpd: ThreadingWSGIServer = make_server(
        host, port, make_wsgi_app(metrics.registry), server_class=bounded, handler_class=_Handler
    )
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    return httpd
