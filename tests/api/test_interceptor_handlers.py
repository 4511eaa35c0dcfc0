"""The interceptors' wrapped handlers, built once per method (sidecar.api.interceptors):
every call is still counted, labelled and mapped, and a handler that changes
per call below (auth's grant) is wrapped afresh."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from sidecar.api.interceptors import ErrorInterceptor, MetricsInterceptor
from sidecar.core.errors import NotFound
from sidecar.core.metrics import Metrics

METHOD = "/memory.v1.MemoryService/AddMemory"


class _Details:
    method = METHOD
    invocation_metadata = ()


class _Context:
    """What the interceptors read of a call's context: its status, once set."""

    def __init__(self) -> None:
        self.status: Any = None

    def code(self) -> Any:
        return None if self.status is None else self.status.code

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float:
        return 60.0

    def abort_with_status(self, status: Any) -> None:
        self.status = status
        raise RuntimeError("aborted")


def _handler(behavior: Any) -> Any:
    return grpc.unary_unary_rpc_method_handler(behavior, request_deserializer=bytes.decode)


def _handled(registry: CollectorRegistry, code: str) -> float | None:
    labels = {
        "grpc_type": "unary",
        "grpc_service": "memory.v1.MemoryService",
        "grpc_method": "AddMemory",
        "grpc_code": code,
    }
    return registry.get_sample_value("grpc_server_handled_total", labels)


def test_a_method_s_handler_is_wrapped_once_and_every_call_counted() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    errors, counted = ErrorInterceptor(), MetricsInterceptor(metrics)
    below = _handler(lambda request, context: request.upper())

    def wrapped() -> Any:
        return counted.intercept_service(
            lambda details: errors.intercept_service(lambda _: below, details), _Details()
        )

    first, second = wrapped(), wrapped()
    assert first is second
    assert [first.unary_unary(b"a", _Context()), second.unary_unary(b"b", _Context())] == ["A", "B"]
    assert _handled(registry, "OK") == 2


def test_a_handler_new_for_a_call_is_wrapped_afresh_and_its_error_mapped() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    errors, counted = ErrorInterceptor(), MetricsInterceptor(metrics)

    def missing(request: str, context: Any) -> str:
        raise NotFound("no such memory")

    def echo(request: str, context: Any) -> str:
        return request

    def through(below: Any) -> Any:
        def inner(details: Any) -> Any:
            return errors.intercept_service(lambda _: below, details)

        return counted.intercept_service(inner, _Details())

    handlers = [through(_handler(echo)), through(_handler(missing))]
    assert handlers[0] is not handlers[1]
    assert handlers[0].unary_unary(b"a", _Context()) == "a"
    context = _Context()
    with pytest.raises(RuntimeError, match="aborted"):
        handlers[1].unary_unary(b"b", context)
    assert context.status.code == grpc.StatusCode.NOT_FOUND
    assert _handled(registry, "OK") == 1
    assert _handled(registry, "NotFound") == 1
