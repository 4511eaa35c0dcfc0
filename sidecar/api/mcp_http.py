"""The daemon's MCP listener: streamable HTTP on `server.mcp_listen`.

Serves sidecar.api.mcp_server at `/mcp` from the daemon's own process, over its
own MemoryEngine: a write through MCP refreshes frozen blocks exactly as a
gRPC write does, and sessions, snapshots and caches have one owner. The
SDK's session manager and transport run on uvicorn, in a thread with its own
event loop; engine calls leave that loop for worker threads (at most
`server.max_workers` at once).

Every HTTP request is bound before the SDK sees it (`_Gate`):

- `Authorization: Bearer <token>`, when `server.auth_token_file` or
  `server.auth_tokens_file` is set: the same tokens, checked the same way
  as on the API (401 without a valid one).
- `X-Memory-Agent-Id` and `X-Memory-User-Id` name the scope (absent: ""),
  and the token's grant must allow it (403 otherwise), as the API refuses
  a request's scope. Tool arguments cannot name a scope.
- A refused token, and a token sent to a daemon without auth, are logged
  (sidecar.api.auth_log: rate-limited, without the token).
- While the daemon waits for its database at start-up, every request with
  a valid token is refused: 503, DATABASE_UNAVAILABLE (as the API's calls).
- The runtime session (InjectForTurn's session_id) is `X-Memory-Session-Id`
  when sent, else the MCP session (`Mcp-Session-Id`), else `mcp`: a
  2026-07-28 client has no MCP session, and shares one per scope. Ending
  an MCP session (DELETE, or idle: sidecar.api.mcp_sessions) ends its
  runtime session.
- Opening an MCP session is admitted against the caps per token and scope,
  per token and in all (sidecar.api.mcp_sessions): 429 beyond them.

An MCP session stays with the token and the scope that opened it: the SDK
answers 404 to a request for it that presents another (its session owner is
set from both). On a loopback address the Host and Origin headers must name
that address (the SDK's DNS-rebinding check); off loopback a token is
required (sidecar.config.settings), which a rebinding page does not have.

Owns: the gate (token, scope headers, grant, session), the in-process
Backend, the uvicorn thread and its start and stop. Must not touch: what the
tools do (sidecar.domain.tools), the MCP handlers (sidecar.api.mcp_server), binding the
socket (sidecar.api.server hands it over), os.environ.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import uvicorn
from mcp.server import Server
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Send
from starlette.types import Scope as AsgiScope
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from sidecar.api import mcp_server
from sidecar.api.access import ANY, Grant, authorize, bearer_token, granted
from sidecar.api.auth_log import AuthLog
from sidecar.api.bounds import ACCEPT_BURST, bounded_protocol, connection_caps, refusals
from sidecar.api.mcp_sessions import TENANT, Caps, SessionCaps, SessionTable, Tenant
from sidecar.config.settings import Config, is_loopback
from sidecar.core.errors import (
    InvalidArgument,
    PermissionDenied,
    Reason,
    SidecarError,
    Unauthenticated,
)
from sidecar.core.limits import Limits, checked
from sidecar.core.memory import Scope
from sidecar.core.metrics import Metrics
from sidecar.domain.tool_definitions import SCHEMAS, ToolDef, ToolResult
from sidecar.domain.tools import Tools

if TYPE_CHECKING:
    import socket

    from sidecar.api.interceptors import AuthInterceptor

log = logging.getLogger("sidecar.mcp_http")

PATH = "/mcp"
AGENT_HEADER = "x-memory-agent-id"
USER_HEADER = "x-memory-user-id"
SESSION_HEADER = "x-memory-session-id"
MCP_SESSION_HEADER = "mcp-session-id"
# The runtime session of requests that name none (2026-07-28 clients).
DEFAULT_SESSION = "mcp"
# Where the gate leaves a request's Binding in the ASGI scope.
_BINDING = "memory_sidecar.binding"
_STATUS = {
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    # A tenant at its cap on MCP sessions (sidecar.api.mcp_sessions).
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
}
# How long start() waits for the thread to serve, at most.
START_TIMEOUT_SECONDS = 30.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Binding:
    """What a request may address: its scope, its token's grant, its session."""

    scope: Scope
    grant: Grant
    session_id: str


