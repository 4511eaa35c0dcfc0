"""JSON a caller sends inside a string field (CallTool's arguments_json, page
tokens, export cursors, import lines): nested past any use, or spelling half
a surrogate pair ("\\ud800", which json.loads accepts and UTF-8 cannot
encode), it is INVALID_ARGUMENT with a stable reason, never INTERNAL; nothing
changes and no traceback is logged."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.core.errors import InvalidArgument, Reason
from sidecar.core.limits import JSON_DEPTH, caller_json, checked
from sidecar.storage.archive import parse_line
from tests.conftest import CALL_SECONDS, Running, error_info, refused

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
DEEP = "[" * 50_000 + "]" * 50_000
NOTES = "/memories/notes.md"
FILES = "memory_20250818"


@pytest.fixture
def quiet(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The daemon's log while the test runs: it must hold no traceback
    and no error."""
    with caplog.at_level(logging.DEBUG):
        yield caplog
    loud = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not loud, [r.getMessage() for r in loud]


def call_tool(running: Running, name: str, arguments_json: str) -> grpc.RpcError:
    request = pb.CallToolRequest(
        scope=SCOPE, session_id="s1", name=name, arguments_json=arguments_json
    )
    return refused(running.stub.CallTool, request, timeout=CALL_SECONDS)


def refused_as(running: Running, name: str, arguments_json: str, reason: Reason) -> dict[str, str]:
    before = running.list(scope=SCOPE)
    error = call_tool(running, name, arguments_json)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    info = error_info(error)
    assert info.reason == reason, error.details()
    assert running.list(scope=SCOPE) == before
    return dict(info.metadata)


def seeded(running: Running) -> None:
    running.add("The repo uses uv", scope=SCOPE)


@pytest.mark.parametrize(
    ("name", "arguments_json"),
    [
        ("memory", DEEP),
        ("memory", '{"action": "add", "content": ' + DEEP + "}"),
        ("memory_search", '{"query": "uv", "limit": ' + DEEP + "}"),
        ("memory_list", '{"target": ' + DEEP + "}"),
        ("memory_20250818", DEEP),
        ("memory_20250818", '{"command": "view", "path": "/memories", "view_range": ' + DEEP + "}"),
        ("memory", "{" * 40_000),  # unbalanced, and as deep
    ],
)
def test_deep_arguments_are_refused(
    sidecar: Running, quiet: pytest.LogCaptureFixture, name: str, arguments_json: str
) -> None:
    seeded(sidecar)
    metadata = refused_as(sidecar, name, arguments_json, Reason.JSON_TOO_DEEP)
    assert metadata == {"field": "arguments_json", "limit": str(JSON_DEPTH)}


def test_arguments_as_deep_as_the_limit_still_parse(sidecar: Running) -> None:
    nested = "[" * (JSON_DEPTH - 1) + "]" * (JSON_DEPTH - 1)  # in an object: JSON_DEPTH
    request = pb.CallToolRequest(
        scope=SCOPE,
        session_id="s1",
        name="memory_list",
        arguments_json='{"target": "memory", "x": ' + nested + "}",
    )
    # A JSON object, as deep as allowed: an unknown argument, for the model.
    answer = sidecar.stub.CallTool(request, timeout=CALL_SECONDS)
    assert answer.is_error
    assert "unknown argument x" in answer.text


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("memory", {"action": "add", "content": "uses uv\\ud800"}),
        ("memory", {"action": "add", "content": "\\udfff"}),
        ("memory", {"action": "replace", "old_text": "uses\\ud800", "new_text": "uses pip"}),
        ("memory", {"action": "replace", "old_text": "uses uv", "new_text": "pip\\udbff"}),
        ("memory", {"action": "remove", "old_text": "\\ud800"}),
        ("memory_search", {"query": "uv\\ud800"}),
        ("memory_list", {"target\\ud800": "memory"}),
        (FILES, {"command": "create", "path": NOTES, "file_text": "a\\ud800"}),
        (FILES, {"command": "insert", "path": NOTES, "insert_line": 1, "insert_text": "\\ud800"}),
        (FILES, {"command": "str_replace", "path": NOTES, "old_str": "\\ud800", "new_str": "pip"}),
        (FILES, {"command": "str_replace", "path": NOTES, "old_str": "uv", "new_str": "\\ud800"}),
        (FILES, {"command": "view", "path": "/memories/\\ud800"}),
    ],
)
def test_lone_surrogates_are_refused(
    sidecar: Running, quiet: pytest.LogCaptureFixture, name: str, arguments: dict[str, str]
) -> None:
    seeded(sidecar)
    # The escape as JSON spells it: json.dumps would double the backslash.
    arguments_json = "{" + ", ".join(f'"{k}": {_value(v)}' for k, v in arguments.items()) + "}"
    metadata = refused_as(sidecar, name, arguments_json, Reason.LONE_SURROGATE)
    assert metadata["field"] == "arguments_json"
    assert metadata["character"].startswith("U+D")


