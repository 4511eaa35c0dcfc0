"""The one place where exceptions become gRPC statuses.

A SidecarError becomes its status code with a google.rpc.Status carrying an
ErrorInfo (domain memory.v1, the error's stable reason and metadata). Any
other exception is logged with its traceback and becomes INTERNAL, without
leaking the exception's text to the client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from sidecar.errors import DOMAIN, SidecarError

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
