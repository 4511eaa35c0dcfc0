"""Tracing (the tracing extra): a span per RPC continuing the caller's trace,
a child span per SQL statement, and nothing at all when tracing is off."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.api import tracing
from sidecar.api.server import Sidecar
from sidecar.config import settings as config_mod
from sidecar.core.errors import ConfigError
from sidecar.core.metrics import Metrics
from sidecar.ops import daemon
from tests.conftest import (
    CALL_SECONDS,
    ROOT,
    START_SECONDS,
    Running,
    eventually,
    refused,
    sqlite_file,
)

# What must never reach a span: the memory's text and the scope's ids.
CONTENT = "Ada's deploy key lives in the blue vault"
SCOPE = pb.Scope(agent_id="coder-7f3a", user_id="ada-91c2")
MISSING_ID = "mem-4b2c-missing"
SECRETS = (CONTENT, "blue vault", SCOPE.agent_id, SCOPE.user_id, "session-5d1e", MISSING_ID)
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
PARENT_ID = 0xB7AD6B7169203331


def traceparent(sampled: bool = True) -> tuple[tuple[str, str]]:
    flags = "01" if sampled else "00"
    return (("traceparent", f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-{flags}"),)


class Traced:
    """A real Sidecar whose spans go to an in-memory exporter."""

    def __init__(self, running: Running, exporter: InMemorySpanExporter) -> None:
        self.running = running
        self.exporter = exporter

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def rpc(self, method: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name == f"memory.v1.MemoryService/{method}"]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        return [
            s
            for s in self.spans()
            if s.parent is not None and s.parent.span_id == parent.context.span_id
        ]


def _start(db: str, tmp_path: Path, provider: TracerProvider | None, **server: Any) -> Running:
    flags = {"db": db, "listen": "127.0.0.1:0", **server}
    cfg = config_mod.load(environ={}, flags=flags)
    metrics = Metrics(CollectorRegistry())
    store = daemon.open_store(cfg, metrics)
    store.open()
    sidecar = Sidecar(cfg, store, metrics=metrics, tracer_provider=provider)
    addresses = sidecar.start()
    channel = grpc.insecure_channel(addresses.api)
    stub = pb_grpc.MemoryServiceStub(channel)
    return Running(sidecar, store, addresses, channel, stub, tmp_path / "memory.db", db)


def _stop(running: Running) -> None:
    running.channel.close()
    running.sidecar.stop(grace=1)
    running.store.close()


@pytest.fixture
def traced(databases: Callable[[str], str], tmp_path: Path) -> Iterator[Traced]:
    exporter = InMemorySpanExporter()
    # The SDK's default sampler, set here so a developer's OTEL_TRACES_SAMPLER
    # cannot change what the tests see.
    provider = TracerProvider(sampler=sampling.ParentBased(sampling.ALWAYS_ON))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    running = _start(databases("memory.db"), tmp_path, provider)
    try:
        yield Traced(running, exporter)
    finally:
        _stop(running)
        provider.shutdown()


def _no_secrets(spans: list[ReadableSpan]) -> None:
    for span in spans:
        texts = [span.name, *(str(v) for v in (span.attributes or {}).values())]
        texts += [str(e.attributes) for e in span.events]
        for text in texts:
            for secret in SECRETS:
                assert secret not in text, f"{secret!r} in span {span.name}"


@pytest.mark.contract
def test_a_call_continues_the_callers_trace_with_a_span_per_statement(
    traced: Traced, backend: str
) -> None:
    request = pb.AddMemoryRequest(scope=SCOPE, content=CONTENT, category="ops")
    traced.running.stub.AddMemory(request, metadata=traceparent(), timeout=CALL_SECONDS)

    (rpc,) = traced.rpc("AddMemory")
    assert rpc.kind is SpanKind.SERVER
    assert dict(rpc.attributes or {}) == {
        "rpc.system": "grpc",
        "rpc.service": "memory.v1.MemoryService",
        "rpc.method": "AddMemory",
        "rpc.grpc.status_code": 0,
    }
    assert rpc.status.status_code is StatusCode.UNSET
    assert rpc.context.trace_id == TRACE_ID
    assert rpc.parent is not None
    assert (rpc.parent.span_id, rpc.parent.is_remote) == (PARENT_ID, True)

    statements = traced.children(rpc)
    names = [s.name for s in statements]
    # The near-duplicate check (similar_writes: report) reads the tier first;
    # the write itself is one transaction.
    begin = names.index("BEGIN")
    assert set(names[:begin]) <= {"SELECT"}
    assert names[-1] == "COMMIT"
    assert "INSERT" in names
    assert rpc.start_time is not None
    assert rpc.end_time is not None
    for span in statements:
        attributes = dict(span.attributes or {})
        assert span.kind is SpanKind.CLIENT
        assert span.context.trace_id == TRACE_ID
        assert attributes["db.system.name"] == attributes["db.system"] == backend
        assert attributes["db.query.text"] == attributes["db.statement"]
        text = attributes["db.query.text"]
        assert isinstance(text, str)
        assert text.upper().startswith(span.name)
        assert span.status.status_code is StatusCode.UNSET
        assert span.start_time is not None
        assert span.end_time is not None
        assert rpc.start_time <= span.start_time <= span.end_time <= rpc.end_time
    (insert,) = [s for s in statements if 'INTO "memories"' in str(s.attributes)]
    assert insert.attributes is not None
    assert ("?" if backend == "sqlite" else "%s") in str(insert.attributes["db.query.text"])
    _no_secrets(traced.spans())


def test_a_turn_served_from_its_snapshot_has_only_the_rpc_span(traced: Traced) -> None:
    running = traced.running
    running.add(CONTENT, scope=SCOPE)
    first = running.turn("session-5d1e", "where is the deploy key?", scope=SCOPE)
    cached = running.turn("session-5d1e", "where is the deploy key?", scope=SCOPE)
    assert (first.cache_hit, cached.cache_hit) == (False, True)

    built, served = traced.rpc("InjectForTurn")
    assert traced.children(built)
    assert traced.children(served) == []
    _no_secrets(traced.spans())


def test_failed_calls_carry_their_status(traced: Traced) -> None:
    running = traced.running
    # A caller's mistake: the code on the span, the span itself not an error.
    refused(running.stub.DeleteMemory, pb.DeleteMemoryRequest(scope=SCOPE, id=MISSING_ID))
    (missing,) = traced.rpc("DeleteMemory")
    assert missing.attributes is not None
    assert missing.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert missing.status.status_code is StatusCode.UNSET

    # The server's failure: the table disappears underneath it.
    with sqlite_file(running.db_path) as conn:
        conn.execute("ALTER TABLE memories RENAME TO gone")
    error = refused(running.list, scope=SCOPE)
    assert error.code() == grpc.StatusCode.INTERNAL
    (broken,) = traced.rpc("GetMemories")
    assert broken.attributes is not None
    assert broken.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert broken.attributes["error.type"] == "INTERNAL"
    assert (broken.status.status_code, broken.status.description) == (StatusCode.ERROR, "INTERNAL")
    (failed,) = [s for s in traced.children(broken) if s.status.status_code is StatusCode.ERROR]
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == "OperationalError"
    assert failed.status.description == "OperationalError"
    # The driver's message names the missing table; it stays out of the span.
    assert not failed.events
    _no_secrets(traced.spans())


def test_a_cancelled_stream_is_canceled_not_an_error(traced: Traced) -> None:
    running = traced.running
    call = running.stub.WatchMemories(pb.WatchMemoriesRequest(scope=SCOPE))
    assert next(call).event.kind == pb.MemoryEvent.KIND_SYNC
    call.cancel()
    # The span ends once the handler has (a liveness bound).
    (span,) = eventually(
        lambda: traced.rpc("WatchMemories"),
        "the cancelled watch's span ends",
        pause=0.05,
    )
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert span.status.status_code is StatusCode.UNSET


def test_an_unsampled_caller_gets_no_spans_and_health_checks_none(traced: Traced) -> None:
    running = traced.running
    running.stub.AddMemory(
        pb.AddMemoryRequest(scope=SCOPE, content=CONTENT), metadata=traceparent(sampled=False)
    )
    health = health_pb2_grpc.HealthStub(running.channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest()).status == serving
    # Nor statement spans of their own: outside a sampled call there are none.
    assert traced.spans() == []


def test_tracing_off_never_imports_opentelemetry(tmp_path: Path) -> None:
    # In a process of its own: this one has imported OpenTelemetry already.
    script = textwrap.dedent(
        f"""
        import sys

        import grpc

        from sidecar.config import settings
        from sidecar.ops import daemon
        from sidecar._proto.memory.v1 import memory_pb2 as pb
        from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
        from sidecar.api.server import Sidecar

        cfg = settings.load(environ={{}}, flags={{"db": {str(tmp_path / "m.db")!r},
                                              "listen": "127.0.0.1:0"}})
        store = daemon.open_store(cfg)
        store.open()
        sidecar = Sidecar(cfg, store)
        address = sidecar.start().api
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            scope = pb.Scope(agent_id="a")
            stub.AddMemory(pb.AddMemoryRequest(scope=scope, content="x"))
            stub.InjectForTurn(pb.InjectForTurnRequest(scope=scope, session_id="s"))
        wrapped = sorted(vars(store._backend.db).keys() & {{"execute_sql", "begin", "commit"}})
        sidecar.stop(grace=1)
        store.close()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
        print(loaded, wrapped)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] []"