def _value(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else json.dumps(value)


def test_a_surrogate_pair_is_a_character(sidecar: Running) -> None:
    request = pb.CallToolRequest(
        scope=SCOPE,
        session_id="s1",
        name="memory",
        arguments_json='{"action": "add", "content": "ships on Fridays \\ud83d\\ude80"}',
    )
    answer = sidecar.stub.CallTool(request, timeout=CALL_SECONDS)
    assert not answer.is_error, answer.text
    listed = sidecar.list(scope=SCOPE).memories
    assert [m.content for m in listed] == ["ships on Fridays \U0001f680"]


def _token(fields: list[Any]) -> str:
    raw = json.dumps(fields).replace("\\\\", "\\")
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "fields",
    [
        [2, "memories", "x", 0, "\\ud800"],
        [2, "\\udc00", "x", 0, "sig"],
        ["\\ud800"],
    ],
)
def test_page_tokens_and_cursors_with_lone_surrogates_are_invalid(
    sidecar: Running, quiet: pytest.LogCaptureFixture, fields: list[Any]
) -> None:
    seeded(sidecar)
    token = _token(fields)
    for call, request in (
        (sidecar.stub.GetMemories, pb.GetMemoriesRequest(scope=SCOPE, page_token=token)),
        (
            sidecar.stub.SearchMemories,
            pb.SearchMemoriesRequest(scope=SCOPE, query="uv", page_token=token),
        ),
    ):
        error = refused(call, request, timeout=CALL_SECONDS)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert error_info(error).reason == "PAGE_TOKEN_INVALID"
    export = sidecar.stub.ExportMemories(pb.ExportMemoriesRequest(scope=SCOPE, cursor=token))
    error = refused(list, export)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error_info(error).reason == "CURSOR_INVALID"


@pytest.mark.parametrize(
    "line",
    [
        '{"id": "m1", "tier": "memory", "owner": "coder", "content": "a\\ud800", '
        '"created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z"}',
        '{"id": "m1", "tier": "memory", "owner": "coder", "content": ' + DEEP + "}",
    ],
)
def test_import_lines_with_lone_surrogates_or_deep_nesting_are_invalid(line: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        parse_line(3, line)
    assert raised.value.reason == Reason.IMPORT_LINE_INVALID
    assert raised.value.message.startswith("line 3: line ")


def test_caller_json_counts_depth_outside_strings_only() -> None:
    assert caller_json("f", '["' + "[" * 100 + '"]') == ["[" * 100]
    assert caller_json("f", '{"a": "\\\\ud800"}') == {"a": "\\ud800"}  # an escaped backslash
    with pytest.raises(ValueError, match="Expecting value"):
        caller_json("f", "]" * 100)  # not JSON, and not deep


@pytest.mark.parametrize("multiline", [False, True])
def test_checked_refuses_lone_surrogates(multiline: bool) -> None:
    with pytest.raises(InvalidArgument) as raised:
        checked("content", "ok \ud800", 100, multiline=multiline)
    assert raised.value.reason == Reason.LONE_SURROGATE
    assert raised.value.metadata == {"field": "content", "position": "3", "character": "U+D800"}
