"""Building and stopping the listeners: API, health, metrics, MCP.

`Sidecar` wires the engine (and its encoder), MemoryService, the interceptors
and the background threads around one open store; sidecar.ops.daemon runs it.

Built separately from running (gRPC's own examples do the same), so tests
bind port 0 and talk to a real channel.

Owns: the listeners (API with TLS, health, metrics, and the socket of the MCP
listener, which sidecar.api.mcp_http serves), the interceptor order, the worker
pool, the janitor, the expiry sweep's thread and the auth files' watcher
(sidecar.api.reloading), encoder_for, and the order of
start and stop (the engine's threads through its methods: start_feed,
start_background, end_watches, stop_retention, drain_exports, stop, abort).
Must not touch: request handling (sidecar.api.service,
sidecar.api.mcp_server), the engine's rooms, SQL, os.environ.
It does install tracing on the store.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.api.access import TokensFile
from sidecar.api.auth_log import AuthLog, TokenIgnored
from sidecar.api.bounds import health_options, serve_metrics
from sidecar.api.interceptors import (
    AuthInterceptor,
    ErrorInterceptor,
    MetricsInterceptor,
    StartupGate,
    TokenFile,
)
from sidecar.api.paging import PageTokens
from sidecar.api.reloading import Watcher
from sidecar.api.service import SERVICE_NAME, FrozenAnswers, MemoryService
from sidecar.config.settings import Config, ServerSettings
from sidecar.core.errors import ConfigError, Reason, SidecarError
from sidecar.core.metrics import Metrics
from sidecar.domain.engine import MemoryEngine
from sidecar.retrieval.batching import BatchingEncoder
from sidecar.retrieval.embedding import Encoder, EndpointEncoder
from sidecar.retrieval.quantized import local_encoder
from sidecar.storage.store import Store

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from sidecar.api.mcp_http import McpListener
    from sidecar.api.tracing import Tracing

log = logging.getLogger("sidecar.server")

# grpcio sets SO_REUSEPORT by default, which lets a second daemon bind the
# same port and silently take half the traffic. A port in use must be an error.
_SERVER_OPTIONS = [("grpc.so_reuseport", 0)]
# How long stop() waits, at the least, for a compact index being saved.
INDEX_SAVE_GRACE_SECONDS = 10.0
# A vanished client (a crashed host, a dropped NAT mapping) sends no FIN:
# without pings its WatchMemories or ExportMemories stream would hold its
# slot and worker until TCP gives up (gRPC's default keepalive is 2 hours).
# The server pings an idle connection after KEEPALIVE_SECONDS and closes it
# when no answer comes within KEEPALIVE_TIMEOUT_SECONDS.
KEEPALIVE_SECONDS = 60.0
KEEPALIVE_TIMEOUT_SECONDS = 20.0
# How often a client may ping (grpc-go's and grpc-java's keepalive clients
# default to no less than 10 s): more often is a GOAWAY, gRPC's policy.
CLIENT_PING_SECONDS = 10.0


def _keepalive_options() -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", int(KEEPALIVE_SECONDS * 1000)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_SECONDS * 1000)),
        # gRPC core times out any unanswered ping after this (a minute by
        # default), whatever keepalive_timeout_ms says.
        ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_SECONDS * 1000)),
        # Pings on a stream that sends nothing (an idle watch) too.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(CLIENT_PING_SECONDS * 1000)),
    ]


def encoder_for(server: ServerSettings) -> Encoder | None:
    """The encoder server.semantic_encoder names, loaded (None: off)."""
    if server.semantic_encoder == "local":
        local = local_encoder(
            server.semantic_runtime,
            server.semantic_model_dir or None,
            server.semantic_cache_dir or None,
        )
        if not server.semantic_batch_wait_ms:
            return local
        # Concurrent queries and writes share forward passes: one slot a
        # core, as each pass runs on one thread.
        return BatchingEncoder(
            local,
            max_wait_seconds=server.semantic_batch_wait_ms / 1000,
            slots=os.cpu_count() or 1,
        )
    if server.semantic_encoder == "endpoint":
        return EndpointEncoder(
            server.semantic_base_url,
            server.semantic_model,
            server.semantic_api_key,
            server.semantic_timeout_seconds,
            server.semantic_max_dimensions,
        )
    return None


class BindError(SidecarError):
    """A listener could not bind its address."""

    default_reason = Reason.BIND_FAILED


def _free(address: str, what: str) -> None:
    """Refuse a TCP address another process holds, before gRPC tries it:
    gRPC's core would print a raw log line of its own to stderr first.
    Bound with SO_REUSEADDR, as gRPC binds, and closed at once."""
    host, _, port_text = address.rpartition(":")
    if address.startswith("unix:") or not port_text.isdigit() or int(port_text) == 0:
        return
    try:
        found = socket.getaddrinfo(
            host.strip("[]") or None, int(port_text), type=socket.SOCK_STREAM
        )
    except OSError:
        return  # gRPC says what is wrong with the name
    for family, kind, proto, _name, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                raise BindError(f"cannot listen for {what} on {address}: {exc.strerror}") from None


def _bind(
    server: grpc.Server,
    address: str,
    what: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    _free(address, what)
    try:
        port: int = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError as exc:
        raise BindError(f"cannot listen for {what} on {address}: {exc}") from None
    if port == 0 and not address.startswith("unix:"):
        raise BindError(f"cannot listen for {what} on {address}: address in use or invalid")
    return port


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"server.{key}", f"cannot read {path}: {exc.strerror}") from None


def tls_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS for the API listener; mutual TLS when a client CA is configured."""
    server = config.server
    if not server.tls_cert_file:
        return None
    pair = (
        _read("tls_key_file", server.tls_key_file),
        _read("tls_cert_file", server.tls_cert_file),
    )
    client_ca = (
        _read("tls_client_ca_file", server.tls_client_ca_file)
        if server.tls_client_ca_file
        else None
    )
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _auth(server: ServerSettings, auth_log: AuthLog) -> AuthInterceptor | None:
    """Bearer tokens on the API (and the MCP listener), when a token file or
    a tokens file is set.

    Both may be: the single token addresses every scope, each of the tokens
    file's only what its grant lists.
    """
    token = TokenFile(server.auth_token_file) if server.auth_token_file else None
    tokens = TokensFile(server.auth_tokens_file) if server.auth_tokens_file else None
    if token is None and tokens is None:
        return None
    return AuthInterceptor(token, tokens, auth_log)


