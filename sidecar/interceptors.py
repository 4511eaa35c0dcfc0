"""Cross-cutting concerns of every call: status mapping and call metrics.

ErrorInterceptor is the one place where exceptions become gRPC statuses.

A SidecarError becomes its status code with a google.rpc.Status carrying an
ErrorInfo (domain memory.v1, the error's stable reason and metadata). Any
other exception is logged with its traceback and becomes INTERNAL, without
leaking the exception's text to the client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from sidecar.errors import DOMAIN, SidecarError
from sidecar.metrics import Metrics

log = logging.getLogger(__name__)


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


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions raised by unary-unary handlers to statuses."""

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary
        method = handler_call_details.method

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return behavior(request, context)
            except SidecarError as exc:
                context.abort_with_status(to_status(exc))
            except Exception:
                # context.abort() inside a handler raises after setting the
                # status: let that one through untouched.
                if cast(Any, context).code() is not None:
                    raise
                log.exception("unhandled error in %s", method)
                context.abort_with_status(_internal())

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


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

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
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
        code = cast(Any, context).code()
        if code is None:
            code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
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
