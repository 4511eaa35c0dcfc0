"""What refused credentials, and tokens sent to a daemon that checks none,
leave in the log.

A refused bearer token (TOKEN_MISSING, TOKEN_INVALID) on the API or the MCP
listener is a warning, and so is a bearer token sent to a daemon with no
token configured (the call is served as anyone's: the client believes it is
protected and is not). A client retrying in a loop, or a scanner, would
otherwise write a line per request: each kind of line (transport and
reason) is logged at most once per `every` seconds, and the next one says
how many were left out since. Lines name the transport, the reason and the
method or path, never the token, its length or its digest.

    >>> auth_log = AuthLog(every=60)
    >>> auth_log.refused("gRPC", "TOKEN_INVALID", "/memory.v1.MemoryService/AddMemory")
    >>> auth_log.ignored("MCP", "POST /mcp")

Owns: the rate limit on these lines (a monotonic clock passed in), their
wording, and TokenIgnored, the interceptor that notices a token a daemon
without auth was sent.
Must not touch: deciding whether a token is valid (sidecar.api.interceptors,
sidecar.api.access), responses, metrics, os.environ.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger("sidecar.auth")

# At most one line per kind per minute: a scanner's thousand tries a
# minute are one line, and an operator watching a client fail sees it soon.
EVERY_SECONDS = 60.0


@dataclass(slots=True)
class _Kind:
    """When a kind of line was last logged, and how many were left out since."""

    logged_at: float
    left_out: int = 0


class AuthLog:
    """Rate-limited warnings about credentials (see the module's docstring)."""

    def __init__(
        self, every: float = EVERY_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._every = every
        self._clock = clock
        self._lock = threading.Lock()
        # Keyed by (transport, reason): a bounded set.
        self._kinds: dict[tuple[str, str], _Kind] = {}

    def refused(self, transport: str, reason: str, what: str) -> None:
        """A request refused for its credentials (`what`: the method or path)."""
        self._warn(
            (transport, reason),
            f"refused {what} over {transport}: {reason} (a bearer token missing or not valid)",
        )

    def ignored(self, transport: str, what: str) -> None:
        """A bearer token sent to a daemon that checks none."""
        self._warn(
            (transport, "token ignored"),
            f"{what} over {transport} came with a bearer token, but this daemon checks none "
            "(no auth_token_file or auth_tokens_file): the token was ignored and the request "
            "served as anyone's",
        )

    def _warn(self, kind: tuple[str, str], message: str) -> None:
        now = self._clock()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen.logged_at < self._every:
                seen.left_out += 1
                return
            left_out = seen.left_out if seen is not None else 0
            self._kinds[kind] = _Kind(now)
        if left_out:
            message += f"; {left_out} more like it not logged in the last {self._every:g} s"
        log.warning("%s", message)


class TokenIgnored(grpc.ServerInterceptor):
    """On a daemon without auth: warns (through AuthLog) of a call that sent
    `authorization`, and lets it through unchanged."""

    def __init__(self, auth_log: AuthLog) -> None:
        self._log = auth_log

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        for key, _value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                self._log.ignored("gRPC", handler_call_details.method)
                break
        return continuation(handler_call_details)