def test_tracing_without_the_extra_is_a_config_error(tmp_path: Path) -> None:
    # The extra made unimportable, as on an install without it.
    script = textwrap.dedent(
        f"""
        import sys

        sys.modules["opentelemetry"] = None
        from sidecar.ops import cli

        sys.exit(cli.main(["serve", "--db", {str(tmp_path / "m.db")!r}],
                          environ={{"MEMORY_SIDECAR_TRACING": "otlp"}}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "pip install 'memory-sidecar[tracing]'" in result.stderr
    assert not (tmp_path / "m.db").exists()  # refused before opening anything


def test_tracing_settings_are_checked() -> None:
    assert config_mod.load(environ={}).server.tracing == "off"
    loaded = config_mod.load(
        environ={"MEMORY_SIDECAR_TRACING": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )
    assert loaded.server.tracing == "otlp"
    with pytest.raises(ConfigError) as raised:
        config_mod.load(environ={"MEMORY_SIDECAR_TRACING": "zipkin"})
    assert raised.value.key == "MEMORY_SIDECAR_TRACING"
    with pytest.raises(ConfigError) as raised:
        config_mod.load(
            environ={
                "MEMORY_SIDECAR_TRACING": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            }
        )
    assert raised.value.key == "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    assert "OTLP/gRPC" in raised.value.problem


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC endpoint that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()

    def Export(  # noqa: N802 - the OTLP method's name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_spans_reach_an_otlp_endpoint_named_by_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    # The generated gRPC module has no annotations.
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # The SDK reads these itself.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=test")
        for variable in ("OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_SDK_DISABLED"):
            monkeypatch.delenv(variable, raising=False)
        running = _start(str(tmp_path / "memory.db"), tmp_path, None, tracing="otlp")
        try:
            request = pb.AddMemoryRequest(scope=SCOPE, content=CONTENT)
            running.stub.AddMemory(request, metadata=traceparent(), timeout=CALL_SECONDS)
        finally:
            _stop(running)  # flushes the batch
    finally:
        server.stop(None)

    spans = [
        (resource.resource, span)
        for request in collector.requests
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    names = {span.name for _, span in spans}
    assert "memory.v1.MemoryService/AddMemory" in names
    assert "COMMIT" in names
    assert {span.trace_id for _, span in spans} == {TRACE_ID.to_bytes(16, "big")}
    resource = {a.key: a.value.string_value for a in spans[0][0].attributes}
    assert resource["service.name"] == tracing.SERVICE_NAME
    assert resource["deployment.environment.name"] == "test"
    for batch in collector.requests:
        assert CONTENT not in str(batch)
        assert SCOPE.agent_id not in str(batch)
