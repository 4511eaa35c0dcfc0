"""OpenTelemetry tracing: a server span per RPC, a client span per SQL statement.

Needs the `tracing` extra (pip install 'memory-sidecar[tracing]'). Only the
server imports this module, and only when tracing is on (`server.tracing:
otlp`, or a TracerProvider handed to it), so a daemon with tracing off never
loads OpenTelemetry.

The exporter, sampler and resource are configured the OpenTelemetry way,
through the variables the SDK reads itself: OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), _HEADERS, _TIMEOUT, _CERTIFICATE,
OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG),
OTEL_BSP_*, OTEL_PROPAGATORS and OTEL_SDK_DISABLED. That is the one place
where something other than sidecar.config.settings reads the environment: copying
them into our configuration would only drift from the specification.

A caller's W3C `traceparent` metadata makes the RPC span a child of the
caller's span, so a runtime's trace of a model call includes the turn.

What a span never carries: request or response fields (memory content,
agent, user, session and memory ids, messages), metadata (the bearer
token), parameter values of SQL statements, or error messages (a
PostgreSQL error can quote a row). Statements are recorded as their
parametrised SQL text only.

Owns: the tracer and its OTLP provider, an RPC's server span, a statement's
client span, and what a span may carry. Must not touch: request or response
fields, the engine; the store only through the StatementSpans the server
installs. It imports sidecar.api.interceptors' private `_KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from sidecar import __version__
from sidecar.api.interceptors import _KINDS, ended_code

SERVICE_NAME = "memory-sidecar"
# OpenTelemetry's gRPC conventions: a server span is an error for these
# codes only. The others (INVALID_ARGUMENT, NOT_FOUND, a budget's
# RESOURCE_EXHAUSTED, ...) are the caller's to handle; the span still
# carries the code in rpc.grpc.status_code.
_SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
# Probes call health checks every few seconds, each a trace of its own.
_UNTRACED = ("/grpc.health.v1.Health/",)


def otlp_provider() -> TracerProvider:
    """A TracerProvider that batches spans to an OTLP/gRPC endpoint.

    The endpoint, sampler and the rest come from the OTEL_* environment
    (see the module's docstring); the service is `memory-sidecar` unless
    OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names another.
    """
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    resource = Resource.create({"service.version": __version__})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


class Tracing:
    """The tracer of one Sidecar, its interceptor and its statement spans.

    Built on `provider` when given (tests pass one with an in-memory
    exporter), otherwise on an OTLP provider of its own, which `shutdown`
    flushes and closes.
    """

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._owned = provider is None
        self.provider = otlp_provider() if provider is None else provider
        self.tracer = self.provider.get_tracer("memory-sidecar", __version__)

    def interceptor(self) -> TracingInterceptor:
        return TracingInterceptor(self.tracer)

    def statements(self, system: str) -> StatementSpans:
        return StatementSpans(self.tracer, system)

    def shutdown(self) -> None:
        """Send the spans still queued and stop exporting (an owned provider
        only); waits at most about OTEL_EXPORTER_OTLP_TIMEOUT for the endpoint."""
        if self._owned and isinstance(self.provider, TracerProvider):
            self.provider.shutdown()


def _carrier(metadata: Any) -> dict[str, str]:
    # Text metadata only: binary values (-bin keys) carry no trace context.
    return {key: value for key, value in metadata or () if isinstance(value, str)}


class TracingInterceptor(grpc.ServerInterceptor):
    """A SERVER span per call, named `package.Service/Method`.

    Outermost of the server's interceptors, so the span covers auth and
    sees the status the error mapping chose. The span is current while a
    unary handler runs, so statements become its children.
    """

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_UNTRACED):
            return handler
        name = method.lstrip("/")
        service, _, short = name.rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": short}
        # Runs on gRPC's polling thread: keep the metadata, parse it later.
        metadata = handler_call_details.invocation_metadata
        for attribute, _grpc_type, factory in _KINDS:
            behavior = getattr(handler, attribute)
            if behavior is None:
                continue
            wrap = self._streaming if attribute.endswith("_stream") else self._unary
            return factory(
                wrap(behavior, name, attributes, metadata),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _start(self, name: str, attributes: Mapping[str, str], metadata: Any) -> trace.Span:
        return self._tracer.start_span(
            name,
            context=propagate.extract(_carrier(metadata)),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )

    def _unary(
        self,
        behavior: Callable[..., Any],
        name: str,
        attributes: Mapping[str, str],
        metadata: Any,
    ) -> Callable[..., Any]:
        def call(request: Any, context: Any) -> Any:
            span = self._start(name, attributes, metadata)
            token = otel_context.attach(trace.set_span_in_context(span))
            failed = True
            try:
                response = behavior(request, context)
                failed = False
                return response
            finally:
                otel_context.detach(token)
                _finish(span, context, failed)

        return call

    def _streaming(
        self,
        behavior: Callable[..., Any],
        name: str,
        attributes: Mapping[str, str],
        metadata: Any,
    ) -> Callable[..., Any]:
        # Not made current: a generator may be resumed in another context,
        # and no streaming call (health watches, reflection) runs SQL.
        def call(request: Any, context: Any) -> Iterator[Any]:
            span = self._start(name, attributes, metadata)
            failed = True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                _finish(span, context, failed)

        return call


def _finish(span: trace.Span, context: Any, failed: bool) -> None:
    code = ended_code(context, failed)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERRORS:
        # The code's name, not the status message: messages may quote a request.
        span.set_status(Status(StatusCode.ERROR, code.name))
        span.set_attribute("error.type", code.name)
    span.end()


class _StatementSpan:
    __slots__ = ("_span",)

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            # The driver's class (OperationalError, IntegrityError), never its
            # message, which may quote the values a statement was given.
            self._span.set_status(Status(StatusCode.ERROR, exc_type.__name__))
            self._span.set_attribute("error.type", exc_type.__name__)
        self._span.end()


_OUTSIDE_RPC: AbstractContextManager[None] = nullcontext()


class StatementSpans:
    """`spans(sql)`: a CLIENT span around one statement, child of the RPC's.

    Named by the statement's first keyword (SELECT, INSERT, BEGIN, ...), as
    memory_db_queries_total{operation} counts them. Statements outside a
    sampled RPC (start-up migrations, or a caller's trace that is not
    sampled) get none.
    """

    def __init__(self, tracer: trace.Tracer, system: str) -> None:
        self._tracer = tracer
        self._system = system

    def __call__(self, sql: str) -> AbstractContextManager[None]:
        if not trace.get_current_span().is_recording():
            return _OUTSIDE_RPC
        head = sql.lstrip().split(None, 1)
        span = self._tracer.start_span(
            head[0].upper() if head else self._system,
            kind=SpanKind.CLIENT,
            attributes={
                # The stable database conventions' names, and the older
                # ones (db.system, db.statement) many backends still show.
                "db.system.name": self._system,
                "db.system": self._system,
                "db.query.text": sql,
                "db.statement": sql,
            },
        )
        return _StatementSpan(span)
