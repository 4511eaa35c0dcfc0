"""The MCP listener's sessions: how many each tenant may hold, and how long idle.

The SDK keeps one table of MCP sessions for the whole listener (10,000 by
default, idle 30 minutes) and answers 503 to everyone once it is full: one
token could fill it and lock every other token out. In front of it (behind
the gate, sidecar.api.mcp_http), every request that would open a session
(a handshake-era request without `Mcp-Session-Id`) is admitted against three
caps, smallest first:

- `server.mcp_max_sessions_per_tenant` (64): per tenant, a token and a scope
  (agent id, user id). Each scope a token opens sessions in counts on its own,
  as the SDK keeps a session to both.
- `server.mcp_max_sessions_per_token` (256): per token, all its scopes
  together, so a token granted every scope cannot fill the listener either.
- `server.mcp_max_sessions` (2048): all sessions; the SDK's own cap is set to
  it, so its 503 is never reached first.

The token is told apart by its SHA-256 digest, as the SDK keeps a session to
it. Without auth configured a bearer token is not checked, so a client can
name any token and any scope: only `mcp_max_sessions` holds them all then.

A request over a cap is answered 429 with a JSON-RPC error (RESOURCE_EXHAUSTED,
MCP_SESSIONS_EXHAUSTED) naming the cap and how to free a slot: end a session
(DELETE) or let one idle out. It is that tenant's own answer: other tenants'
sessions are not counted against it, and it is counted in
memory_mcp_sessions_refused_total{limit}.

A session with no request in flight (no request being served, no GET stream
open) for `server.mcp_session_idle_minutes` is closed by a sweep: an HTTP
DELETE for it goes to the SDK, as the client's own would, and its runtime
session ends as on DELETE. The SDK's own idle timer is kept as a backstop at
twice that.

What a session holds, and its bound: the SDK's transport and the task that
serves it, memory streams of no buffer between them, a stream of at most 16
messages per request in flight (a connection serves one request at a time,
and connections are capped: sidecar.api.bounds), no event store (nothing is
kept for replay), and here one `_Open` entry: about 40 KB in all, the same
for every session (`make bench`, section 25), so the caps bound the memory:
2.5 MB per tenant, 10 MB per token, 80 MB in all by default. Its runtime
session (a frozen snapshot) is bounded by `max_sessions` and
`max_sessions_total` (sidecar.domain.sessions).

Owns: the session table (tenant, in-flight requests, idle since), admission,
the idle sweep. Must not touch: the gate's checks (sidecar.api.mcp_http), what
a runtime session holds (sidecar.domain), the SDK's internals (only its ASGI
interface).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.to_thread
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.types import ASGIApp, Message, Receive, Send
from starlette.types import Scope as AsgiScope

from sidecar.core.errors import Reason, ResourceExhausted
from sidecar.core.memory import Scope

log = logging.getLogger("sidecar.mcp_sessions")

# Where the gate leaves a request's tenant in the ASGI scope.
TENANT = "memory_sidecar.tenant"
# Where the gate leaves the principal the SDK keeps a session to.
PRINCIPAL = "user"
MCP_SESSION_HEADER = b"mcp-session-id"
_VERSION_HEADER = b"mcp-protocol-version"
# The sweep looks for idle sessions this often at most (and at least four
# times per idle timeout), so a session outlives its timeout by little.
SWEEP_SECONDS = 30.0

Limit = Literal["tenant", "token", "total"]


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a session counts against: a token's digest (None without auth) and a scope."""

    digest: str | None
    scope: Scope


@dataclass(frozen=True, slots=True)
class Caps:
    """The caps on open sessions and the idle timeout (see the module's docstring)."""

    per_tenant: int
    per_token: int
    total: int
    idle_seconds: float

    @property
    def sweep_seconds(self) -> float:
        return min(SWEEP_SECONDS, self.idle_seconds / 4)


@dataclass(slots=True)
class _Open:
    """One open session: whose, whether ending it ends a runtime session, its activity."""

    tenant: Tenant
    principal: Any
    # The runtime session is the MCP session's unless the client named one
    # (X-Memory-Session-Id), which DELETE leaves alone too.
    ends_runtime: bool
    in_flight: int
    idle_since: float


