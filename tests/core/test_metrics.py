"""Metrics over a real /metrics endpoint, parsed as Prometheus text."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.api.interceptors import go_code_name
from sidecar.core.metrics import Metrics
from tests.conftest import (
    CALL_SECONDS,
    START_SECONDS,
    MakeSidecar,
    Running,
    eventually,
    refused,
    require_tool,
)

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
SECRET_IDS = ("coder", "ada", "session-secret")


def scrape(running: Running) -> str:
    assert running.addresses.metrics is not None
    with urllib.request.urlopen(
        f"http://{running.addresses.metrics}/metrics", timeout=CALL_SECONDS
    ) as r:
        body: bytes = r.read()
    return body.decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def served(make_sidecar: MakeSidecar) -> Running:
    return make_sidecar("defaults: {memory_char_limit: 40}", metrics_listen="127.0.0.1:0")


def test_hit_and_miss_series_exist_from_start_up(served: Running) -> None:
    text = scrape(served)
    assert ("memory_snapshot_lookups_total", (("result", "hit"),)) in samples(text)
    assert ("memory_snapshot_lookups_total", (("result", "miss"),)) in samples(text)
    for reason in ("write", "compaction", "session_end", "evicted"):
        assert ("memory_snapshot_invalidations_total", (("reason", reason),)) in samples(text)
    assert value(text, "memory_sessions_active") == 0


def test_turns_writes_and_sessions_are_counted(served: Running) -> None:
    inserts = value(scrape(served), "memory_db_queries_total", operation="insert")
    served.add("uses uv", scope=SCOPE)
    for _ in range(3):
        served.turn("session-secret", "uv", scope=SCOPE)
    served.turn("another", "uv", scope=SCOPE)
    served.stub.NotifyCompaction(pb.NotifyCompactionRequest(session_id="another", scope=SCOPE))
    error = refused(served.add, "x" * 50, scope=SCOPE)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION

    text = scrape(served)
    assert value(text, "memory_snapshot_lookups_total", result="miss") == 2
    assert value(text, "memory_snapshot_lookups_total", result="hit") == 2
    assert value(text, "memory_snapshot_invalidations_total", reason="write") == 1
    assert value(text, "memory_snapshot_invalidations_total", reason="compaction") == 1
    assert value(text, "memory_sessions_active") == 2
    assert value(text, "memory_budget_rejections_total", tier="memory") == 1
    assert value(text, "memory_injected_tokens_total", block="system") > 0
    assert value(text, "memory_db_queries_total", operation="select") > 0
    # The entry, its event for watchers, its partition's state row (created
    # by its first write), and the compaction's session event for other
    # processes (SQLite's session_events; PostgreSQL notifies instead).
    assert value(text, "memory_db_queries_total", operation="insert") == inserts + 4
    assert value(text, "memory_db_query_duration_seconds_count") >= 2


def test_grpc_server_metrics_carry_method_and_code(served: Running) -> None:
    served.add("a note", scope=SCOPE)
    refused(served.add, "", scope=SCOPE)
    refused(served.stub.DeleteMemory, pb.DeleteMemoryRequest(scope=SCOPE, id="nope"))
    text = scrape(served)
    base = {"grpc_type": "unary", "grpc_service": "memory.v1.MemoryService"}
    assert value(text, "grpc_server_started_total", **base, grpc_method="AddMemory") == 2
    assert (
        value(text, "grpc_server_handled_total", **base, grpc_method="AddMemory", grpc_code="OK")
        == 1
    )
    assert (
        value(
            text,
            "grpc_server_handled_total",
            **base,
            grpc_method="AddMemory",
            grpc_code="InvalidArgument",
        )
        == 1
    )
    assert (
        value(
            text,
            "grpc_server_handled_total",
            **base,
            grpc_method="DeleteMemory",
            grpc_code="NotFound",
        )
        == 1
    )
    assert value(text, "grpc_server_handling_seconds_count", **base, grpc_method="AddMemory") == 2
    # Buckets start at 100 microseconds.
    assert (
        "grpc_server_handling_seconds_bucket",
        tuple(sorted({**base, "grpc_method": "AddMemory", "le": "0.0001"}.items())),
    ) in (samples(text))


def test_a_cancelled_stream_is_counted_as_canceled(served: Running) -> None:
    call = served.stub.WatchMemories(pb.WatchMemoriesRequest(scope=SCOPE))
    assert next(call).event.kind == pb.MemoryEvent.KIND_SYNC
    call.cancel()
    labels = {
        "grpc_type": "server_stream",
        "grpc_service": "memory.v1.MemoryService",
        "grpc_method": "WatchMemories",
    }
    # The server records the call once its handler has ended (a liveness
    # bound, not a timing claim).

    def recorded() -> str | None:
        text = scrape(served)
        return text if value(text, "grpc_server_handling_seconds_count", **labels) else None

    text = eventually(recorded, "the cancelled watch is recorded", pause=0.05)
    assert value(text, "grpc_server_handled_total", **labels, grpc_code="Canceled") == 1
    for code in ("Unknown", "OK"):
        assert value(text, "grpc_server_handled_total", **labels, grpc_code=code) == 0


def test_grpc_code_labels_match_go_grpc_prometheus() -> None:
    names = {code: go_code_name(code) for code in grpc.StatusCode}
    assert names[grpc.StatusCode.OK] == "OK"
    assert names[grpc.StatusCode.CANCELLED] == "Canceled"
    assert names[grpc.StatusCode.DEADLINE_EXCEEDED] == "DeadlineExceeded"
    assert names[grpc.StatusCode.UNAUTHENTICATED] == "Unauthenticated"
    assert len(set(names.values())) == 17


def test_no_label_carries_an_id(served: Running) -> None:
    memory = served.add("a note", scope=SCOPE).memory
    served.turn("session-secret", "note", scope=SCOPE)
    text = scrape(served)
    for (_, labels), _value in samples(text).items():
        for _label, label_value in labels:
            assert label_value not in (*SECRET_IDS, memory.id)


def test_promtool_accepts_the_metrics(served: Running) -> None:
    promtool = require_tool(
        shutil.which("promtool"), "promtool (Debian's prometheus package; .ci/run installs it)"
    )
    served.add("a note", scope=SCOPE)
    served.turn("s", "note", scope=SCOPE)
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=scrape(served),
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_statements_are_counted_by_operation_as_first_run() -> None:
    # db_query keeps each operation's child once made; the series a scrape
    # shows are still only those of operations run, with their counts.
    metrics = Metrics(CollectorRegistry())
    for sql in ("SELECT 1", "  select 2", "INSERT INTO t VALUES (1)", "BEGIN", "SELECT 3"):
        metrics.db_query(sql, 0.001)
    text = generate_latest(metrics.registry).decode()
    counts = {
        sample.labels["operation"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "memory_db_queries"
        for sample in family.samples
        if sample.name == "memory_db_queries_total"
    }
    assert counts == {"select": 3.0, "insert": 1.0, "other": 1.0}