def _listening_socket(address: str, what: str) -> socket.socket:
    """A TCP socket bound to HOST:PORT and listening (port 0: any free one)."""
    host, _, port = address.rpartition(":")
    try:
        family, kind, proto, _name, where = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise BindError(f"cannot listen for {what} on {address}: {exc.strerror or exc}") from None
    try:
        # Rebinding a port in TIME_WAIT after a restart; unlike grpcio's
        # SO_REUSEPORT, a port another process listens on stays an error.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen for {what} on {address}: {exc.strerror or exc}") from None
    return sock


def _display(address: str, port: int) -> str:
    if address.startswith("unix:"):
        return address
    host = address.rpartition(":")[0]
    return f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class Addresses:
    api: str
    health: str | None
    metrics: str | None
    # The MCP listener's URL (http://HOST:PORT/mcp), when server.mcp_listen is set.
    mcp: str | None = None


class Sidecar:
    """The running daemon's listeners around one store.

    >>> sidecar = Sidecar(config, store)
    >>> addresses = sidecar.start()      # binds, then reports SERVING
    >>> sidecar.stop(grace=10)           # NOT_SERVING, drain, close

    start() is listen(), connect() and ready() in a row, with the store
    already open. sidecar.ops.daemon calls them one by one instead, so the
    listeners answer (NOT_SERVING; UNAVAILABLE, DATABASE_UNAVAILABLE on the
    API) while it waits for the database.
    """

    def __init__(
        self,
        config: Config,
        store: Store,
        *,
        metrics: Metrics | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics or Metrics()
        # The service's prebuilt answers hold rendered content: the engine
        # empties them on every erasure it makes or hears of.
        frozen = FrozenAnswers()
        self.engine = MemoryEngine(
            config,
            store,
            metrics=self.metrics,
            changes=True,
            encoder=encoder_for(config.server),
            on_erasure=(frozen.clear,),
        )
        self.health = health.HealthServicer()
        workers = config.server.max_workers
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc")
        # Read before anything is installed on the store: an invalid token
        # file must not leave statement wrappers behind.
        self.auth_log = AuthLog()
        auth = _auth(config.server, self.auth_log)
        # Token files are re-read on a thread of their own: a call only reads
        # the set last swapped in, so no file can stall or fail it.
        self._reloads = Watcher(auth.files if auth else (), config.server.auth_reload_seconds)
        self.metrics.auth_file_problems.set_function(lambda: float(self._reloads.problems))
        # Refuses API calls until ready() (health and reflection pass).
        self.gate = StartupGate()
        # Keyed from the database by connect(), before anything is served.
        self.pages = PageTokens()
        self._ready = False
        self._tracing = self._traced(tracer_provider)
        self._api = self._api_server(auth, frozen)
        self._mcp = self._mcp_listener(auth)
        self._mcp_socket: socket.socket | None = None
        self._health_server: grpc.Server | None = None
        self._addresses = Addresses(api="", health=None, metrics=None)
        self._metrics_server: Any = None
        self._stopped = threading.Event()
        self._janitor = threading.Thread(target=self._sweep, name="janitor", daemon=True)
        self._expiry = threading.Thread(target=self._expire, name="expiry", daemon=True)

    def _traced(self, tracer_provider: TracerProvider | None) -> Tracing | None:
        """Spans for the RPCs and their statements, on `tracer_provider` or
        one exporting over OTLP, installed on the store. With tracing off
        OpenTelemetry is never imported, and nothing is installed."""
        if tracer_provider is None and self.config.server.tracing == "off":
            return None
        from sidecar.api.tracing import Tracing  # the tracing extra

        tracing = Tracing(tracer_provider)
        self.store.trace(tracing.statements(self.store.backend))
        return tracing

    def _api_server(self, auth: AuthInterceptor | None, frozen: FrozenAnswers) -> grpc.Server:
        """The API's server: the interceptors in order, MemoryService,
        health and reflection (not bound yet: see listen)."""
        server = self.config.server
        api = grpc.server(
            self._pool,
            # Tracing outermost, so its span covers the whole call; metrics
            # next: both see the status auth and the error mapping chose.
            interceptors=[
                *([self._tracing.interceptor()] if self._tracing else []),
                MetricsInterceptor(self.metrics),
                # Without auth, a token sent anyway is only warned of.
                auth or TokenIgnored(self.auth_log),
                self.gate,
                ErrorInterceptor(),
            ],
            options=[
                *_SERVER_OPTIONS,
                *_keepalive_options(),
                ("grpc.max_receive_message_length", server.max_request_bytes),
            ],
        )
        pb_grpc.add_MemoryServiceServicer_to_server(
            MemoryService(self.engine, server.limits(), self.pages, frozen), api
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, api)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), api
        )
        return api

    def _mcp_listener(self, auth: AuthInterceptor | None) -> McpListener | None:
        """The MCP listener over the same engine, when server.mcp_listen is set."""
        if not self.config.server.mcp_listen:
            return None
        from sidecar.api.mcp_http import McpListener  # the mcp extra
        from sidecar.domain.tools import Tools

        return McpListener(
            self.config,
            Tools(self.engine, self.config.server.limits()),
            metrics=self.metrics,
            end_session=self.engine.end_session,
            auth=auth,
            auth_log=self.auth_log,
            refusal=self.gate.refusal,
        )

    def _expire(self) -> None:
        """Remove expired entries now and then (sidecar.domain.expiry)."""
        interval = self.config.server.expiry_sweep_seconds
        while not self._stopped.wait(interval):
            try:
                # Paced: it rests between batches (waking at once to stop).
                self.engine.sweep_expired(stop=self._stopped.is_set, rest=self._stopped.wait)
            except SidecarError as exc:  # a database fault: its reason says it all
                why = f"{exc} ({exc.reason})"
                log.warning("expiry sweep failed: %s; trying again in %.1f s", why, interval)
            except Exception:
                # Expired entries stay invisible meanwhile; keep sweeping.
                log.exception("expiry sweep failed; trying again in %.1f s", interval)

    def _sweep(self) -> None:
        """Evict idle sessions now and then (turns also evict as they go)."""
        ttls = [
            a.session_idle_ttl_seconds for a in (self.config.defaults, *self.config.agents.values())
        ]
        interval = min(60.0, max(1.0, min(ttls) / 2))
        while not self._stopped.wait(interval):
            try:
                self.engine.evict_idle()
            except SidecarError as exc:  # a database fault: its reason says it all
                why = f"{exc} ({exc.reason})"
                log.warning("session sweep failed: %s; trying again in %.0f s", why, interval)
            except Exception:
                # A janitor that dies stops every eviction by age; keep sweeping.
                log.exception("session sweep failed; trying again in %.0f s", interval)

    def start(self) -> Addresses:
        """Bind every listener, start serving, and report SERVING.

        Call after the store is open and migrated: SERVING means ready.
        """
        self.listen()
        try:
            self.connect()
        except BaseException:
            self._abort()
            raise
        return self.ready()

    def listen(self) -> Addresses:
        """Bind every listener and start the API and health ones: health
        answers NOT_SERVING and the API refuses calls (the gate) until
        ready(). Needs no database. The MCP listener serves from here too,
        refusing requests (503, DATABASE_UNAVAILABLE) until ready(); the
        token files are re-read from here on."""
        server = self.config.server
        # The health servicer starts out SERVING for the server as a whole.
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            api = _display(
                server.listen,
                _bind(self._api, server.listen, "the API", tls_credentials(self.config)),
            )
            health_address = None
            if server.health_listen:
                # A listener of its own for Kubernetes probes, which dial the
                # pod IP: it can bind all interfaces while the API stays on
                # loopback, and it serves health and nothing else.
                self._health_server = grpc.server(
                    futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
                    options=[*_SERVER_OPTIONS, *health_options(server)],
                )
                health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
                port = _bind(self._health_server, server.health_listen, "health checks")
                health_address = _display(server.health_listen, port)
            metrics_address = None
            if server.metrics_listen:
                host, _, port_text = server.metrics_listen.rpartition(":")
                try:
                    self._metrics_server = serve_metrics(
                        host.strip("[]"), int(port_text), self.metrics, server
                    )
                except OSError as exc:
                    raise BindError(
                        f"cannot listen for metrics on {server.metrics_listen}: {exc.strerror}"
                    ) from None
                metrics_address = f"{host}:{self._metrics_server.server_port}"
            mcp_url = None
            if self._mcp is not None:
                self._mcp_socket = _listening_socket(server.mcp_listen, "MCP")
                mcp_url = self._mcp.start(self._mcp_socket)
        except BaseException:
            self._close_listeners()
            raise
        # A token rotated or revoked while the daemon waits is followed.
        self._reloads.start()
        self._api.start()
        if server.listen.startswith("unix:"):
            # Only this user may connect: the socket is the API's front door.
            os.chmod(server.listen.removeprefix("unix:").removeprefix("//"), 0o600)
        if self._health_server is not None:
            self._health_server.start()
        self._addresses = Addresses(
            api=api, health=health_address, metrics=metrics_address, mcp=mcp_url
        )
        return self._addresses

    def connect(self) -> None:
        """What needs the open store before serving: the page tokens' key,
        and the change feed (so other processes' writes are heard before
        anything cached is served). May be called again after it failed."""
        self.pages.use(self.store.page_token_key())
        self.engine.start_feed()

    def ready(self) -> Addresses:
        """Start the background threads, open the gate and report SERVING.
        After listen() and connect()."""
        server = self.config.server
        try:
            # The watcher's next read may be up to an interval away: a token
            # rotated or revoked during the wait counts from the first call.
            self._reloads.run_once()
            self._janitor.start()
            if server.expiry_sweep_seconds:
                self._expiry.start()
            self.engine.start_background()  # retention, the semantic backfill
        except BaseException:
            self._abort()
            raise
        self._ready = True
        self.gate.open()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self._addresses

    def _abort(self) -> None:
        """Undo listen(), connect() and whatever ready() started: start-up
        failed, or stopped before SERVING."""
        self._stopped.set()  # ends the janitor and the expiry sweep
        self._api.stop(None).wait()
        if self._mcp is not None:
            self._mcp.stop(1)  # only refusals in flight; 0 logs a cancel
        self._reloads.stop()
        self.engine.abort()
        self._close_listeners()
        self._shut_tracing()

    def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight ones finish.

        Returns once every in-flight call has finished or `grace` seconds
        have passed, whichever is first, and then any compact index being
        saved (waiting up to `grace`, at least INDEX_SAVE_GRACE_SECONDS),
        so the store can be closed. Idempotent.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        # Probes see NOT_SERVING first, so traffic is steered away while the
        # API drains; the health listener stays up until the API is done.
        self.health.enter_graceful_shutdown()
        if not self._ready:
            # Stopped while waiting for the database (or ready() failed):
            # every call was refused; _abort ends what had started.
            self._abort()
            return
        grace = self.config.server.grace_seconds if grace is None else grace
        # Watches never end on their own: end them now, not after the grace.
        # Without waiting for a retention pass under way: it may wait on a
        # database lock for up to busy_timeout_ms, and new calls must be
        # refused at once.
        self.engine.end_watches()
        # Both drain at once: MCP requests are served by the same engine.
        api_stopped = self._api.stop(grace)
        if self._mcp is not None:
            self._mcp.stop(grace)
        api_stopped.wait()
        self.engine.stop_retention()
        self._reloads.stop()
        if self._expiry.is_alive():
            self._expiry.join()  # a sweep batch is one short transaction
        # A cancelled export lets go of its read at its next response.
        if not self.engine.drain_exports(max(grace, 1.0)):
            # Its read may then fail when the store closes under it.
            log.warning(
                "stopping while %d ExportMemories streams still read the store",
                self.engine.exports_running(),
            )
        # Then the feed and the semantic backfill. An index save takes about a
        # second at a million entries; one that outlasts this is given up
        # (the next start indexes or replays).
        if not self.engine.stop(max(grace, INDEX_SAVE_GRACE_SECONDS)):
            log.warning("stopping while a compact index is still being saved")
        self._close_listeners()
        self._shut_tracing()

    def _shut_tracing(self) -> None:
        if self._tracing is not None:
            self.store.trace(None)
            self._tracing.shutdown()

    def _close_listeners(self) -> None:
        if self._mcp_socket is not None:
            self._mcp_socket.close()  # uvicorn closed it already once it served
            self._mcp_socket = None
        if self._health_server is not None:
            self._health_server.stop(None).wait()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        self._pool.shutdown(wait=False)