class SessionTable:
    """Sessions open and being opened, by tenant; in the listener's event loop only.

    >>> table = SessionTable(Caps(per_tenant=1, per_token=2, total=3, idle_seconds=60))
    >>> ada = Tenant("digest", Scope("coder", "ada"))
    >>> table.admit(ada) is None
    True
    >>> table.admit(ada).reason
    'MCP_SESSIONS_EXHAUSTED'
    """

    def __init__(self, caps: Caps, clock: Callable[[], float] = time.monotonic) -> None:
        self.caps = caps
        self._clock = clock
        self._open: dict[str, _Open] = {}
        # Sessions open and being opened (admitted, not yet answered).
        self._tenants: Counter[Tenant] = Counter()
        self._tokens: Counter[str | None] = Counter()

    def __len__(self) -> int:
        return self._tenants.total()

    def full(self, tenant: Tenant) -> Limit | None:
        """The smallest cap `tenant` is at, or None when it may open one more."""
        if self._tenants[tenant] >= self.caps.per_tenant:
            return "tenant"
        if self._tokens[tenant.digest] >= self.caps.per_token:
            return "token"
        if len(self) >= self.caps.total:
            return "total"
        return None

    def admit(self, tenant: Tenant) -> ResourceExhausted | None:
        """Take a slot for a session `tenant` is opening, or the refusal."""
        limit = self.full(tenant)
        if limit is not None:
            return self._refusal(tenant, limit)
        self._tenants[tenant] += 1
        self._tokens[tenant.digest] += 1
        return None

    def release(self, tenant: Tenant) -> None:
        """Give back a slot `admit` took (the session did not open, or ended)."""
        # Emptied keys go, so the counters hold only tenants with sessions.
        self._tenants[tenant] -= 1
        if self._tenants[tenant] <= 0:
            del self._tenants[tenant]
        self._tokens[tenant.digest] -= 1
        if self._tokens[tenant.digest] <= 0:
            del self._tokens[tenant.digest]

    def opened(self, session_id: str, tenant: Tenant, principal: Any, ends_runtime: bool) -> None:
        """The admitted session is open, as `session_id`."""
        self._open[session_id] = _Open(tenant, principal, ends_runtime, 0, self._clock())

    def owned(self, session_id: str, tenant: Tenant) -> _Open | None:
        """The open session `session_id` when `tenant` opened it."""
        found = self._open.get(session_id)
        return found if found is not None and found.tenant == tenant else None

    def close(self, session_id: str) -> _Open | None:
        """Forget an open session and give back its slot; what it was, if open."""
        found = self._open.pop(session_id, None)
        if found is not None:
            self.release(found.tenant)
        return found

    def begin(self, session: _Open) -> None:
        session.in_flight += 1

    def end(self, session: _Open) -> None:
        session.in_flight -= 1
        if not session.in_flight:
            session.idle_since = self._clock()

    def idle(self) -> list[str]:
        """The sessions with nothing in flight for the idle timeout."""
        since = self._clock() - self.caps.idle_seconds
        return [sid for sid, s in self._open.items() if not s.in_flight and s.idle_since <= since]

    def close_idle(self, session_id: str) -> _Open | None:
        """`close` the session if it is idle still (a request may have come
        for it since `idle` listed it), else leave it open."""
        found = self._open.get(session_id)
        if found is None or found.in_flight:
            return None
        if found.idle_since > self._clock() - self.caps.idle_seconds:
            return None
        return self.close(session_id)

    def _refusal(self, tenant: Tenant, limit: Limit) -> ResourceExhausted:
        cap, whose = {
            "tenant": (self.caps.per_tenant, "this token holds in this scope"),
            "token": (self.caps.per_token, "this token holds in all its scopes"),
            "total": (self.caps.total, "the listener holds for all tokens"),
        }[limit]
        key = {"tenant": "_per_tenant", "token": "_per_token", "total": ""}[limit]
        minutes = f"{self.caps.idle_seconds / 60:g}"
        return ResourceExhausted(
            f"too many open MCP sessions: {whose} {cap}, server.mcp_max_sessions{key}; "
            f"end one (HTTP DELETE with its Mcp-Session-Id) or wait until one has been "
            f"idle {minutes} minutes (server.mcp_session_idle_minutes)",
            reason=Reason.MCP_SESSIONS_EXHAUSTED,
            metadata={"limit": limit, "max": str(cap), "idle_minutes": minutes},
        )