@dataclass(frozen=True, slots=True)
class _Local:
    """sidecar.api.mcp_server.Backend over the daemon's own Tools, under the grant."""

    tools: Tools
    binding: Binding

    def _authorized(self, run: Callable[[], T]) -> T:
        # The gate refused a scope outside the grant already; this is the
        # check every gRPC handler makes, run where the engine is called.
        with granted(self.binding.grant):
            authorize(self.binding.scope)
            return run()

    def definitions(self) -> list[ToolDef]:
        return self._authorized(lambda: self.tools.definitions(self.binding.scope))

    def call(self, name: str, arguments: Any) -> ToolResult:
        b = self.binding
        return self._authorized(lambda: self.tools.call(b.scope, b.session_id, name, arguments))

    def frozen_block(self) -> str:
        b = self.binding
        return self._authorized(lambda: self.tools.frozen_block(b.scope, b.session_id))

    def turn_context(self, user_message: str) -> str:
        b, message = self.binding, user_message
        return self._authorized(lambda: self.tools.turn_context(b.scope, b.session_id, message))


def _headers(scope: AsgiScope) -> dict[str, str]:
    """A request's headers by name, the first of each (as Starlette's Headers
    reads them): one pass, where each Headers lookup is one more."""
    found: dict[str, str] = {}
    for name, value in scope["headers"]:
        key = name.decode("latin-1")
        if key not in found:
            found[key] = value.decode("latin-1")
    return found


@functools.lru_cache(maxsize=1024)
def _principal(agent_id: str, user_id: str, digest: str | None) -> AuthenticatedUser:
    """Who the SDK keeps an MCP session to: the scope and the token's digest."""
    client_id = json.dumps([agent_id, user_id])
    return AuthenticatedUser(AccessToken(token="", client_id=client_id, scopes=[], subject=digest))


def _header(headers: Mapping[str, str], name: str, limit: int) -> str:
    # HTTP header values travel as bytes; ids are UTF-8 (ASGI hands them
    # over as Latin-1).
    raw = headers.get(name, "")
    try:
        value = raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise InvalidArgument(
            f"the {name} header is not UTF-8",
            reason=Reason.HEADER_INVALID,
            metadata={"header": name},
        ) from None
    return checked(name, value, limit)


def _refusal(exc: SidecarError) -> JSONResponse:
    """A refused request: its HTTP status, and the JSON-RPC error MCP clients read."""
    error = mcp_server.to_mcp_error(exc).error.model_dump(mode="json", exclude_none=True)
    status = _STATUS.get(exc.code, 400)
    headers = {"WWW-Authenticate": 'Bearer realm="memory-sidecar"'} if status == 401 else None
    return JSONResponse(
        {"jsonrpc": "2.0", "id": None, "error": error}, status_code=status, headers=headers
    )


