"""Refused credentials, and tokens a daemon without auth was sent, in the
log: rate-limited per kind, and never the token."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.api.auth_log import AuthLog
from tests.api.test_access import TOKEN, token_file, with_token  # noqa: F401 (a fixture)
from tests.api.test_mcp_http import ACCEPT, INITIALIZE
from tests.conftest import (
    CALL_SECONDS,
    Clock,
    MakeSidecar,
    refused,
)

WRONG = "wrong-s3cret-guess"
ADD = "/memory.v1.MemoryService/AddMemory"


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sidecar.auth"]


def test_each_kind_is_logged_once_per_window_with_the_count_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    auth_log = AuthLog(every=60, clock=clock)
    with caplog.at_level(logging.WARNING, logger="sidecar.auth"):
        for _ in range(5):
            auth_log.refused("gRPC", "TOKEN_INVALID", ADD)
        auth_log.refused("gRPC", "TOKEN_MISSING", ADD)  # another kind: its own line
        auth_log.refused("MCP", "TOKEN_INVALID", "POST /mcp")
        clock.now = 59.9
        auth_log.refused("gRPC", "TOKEN_INVALID", ADD)
        clock.now = 60.0
        auth_log.refused("gRPC", "TOKEN_INVALID", ADD)
        clock.now = 200.0
        auth_log.refused("gRPC", "TOKEN_INVALID", ADD)
    assert lines(caplog) == [
        f"refused {ADD} over gRPC: TOKEN_INVALID (a bearer token missing or not valid)",
        f"refused {ADD} over gRPC: TOKEN_MISSING (a bearer token missing or not valid)",
        "refused POST /mcp over MCP: TOKEN_INVALID (a bearer token missing or not valid)",
        f"refused {ADD} over gRPC: TOKEN_INVALID (a bearer token missing or not valid)"
        "; 5 more like it not logged in the last 60 s",
        f"refused {ADD} over gRPC: TOKEN_INVALID (a bearer token missing or not valid)",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "sidecar.auth")


def test_refused_grpc_calls_are_logged_without_the_token(
    make_sidecar: MakeSidecar,
    token_file: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    running = make_sidecar(auth_token_file=str(token_file))
    with caplog.at_level(logging.WARNING, logger="sidecar.auth"):
        for _ in range(3):
            error = refused(
                running.stub.AddMemory,
                pb.AddMemoryRequest(content="x"),
                timeout=CALL_SECONDS,
                metadata=with_token(WRONG),
            )
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        refused(running.stub.GetMemories, pb.GetMemoriesRequest(), timeout=CALL_SECONDS)
    logged = lines(caplog)
    assert logged == [
        f"refused {ADD} over gRPC: TOKEN_INVALID (a bearer token missing or not valid)",
        "refused /memory.v1.MemoryService/GetMemories over gRPC: TOKEN_MISSING"
        " (a bearer token missing or not valid)",
    ]
    assert WRONG not in caplog.text
    assert TOKEN not in caplog.text


def post_initialize(url: str, token: str) -> int:
    """An MCP initialize with `token` as its bearer: the HTTP status."""
    request = urllib.request.Request(
        url,
        data=json.dumps(INITIALIZE).encode(),
        headers={"Authorization": f"Bearer {token}", **ACCEPT},
    )
    try:
        with urllib.request.urlopen(request, timeout=CALL_SECONDS) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_refused_mcp_requests_are_logged_without_the_token(
    make_sidecar: MakeSidecar,
    token_file: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    running = make_sidecar(auth_token_file=str(token_file), mcp_listen="127.0.0.1:0")
    assert running.addresses.mcp is not None
    with caplog.at_level(logging.WARNING, logger="sidecar.auth"):
        assert post_initialize(running.addresses.mcp, WRONG) == 401
        assert post_initialize(running.addresses.mcp, WRONG) == 401
    assert lines(caplog) == [
        "refused POST /mcp over MCP: TOKEN_INVALID (a bearer token missing or not valid)"
    ]
    assert WRONG not in caplog.text


def test_a_token_sent_to_a_daemon_without_auth_is_warned_of(
    make_sidecar: MakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    running = make_sidecar(mcp_listen="127.0.0.1:0")
    assert running.addresses.mcp is not None
    with caplog.at_level(logging.WARNING, logger="sidecar.auth"):
        for _ in range(2):
            listed = running.stub.GetMemories(
                pb.GetMemoriesRequest(), metadata=with_token(WRONG), timeout=CALL_SECONDS
            )
            assert list(listed.memories) == []  # served, as anyone's
            assert post_initialize(running.addresses.mcp, WRONG) == 200
        running.stub.GetMemories(pb.GetMemoriesRequest(), timeout=CALL_SECONDS)  # no token: no line
    logged = lines(caplog)
    assert len(logged) == 2
    assert logged[0].startswith(
        "/memory.v1.MemoryService/GetMemories over gRPC came with a bearer token, "
        "but this daemon checks none"
    )
    assert logged[1].startswith("/mcp over MCP came with a bearer token")
    assert WRONG not in caplog.text