def _header(scope: AsgiScope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


class SessionCaps:
    """ASGI middleware behind the gate: admits new sessions, tracks open ones."""

    def __init__(
        self,
        app: ASGIApp,
        table: SessionTable,
        *,
        refuse: Callable[[AsgiScope, Receive, Send, ResourceExhausted], Any],
        refused: Callable[[Limit], None],
        end_runtime: Callable[[Scope, str], Any],
        opened: Callable[[int], None] = lambda _: None,
    ) -> None:
        self._app = app
        self.table = table
        self._refuse = refuse
        self._refused = refused
        self._end_runtime = end_runtime
        self._count = opened

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        tenant = scope.get(TENANT)
        if scope["type"] != "http" or not isinstance(tenant, Tenant):
            await self._app(scope, receive, send)
            return
        session_id = _header(scope, MCP_SESSION_HEADER)
        if session_id is not None:
            await self._serve(session_id, tenant, scope, receive, send)
            return
        version = _header(scope, _VERSION_HEADER)
        if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            # A 2026-07-28 request: the SDK serves it without a session.
            await self._app(scope, receive, send)
            return
        await self._open_one(tenant, scope, receive, send)

    async def _open_one(
        self, tenant: Tenant, scope: AsgiScope, receive: Receive, send: Send
    ) -> None:
        """A request the SDK opens a session for (kept if it answers < 400)."""
        refusal = self.table.admit(tenant)
        if refusal is not None:
            self._refused(refusal.metadata["limit"])  # type: ignore[arg-type]
            await self._refuse(scope, receive, send, refusal)
            return
        answer: dict[str, Any] = {}

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                for key, value in message.get("headers", ()):
                    if key.lower() == MCP_SESSION_HEADER:
                        answer["session"] = value.decode("latin-1")
            await send(message)

        kept = False
        try:
            await self._app(scope, receive, watch)
            session_id = answer.get("session")
            kept = session_id is not None and answer.get("status", 500) < 400
            if kept:
                ends = _header(scope, b"x-memory-session-id") is None
                self.table.opened(str(session_id), tenant, scope.get(PRINCIPAL), ends)
        finally:
            if not kept:
                self.table.release(tenant)
            self._count(len(self.table))

    async def _serve(
        self, session_id: str, tenant: Tenant, scope: AsgiScope, receive: Receive, send: Send
    ) -> None:
        """A request for an open session: in flight while served; forgotten when
        it ended (DELETE) or the SDK no longer knows it (404)."""
        session = self.table.owned(session_id, tenant)
        if session is None:  # another tenant's, or unknown: the SDK answers 404
            await self._app(scope, receive, send)
            return
        status: list[int] = []

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        self.table.begin(session)
        try:
            await self._app(scope, receive, watch)
        finally:
            self.table.end(session)
        ended = scope["method"] == "DELETE" and status and 200 <= status[0] < 300
        if ended and self.table.close(session_id) is not None:
            self._count(len(self.table))
        elif status == [404] and self.table.close(session_id) is not None:
            # The SDK ended it on its own (its backstop timer, a crash).
            self._count(len(self.table))
            await self._ended(session_id, session)

    async def _ended(self, session_id: str, session: _Open) -> None:
        """End the runtime session of an MCP session that ended without a
        DELETE of its client's (whose own end the gate sees to)."""
        if not session.ends_runtime:
            return
        try:
            await anyio.to_thread.run_sync(self._end_runtime, session.tenant.scope, session_id)
        except Exception:  # its snapshot goes with the least recently used then
            log.exception("ending the runtime session of MCP session %s failed", session_id)

    async def expire(self, endpoint: ASGIApp, host: str) -> int:
        """Close the sessions idle for the timeout: the SDK's transport by a
        DELETE through `endpoint` (Host: `host`), then the runtime session."""
        closed = 0
        for session_id in self.table.idle():
            # Each DELETE awaits: the next session is checked again when its turn comes.
            session = self.table.close_idle(session_id)
            if session is None:
                continue
            closed += 1
            self._count(len(self.table))
            await _delete(endpoint, host, session_id, session.principal)
            await self._ended(session_id, session)
            log.info("closed MCP session %s: idle for server.mcp_session_idle_minutes", session_id)
        return closed

    async def sweep(self, endpoint: ASGIApp, host: str) -> None:
        """Expire idle sessions for as long as the listener runs."""
        while True:
            await anyio.sleep(self.table.caps.sweep_seconds)
            try:
                await self.expire(endpoint, host)
            except Exception:  # one failed sweep must not end the next ones
                log.exception("the MCP idle-session sweep failed")


async def _delete(endpoint: ASGIApp, host: str, session_id: str, principal: Any) -> int | None:
    """DELETE `session_id` as its owner, through the SDK's ASGI app; the status."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "DELETE",
        "scheme": "http",
        "path": "/mcp",
        "raw_path": b"/mcp",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", host.encode()), (MCP_SESSION_HEADER, session_id.encode())],
        "client": None,
        "server": None,
        PRINCIPAL: principal,
    }
    status: list[int] = []
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:  # nothing more: as a client gone once its request is sent
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await endpoint(scope, receive, send)
    return status[0] if status else None