class _Gate:
    """ASGI middleware: binds each HTTP request (see the module's docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        auth: AuthInterceptor | None,
        limits: Limits,
        end_session: Callable[[Binding], Any],
        refusal: Callable[[], SidecarError | None],
        auth_log: AuthLog,
    ) -> None:
        self._app = app
        self._auth = auth
        self._auth_log = auth_log
        self._limits = limits
        self._end_session = end_session
        self._refusal = refusal

    def bind(self, headers: Mapping[str, str]) -> tuple[Binding, str | None]:
        """The request's binding and its token's digest; raises what to refuse."""
        presented = bearer_token(headers.get("authorization", "").encode("latin-1"))
        grant = ANY
        if self._auth is not None:
            grant = self._auth.authenticate(presented, header="Authorization")
        elif presented:
            self._auth_log.ignored("MCP", PATH)
        limit = self._limits.id_chars
        scope = Scope(
            agent_id=_header(headers, AGENT_HEADER, limit),
            user_id=_header(headers, USER_HEADER, limit),
        )
        refusal = grant.refusal(scope)
        if refusal is not None:
            raise PermissionDenied(
                f"{refusal.message} (the {AGENT_HEADER} and {USER_HEADER} headers name the scope)",
                reason=refusal.reason,
                metadata=refusal.metadata,
            )
        session = (
            _header(headers, SESSION_HEADER, limit)
            or _header(headers, MCP_SESSION_HEADER, limit)
            or DEFAULT_SESSION
        )
        digest = hashlib.sha256(presented).hexdigest() if presented else None
        return Binding(scope, grant, session), digest

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = _headers(scope)
        try:
            binding, digest = self.bind(headers)
            # While the daemon waits for its database (after the token, as
            # the API's gate comes after its auth): 503, DATABASE_UNAVAILABLE.
            waiting = self._refusal()
            if waiting is not None:
                raise waiting
        except SidecarError as exc:
            if isinstance(exc, Unauthenticated):
                self._auth_log.refused("MCP", exc.reason, f"{scope['method']} {PATH}")
            await _refusal(exc)(scope, receive, send)
            return
        scope[_BINDING] = binding
        scope[TENANT] = Tenant(digest, binding.scope)
        # The SDK keeps an MCP session to the principal that opened it.
        scope["user"] = _principal(binding.scope.agent_id, binding.scope.user_id, digest)
        ends = (
            scope["method"] == "DELETE"
            and MCP_SESSION_HEADER in headers
            and SESSION_HEADER not in headers
        )
        if not ends:
            await self._app(scope, receive, send)
            return

        async def ending(message: Message) -> None:
            # Before the client hears the session is gone, so is its snapshot.
            if message["type"] == "http.response.start" and 200 <= message["status"] < 300:
                await anyio.to_thread.run_sync(self._end_session, binding)
            await send(message)

        await self._app(scope, receive, ending)


def _declares_headers(schema: Any) -> bool:
    """Whether a JSON schema annotates anything with `x-mcp-header` (an
    Mcp-Param header the SDK checks against the argument), anywhere in it."""
    if isinstance(schema, dict):
        return "x-mcp-header" in schema or any(_declares_headers(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_declares_headers(v) for v in schema)
    return False


def _resolve(tools: Tools) -> mcp_server.Resolve:
    def resolve(ctx: mcp_server.Context) -> mcp_server.Backend:
        request = ctx.request
        binding = request.scope.get(_BINDING) if request is not None else None
        if not isinstance(binding, Binding):
            raise SidecarError("an MCP request reached the tools without passing the gate")
        return _Local(tools, binding)

    return resolve


class McpListener:
    """The MCP server on a socket sidecar.api.server bound, in a thread of its own.

    >>> listener = McpListener(config, tools, metrics=metrics, end_session=...)
    >>> url = listener.start(sock)      # serving once it returns
    >>> listener.stop(grace=10)
    """

    def __init__(
        self,
        config: Config,
        tools: Tools,
        *,
        metrics: Metrics,
        end_session: Callable[[Scope, str], Any],
        auth: AuthInterceptor | None = None,
        auth_log: AuthLog | None = None,
        refusal: Callable[[], SidecarError | None] = lambda: None,
    ) -> None:
        self._config, self._tools, self._auth = config, tools, auth
        self._auth_log = auth_log or AuthLog()
        # Why requests are refused (the daemon waits for its database), or None.
        self._refused = refusal
        self._calls = metrics.mcp_tool_calls
        self._http_refused = refusals(metrics, "mcp")
        self._sessions_refused = metrics.mcp_sessions_refused
        self._sessions_open = metrics.mcp_sessions_open
        # The session table and its middleware, once start() built the app.
        self.sessions: SessionCaps | None = None
        self._end_session = end_session
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._uvicorn: uvicorn.Server | None = None

    def _app(self, port: int) -> ASGIApp:
        server = self._config.server
        caps = Caps(
            per_tenant=server.mcp_max_sessions_per_tenant,
            per_token=server.mcp_max_sessions_per_token,
            total=server.mcp_max_sessions,
            idle_seconds=server.mcp_session_idle_minutes * 60,
        )
        manager = StreamableHTTPSessionManager(
            app=self._mcp_server(),
            security_settings=self._security(port),
            max_request_body_size=server.max_request_bytes,
            # Each answer as one JSON body rather than an SSE stream: the
            # server sends nothing before its answer, and an SSE stream per
            # call costs more than the call (make bench, section 17).
            json_response=True,
            # The caps in front (SessionCaps) refuse first, per tenant; the
            # SDK's own are a backstop (its timer sees the same idleness).
            max_sessions=caps.total,
            session_idle_timeout=caps.idle_seconds * 2,
        )
        endpoint = StreamableHTTPASGIApp(manager)
        # The sweep's DELETE passes the SDK's Host check as a client's would.
        host = f"127.0.0.1:{port}"

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with manager.run(), anyio.create_task_group() as tasks:
                tasks.start_soon(sessions.sweep, endpoint, host)
                self._ready.set()
                yield
                tasks.cancel_scope.cancel()

        def end(binding: Binding) -> None:
            self._end_session(binding.scope, binding.session_id)

        app = Starlette(routes=[Route(PATH, endpoint=endpoint)], lifespan=lifespan)
        sessions = self.sessions = SessionCaps(
            app,
            SessionTable(caps),
            refuse=lambda scope, receive, send, exc: _refusal(exc)(scope, receive, send),
            refused=lambda limit: self._sessions_refused.labels(limit).inc(),
            end_runtime=self._end_session,
            opened=self._sessions_open.set,
        )
        return _Gate(sessions, self._auth, server.limits(), end, self._refused, self._auth_log)

    def _mcp_server(self) -> Server[Any]:
        """sidecar.api.mcp_server over the tools, its engine calls on worker
        threads, its tool calls counted."""
        # The input schemas do not depend on the scope (only the descriptions
        # state its budgets): read once, for the SDK's Mcp-Param check. A
        # schema that declares no Mcp-Param header has nothing to check (the
        # SDK walks it on every call to find out): None, as the SDK asks.
        schemas = {name: schema for name, schema in SCHEMAS.items() if _declares_headers(schema)}
        counter = self._calls
        # As many engine calls at once as the API has workers.
        limiter = anyio.CapacityLimiter(self._config.server.max_workers)

        async def offload(run: Callable[[], T]) -> T:
            return await anyio.to_thread.run_sync(run, limiter=limiter)

        # The counter's children, looked up once (the labels are bounded:
        # mcp_server.TOOL_NAMES and "unknown", three outcomes).
        children: dict[tuple[str, str], Any] = {}

        def counted(tool: str, outcome: str) -> None:
            child = children.get((tool, outcome))
            if child is None:
                child = children[tool, outcome] = counter.labels(tool, outcome)
            child.inc()

        return mcp_server.build(
            _resolve(self._tools),
            counted=counted,
            offload=offload,
            get_tool_input_schema=schemas.get,
        )

    def _security(self, port: int) -> TransportSecuritySettings:
        """On a loopback address, the SDK's DNS-rebinding check: Host and
        Origin must name the address itself. Off loopback a token is
        required instead (sidecar.config.settings)."""
        server = self._config.server
        if not is_loopback(server.mcp_listen):
            return TransportSecuritySettings(enable_dns_rebinding_protection=False)
        hosts = ("127.0.0.1", "localhost", "[::1]")
        scheme = "https" if server.tls_cert_file else "http"
        return TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=[f"{h}:{port}" for h in hosts],
            allowed_origins=[f"{scheme}://{h}:{port}" for h in hosts],
        )

    def _uvicorn_config(self, app: ASGIApp) -> uvicorn.Config:
        server = self._config.server
        tls: dict[str, Any] = {}
        if server.tls_cert_file:
            tls = {"ssl_certfile": server.tls_cert_file, "ssl_keyfile": server.tls_key_file}
            if server.tls_client_ca_file:
                tls["ssl_ca_certs"] = server.tls_client_ca_file
                tls["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        return uvicorn.Config(
            app,
            # The daemon's logging stays as sidecar.ops.daemon set it up.
            log_config=None,
            log_level="debug" if server.log_level == "debug" else "warning",
            access_log=False,
            # httptools when installed (the mcp extra asks for it), else h11:
            # parsing in C is a good share of an MCP call (make bench, 17),
            # closing connections beyond its cap, and requests that do not
            # arrive in time (sidecar.api.bounds).
            http=bounded_protocol(
                AutoHTTPProtocol,
                connection_caps(server).mcp,
                server.http_request_timeout_seconds,
                self._http_refused,
            ),
            # Accepted at once before the cap can close them: a few.
            backlog=ACCEPT_BURST,
            lifespan="on",
            timeout_graceful_shutdown=max(1, round(server.grace_seconds)),
            **tls,
        )

    def start(self, sock: socket.socket) -> str:
        """Serve on `sock` (bound and listening); return the URL clients use."""
        port = sock.getsockname()[1]
        config = self._uvicorn_config(self._app(port))
        config.load()  # a bad certificate fails here, not in the thread
        self._uvicorn = uvicorn.Server(config)

        def run() -> None:
            try:
                assert self._uvicorn is not None
                self._uvicorn.run(sockets=[sock])
            except BaseException as exc:  # uvicorn exits with SystemExit on a failed start
                self._failure = exc
            finally:
                self._ready.set()

        self._thread = threading.Thread(target=run, name="mcp", daemon=True)
        self._thread.start()
        started = self._ready.wait(START_TIMEOUT_SECONDS)
        if not started or self._failure is not None or not self._thread.is_alive():
            self.stop(0)
            raise SidecarError(f"the MCP listener did not start: {self._failure!r}")
        host = self._config.server.mcp_listen.rpartition(":")[0]
        scheme = "https" if self._config.server.tls_cert_file else "http"
        return f"{scheme}://{host}:{port}{PATH}"

    def stop(self, grace: float) -> None:
        """Refuse new connections, let requests in flight finish (up to about
        `grace` seconds), end the SDK's sessions. Idempotent."""
        if self._uvicorn is None or self._thread is None:
            return
        self._uvicorn.config.timeout_graceful_shutdown = max(0, round(grace))
        self._uvicorn.should_exit = True
        self._thread.join(grace + START_TIMEOUT_SECONDS)
        if self._thread.is_alive():
            log.warning("the MCP listener is still stopping; leaving it behind")
        self._uvicorn = None
