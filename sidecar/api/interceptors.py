"""Cross-cutting concerns of every call: status mapping, call metrics, auth.

ErrorInterceptor is the one place where exceptions become gRPC statuses.

A SidecarError becomes its status code with a google.rpc.Status carrying an
ErrorInfo (domain memory.v1, the error's stable reason and metadata). Any
other exception is logged with its traceback and becomes INTERNAL, without
leaking the exception's text to the client.

Owns: SidecarError to status (INTERNAL for anything else), the per-call metrics,
bearer-token authentication (TokenFile, AuthInterceptor), the start-up gate
(StartupGate) and `_KINDS`. Must not touch: the engine, the store, request
fields (sidecar.api.service checks each scope against the grant set here).
sidecar.api.tracing imports the private `_KINDS`.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from sidecar.api.access import SINGLE, TOKEN_FILE_BYTES, Grant, TokensFile, bearer_token, granted
from sidecar.api.auth_log import AuthLog
from sidecar.api.reloading import Reloading, Unreadable, read_regular
from sidecar.core.errors import (
    DOMAIN,
    DatabaseUnavailable,
    InvalidArgument,
    Reason,
    SidecarError,
    Unauthenticated,
    Unavailable,
)
from sidecar.core.metrics import Metrics

log = logging.getLogger("sidecar.interceptors")


def to_status(exc: SidecarError) -> grpc.Status:
    """The rich status for an error: code, message, and ErrorInfo."""
    info = error_details_pb2.ErrorInfo(reason=exc.reason, domain=DOMAIN, metadata=exc.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    code = grpc.StatusCode[exc.code]
    status: grpc.Status = rpc_status.to_status(
        status_pb2.Status(code=code.value[0], message=exc.message, details=[detail])
    )
    return status


def _internal() -> grpc.Status:
    return to_status(SidecarError("internal error; the sidecar's log has the details"))


class _Wrapped:
    """An interceptor's wrapped handlers, one per method and handler below.

    A wrapper that depends only on the method and on the handler the
    interceptors below return is built once, not for every call: the same
    handler object below gets the same wrapper (one that changes per call,
    auth's grant, misses and is wrapped afresh)."""

    def __init__(self, wrap: Callable[[str, Any], Any]) -> None:
        self._wrap = wrap
        self._cache: dict[str, tuple[Any, Any]] = {}

    def __call__(self, method: str, handler: Any) -> Any:
        cached = self._cache.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        # Methods are the services' own (an unknown one has no handler).
        self._cache[method] = (handler, wrapped)
        return wrapped


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions raised by MemoryService's handlers (unary, and
    server-streaming ones while they stream) to statuses."""

    def __init__(self) -> None:
        self._wrapped = _Wrapped(self._guarded)

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        return self._wrapped(handler_call_details.method, handler)

    def _guarded(self, method: str, handler: Any) -> Any:
        deserialize = handler.request_deserializer

        def parsed(raw: bytes) -> Any:
            # Parsed here rather than by grpc, so a malformed request (bad
            # wire format, invalid UTF-8 in a string) is INVALID_ARGUMENT
            # with details instead of a bare INTERNAL.
            try:
                return deserialize(raw) if deserialize else raw
            except DecodeError:
                raise InvalidArgument(
                    f"the request is not a valid {method.rpartition('/')[2]} message",
                    reason=Reason.MALFORMED_REQUEST,
                ) from None

        def failed(exc: Exception, context: grpc.ServicerContext) -> None:
            if isinstance(exc, SidecarError):
                context.abort_with_status(to_status(exc))
            # context.abort() inside a handler raises after setting the
            # status: let that one through untouched.
            if cast(Any, context).code() is not None:
                raise exc
            log.exception("unhandled error in %s", method, exc_info=exc)
            context.abort_with_status(_internal())

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            def guarded(raw: bytes, context: grpc.ServicerContext) -> Any:
                try:
                    return behavior(parsed(raw), context)
                except Exception as exc:
                    failed(exc, context)

            return grpc.unary_unary_rpc_method_handler(
                guarded, request_deserializer=None, response_serializer=handler.response_serializer
            )
        if handler.unary_stream is not None and method.startswith("/memory.v1."):
            streaming = handler.unary_stream

            def guarded_stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from streaming(parsed(raw), context)
                except Exception as exc:
                    failed(exc, context)

            return grpc.unary_stream_rpc_method_handler(
                guarded_stream,
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        return handler


_KINDS = (
    ("unary_unary", "unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", "server_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", "client_stream", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", "bidi_stream", grpc.stream_stream_rpc_method_handler),
)


def go_code_name(code: grpc.StatusCode) -> str:
    """A status code as Go's codes.Code.String() spells it (InvalidArgument).

    go-grpc-prometheus labels grpc_code that way, and dashboards and alerts
    written for it match on those values.
    """
    if code is grpc.StatusCode.CANCELLED:
        return "Canceled"
    if code is grpc.StatusCode.OK:
        return "OK"
    return "".join(part.capitalize() for part in code.name.split("_"))


class MetricsInterceptor(grpc.ServerInterceptor):
    """Records go-grpc-prometheus's server metrics for every call.

    grpc_server_started_total, grpc_server_handled_total (with the final
    status code) and grpc_server_handling_seconds, labelled by type, service
    and method: bounded labels, never a request field.
    """

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.perf_counter) -> None:
        self._metrics = metrics
        self._clock = clock
        self._wrapped = _Wrapped(self._counted)

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._wrapped(handler_call_details.method, handler)

    def _counted(self, full_method: str, handler: Any) -> Any:
        service, _, method = full_method.lstrip("/").rpartition("/")
        for attribute, grpc_type, factory in _KINDS:
            behavior = getattr(handler, attribute)
            if behavior is None:
                continue
            labels = (grpc_type, service, method)
            streams = attribute.endswith("_stream")
            wrapped = (self._streaming if streams else self._unary)(behavior, labels)
            return factory(
                wrapped,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _record(
        self, labels: tuple[str, str, str], context: Any, started: float, failed: bool
    ) -> None:
        code = ended_code(context, failed)
        self._metrics.grpc_handled.labels(*labels, go_code_name(code)).inc()
        self._metrics.grpc_seconds.labels(*labels).observe(self._clock() - started)

    def _unary(self, behavior: Callable[..., Any], labels: tuple[str, str, str]) -> Any:
        def call(request: Any, context: Any) -> Any:
            self._metrics.grpc_started.labels(*labels).inc()
            started, failed = self._clock(), True
            try:
                response = behavior(request, context)
                failed = False
                return response
            finally:
                self._record(labels, context, started, failed)

        return call

    def _streaming(self, behavior: Callable[..., Any], labels: tuple[str, str, str]) -> Any:
        def call(request: Any, context: Any) -> Iterator[Any]:
            self._metrics.grpc_started.labels(*labels).inc()
            started, failed = self._clock(), True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                self._record(labels, context, started, failed)

        return call


def ended_code(context: Any, failed: bool) -> grpc.StatusCode:
    """The status a call ended with, as far as its handler saw it.

    A handler that set none either returned (OK), raised (UNKNOWN), or was
    left by a caller that went away: a stream then ends early (its
    generator returns on a cancel callback, or gRPC drops it and it is
    closed with GeneratorExit) with no code set, and the call is no longer
    active. That is the caller's CANCELLED (DEADLINE_EXCEEDED when its
    deadline passed), not a failure of ours.
    """
    code = cast(Any, context).code()
    if code is not None:
        return cast(grpc.StatusCode, code)
    if not context.is_active():
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK


class TokenFile(Reloading[bytes]):
    """A bearer token kept in a file (a mounted Kubernetes Secret, say).

    Re-read by `reload` (a Watcher's), its bytes compared (see Reloading).
    Once serving, a file that is missing, unreadable or empty (caught
    mid-rewrite) keeps the last good token, and says so in the log once;
    only at start-up is it an error.
    """

    what = "auth token file"
    kept = "token"

    def __init__(self, path: str) -> None:
        self._path = Path(path)
        super().__init__("server.auth_token_file")

    def _read(self) -> tuple[bytes | None, str]:
        try:
            token = read_regular(self._path, TOKEN_FILE_BYTES).strip()
        except Unreadable as exc:
            return None, str(exc)
        if not token:
            return None, f"{self._path} is empty"
        return token, ""

    def _news(self, old: bytes, new: bytes) -> str:
        return f"{self.what} changed; using the new token"

    def token(self) -> bytes:
        return self.current()


class AuthInterceptor(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call but health checks.

    The token is `token`'s (which may address every scope) or one of
    `tokens`' (which may address the scopes its grant lists: the call runs
    under that grant, and MemoryService refuses any other scope). The
    comparisons take the same time whatever the guess (hmac.compare_digest),
    and every configured token is compared on every call.
    """

    def __init__(
        self,
        token: TokenFile | None = None,
        tokens: TokensFile | None = None,
        auth_log: AuthLog | None = None,
    ) -> None:
        if token is None and tokens is None:
            raise ValueError("AuthInterceptor needs a token file, a tokens file, or both")
        self._token = token
        self._tokens = tokens
        # Refused calls are logged there, rate-limited (the MCP listener's too).
        self.auth_log = auth_log or AuthLog()

    @property
    def files(self) -> tuple[Reloading[Any], ...]:
        """The files behind the tokens, for a Watcher to reload."""
        return tuple(file for file in (self._token, self._tokens) if file is not None)

    def grant(self, presented: bytes) -> Grant | None:
        """The grant of a presented token, or None when it is not valid (the
        MCP listener, sidecar.api.mcp_http, checks its bearer tokens here too)."""
        grant = None
        if self._tokens is not None:
            grant = self._tokens.grant(presented)
        single = self._token is not None and hmac.compare_digest(presented, self._token.token())
        # A token in both files keeps the tokens file's limits.
        if single and grant is None:
            grant = SINGLE
        return grant

    def authenticate(self, presented: bytes, *, header: str = "authorization") -> Grant:
        """The grant of a presented token; Unauthenticated when there is none
        (TOKEN_MISSING) or it is not valid. `header`: how the caller's
        protocol spells the header, for the message (gRPC metadata keys are
        lowercase; the MCP listener's HTTP says Authorization)."""
        if not presented:
            raise Unauthenticated(
                f"a bearer token is required: send `{header}: Bearer <token>`",
                reason=Reason.TOKEN_MISSING,
            )
        grant = self.grant(presented)
        if grant is None:
            raise Unauthenticated("the bearer token is not valid")
        return grant

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        method = handler_call_details.method
        if method.startswith("/grpc.health.v1.Health/"):
            return continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = bearer_token(value.encode() if isinstance(value, str) else value)
        try:
            grant = self.authenticate(presented)
        except Unauthenticated as error:
            self.auth_log.refused("gRPC", error.reason, method)
            handler = continuation(handler_call_details)
            return None if handler is None else _refusing(handler, to_status(error))
        # Every authenticated call runs under its grant, unrestricted ones
        # too: the grant also says whether the token may erase, and names
        # it for the audit log.
        handler = continuation(handler_call_details)
        return None if handler is None else _granting(handler, grant)


def _granting(handler: Any, grant: Grant) -> Any:
    """The handler, run under `grant` (see sidecar.api.access).

    Interceptors run before the request is parsed, on another thread than
    the handler: the grant goes along inside the behaviour, and the service
    checks each request's scope against it. MemoryService's RPCs are unary
    or server-streaming (tests/api/test_access_tokens.py holds it so); other
    streaming handlers (reflection) address no scope and pass unchanged.
    """
    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            with granted(grant):
                return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            call,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        streaming = handler.unary_stream

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            # The grant is set around each step of the stream, never across
            # a yield: the worker thread serves other calls in between.
            responses = iter(streaming(request, context))
            while True:
                with granted(grant):
                    try:
                        response = next(responses)
                    except StopIteration:
                        return
                yield response

        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler


def _refusing(handler: Any, status: grpc.Status) -> Any:
    """A handler of the same kind that answers every call with `status`."""

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort_with_status(status)

    def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort_with_status(status)
        yield  # pragma: no cover - abort raises

    for attribute, _grpc_type, factory in _KINDS:
        if getattr(handler, attribute) is not None:
            return factory(
                streaming if attribute.endswith("_stream") else unary,
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
    return handler


class StartupGate(grpc.ServerInterceptor):
    """Refuses memory.v1 calls with UNAVAILABLE (DATABASE_UNAVAILABLE) while
    the daemon waits for its database; health checks and reflection pass.

    The API listens from the start, so a client hears why it must wait (and
    that it may retry) instead of a refused connection, and the health
    service on it answers NOT_SERVING. Once opened it costs one attribute
    read per call.
    """

    def __init__(self) -> None:
        # Why calls are refused (the database's last error), or None: open.
        self._waiting: str | None = "the database is not open yet"

    def wait(self, why: str) -> None:
        self._waiting = why

    def open(self) -> None:
        self._waiting = None

    def refusal(self) -> Unavailable | None:
        """What a call is refused with meanwhile (the MCP listener's too);
        None once open."""
        waiting = self._waiting
        if waiting is None:
            return None
        return DatabaseUnavailable(
            f"the sidecar is starting and waits for its database ({waiting}); retry"
        )

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        refusal = self.refusal()
        handler = continuation(handler_call_details)
        if refusal is None or handler is None:
            return handler
        if not handler_call_details.method.startswith("/memory.v1."):
            return handler
        status = to_status(refusal)

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort_with_status(status)

        for attribute, _kind, make in _KINDS:
            if getattr(handler, attribute) is not None:
                return make(
                    refuse,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler
