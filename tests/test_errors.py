"""Bad input: the right code, a stable reason, a readable message, no change."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import Running, error_info, refused, sqlite_file

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
EXISTING = "<existing>"  # replaced by the id of a stored memory


CASES: list[tuple[str, str, Any, grpc.StatusCode, str]] = [
    (
        "empty content",
        "AddMemory",
        pb.AddMemoryRequest(scope=SCOPE, content=""),
        grpc.StatusCode.INVALID_ARGUMENT,
        "CONTENT_EMPTY",
    ),
    (
        "whitespace content",
        "AddMemory",
        pb.AddMemoryRequest(scope=SCOPE, content=" \t\n\u3000"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "CONTENT_EMPTY",
    ),
    # Enum numbers no value is named for, as a client may send them (the
    # stubs allow only the named values, hence the arg-type ignores).
    (
        "unknown tier on add",
        "AddMemory",
        pb.AddMemoryRequest(scope=SCOPE, content="x", tier=7),  # type: ignore[arg-type]
        grpc.StatusCode.INVALID_ARGUMENT,
        "TIER_UNKNOWN",
    ),
    (
        "negative tier",
        "AddMemory",
        pb.AddMemoryRequest(scope=SCOPE, content="x", tier=-1),  # type: ignore[arg-type]
        grpc.StatusCode.INVALID_ARGUMENT,
        "TIER_UNKNOWN",
    ),
    (
        "unknown tier on list",
        "GetMemories",
        pb.GetMemoriesRequest(scope=SCOPE, tier=3),  # type: ignore[arg-type]
        grpc.StatusCode.INVALID_ARGUMENT,
        "TIER_UNKNOWN",
    ),
    (
        "unknown tier on search",
        "SearchMemories",
        pb.SearchMemoriesRequest(scope=SCOPE, tier=99),  # type: ignore[arg-type]
        grpc.StatusCode.INVALID_ARGUMENT,
        "TIER_UNKNOWN",
    ),
    (
        "confidence below 0",
        "AddMemory",
        pb.AddMemoryRequest(scope=SCOPE, content="x", confidence=-0.01),
        grpc.StatusCode.INVALID_ARGUMENT,
        "CONFIDENCE_OUT_OF_RANGE",
    ),
    (
        "confidence above 1",
        "AddMemory",
        pb.AddMemoryRequest(scope=SCOPE, content="x", confidence=1.5),
        grpc.StatusCode.INVALID_ARGUMENT,
        "CONFIDENCE_OUT_OF_RANGE",
    ),
    (
        "confidence NaN",
        "AddMemory",
        pb.AddMemoryRequest(scope=SCOPE, content="x", confidence=math.nan),
        grpc.StatusCode.INVALID_ARGUMENT,
        "CONFIDENCE_OUT_OF_RANGE",
    ),
    (
        "confidence infinite on update",
        "UpdateMemory",
        pb.UpdateMemoryRequest(scope=SCOPE, id=EXISTING, confidence=math.inf),
        grpc.StatusCode.INVALID_ARGUMENT,
        "CONFIDENCE_OUT_OF_RANGE",
    ),
    (
        "empty content on update",
        "UpdateMemory",
        pb.UpdateMemoryRequest(scope=SCOPE, id=EXISTING, content="   "),
        grpc.StatusCode.INVALID_ARGUMENT,
        "CONTENT_EMPTY",
    ),
    (
        "update without id",
        "UpdateMemory",
        pb.UpdateMemoryRequest(scope=SCOPE, content="x"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "ID_EMPTY",
    ),
    (
        "delete without id",
        "DeleteMemory",
        pb.DeleteMemoryRequest(scope=SCOPE),
        grpc.StatusCode.INVALID_ARGUMENT,
        "ID_EMPTY",
    ),
    (
        "update unknown id",
        "UpdateMemory",
        pb.UpdateMemoryRequest(scope=SCOPE, id="no-such-id", content="x"),
        grpc.StatusCode.NOT_FOUND,
        "MEMORY_NOT_FOUND",
    ),
    (
        "delete unknown id",
        "DeleteMemory",
        pb.DeleteMemoryRequest(scope=SCOPE, id="no-such-id"),
        grpc.StatusCode.NOT_FOUND,
        "MEMORY_NOT_FOUND",
    ),
    (
        "update in another scope",
        "UpdateMemory",
        pb.UpdateMemoryRequest(scope=pb.Scope(agent_id="other"), id=EXISTING, content="x"),
        grpc.StatusCode.NOT_FOUND,
        "MEMORY_NOT_FOUND",
    ),
    (
        "delete in another scope",
        "DeleteMemory",
        pb.DeleteMemoryRequest(scope=pb.Scope(agent_id="other"), id=EXISTING),
        grpc.StatusCode.NOT_FOUND,
        "MEMORY_NOT_FOUND",
    ),
    (
        "negative search limit",
        "SearchMemories",
        pb.SearchMemoriesRequest(scope=SCOPE, limit=-1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "LIMIT_OUT_OF_RANGE",
    ),
    (
        "search limit too big",
        "SearchMemories",
        pb.SearchMemoriesRequest(scope=SCOPE, limit=1001),
        grpc.StatusCode.INVALID_ARGUMENT,
        "LIMIT_OUT_OF_RANGE",
    ),
    (
        "turn without session",
        "InjectForTurn",
        pb.InjectForTurnRequest(scope=SCOPE),
        grpc.StatusCode.INVALID_ARGUMENT,
        "SESSION_ID_EMPTY",
    ),
    (
        "unknown strategy",
        "InjectForTurn",
        pb.InjectForTurnRequest(scope=SCOPE, session_id="s", strategy=9),  # type: ignore[arg-type]
        grpc.StatusCode.INVALID_ARGUMENT,
        "STRATEGY_UNKNOWN",
    ),
    (
        "negative max_memories",
        "InjectForTurn",
        pb.InjectForTurnRequest(scope=SCOPE, session_id="s", max_memories=-1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "MAX_MEMORIES_OUT_OF_RANGE",
    ),
    (
        "negative max_tokens",
        "InjectForTurn",
        pb.InjectForTurnRequest(scope=SCOPE, session_id="s", max_tokens=-5),
        grpc.StatusCode.INVALID_ARGUMENT,
        "MAX_TOKENS_OUT_OF_RANGE",
    ),
    (
        "compaction without session",
        "NotifyCompaction",
        pb.NotifyCompactionRequest(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "SESSION_ID_EMPTY",
    ),
    (
        "end without session",
        "EndSession",
        pb.EndSessionRequest(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "SESSION_ID_EMPTY",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_", "code", "reason"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_is_refused_and_changes_nothing(
    sidecar: Running, method: str, request_: Any, code: grpc.StatusCode, reason: str
) -> None:
    existing = sidecar.add("a stored memory", scope=SCOPE, category="c", confidence=0.5).memory
    if getattr(request_, "id", None) == EXISTING:
        request_.id = existing.id
    before = sidecar.list(scope=SCOPE)

    error = refused(getattr(sidecar.stub, method), request_)

    assert error.code() == code
    info = error_info(error)
    assert info.reason == reason
    assert error.details()  # a message a person can read
    assert "Traceback" not in (error.details() or "")
    assert sidecar.list(scope=SCOPE) == before


def test_messages_say_what_to_do(sidecar: Running) -> None:
    error = refused(sidecar.add, "x", scope=SCOPE, tier=5)
    assert error.details() == "unknown tier 5; use TIER_MEMORY (1) or TIER_USER (2)"
    error = refused(sidecar.add, "x", scope=SCOPE, confidence=2.0)
    assert error.details() == "confidence must be between 0 and 1, got 2.0"
    assert dict(error_info(error).metadata) == {"confidence": "2.0"}
    error = refused(sidecar.stub.DeleteMemory, pb.DeleteMemoryRequest(scope=SCOPE, id="nope"))
    assert error.details() == "no memory with id 'nope' in this scope"
    assert dict(error_info(error).metadata) == {"id": "nope"}


def test_confidence_edges_are_accepted(sidecar: Running) -> None:
    low = sidecar.add("sure of nothing", scope=SCOPE, confidence=0.0).memory
    high = sidecar.add("sure of everything", scope=SCOPE, confidence=1.0).memory
    assert (low.confidence, high.confidence) == (0.0, 1.0)


def test_an_unexpected_failure_is_internal_without_leaking_details(sidecar: Running) -> None:
    # Break the database underneath the running server: the table disappears.
    with sqlite_file(sidecar.db_path) as conn:
        conn.execute("ALTER TABLE memories RENAME TO gone")
    error = refused(sidecar.list, scope=SCOPE)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error_info(error).reason == "INTERNAL"
    assert "memories" not in (error.details() or "")
