"""MCP sessions per token and scope (sidecar.api.mcp_sessions): the caps per
tenant, per token and in all, each tenant refused on its own; DELETE and the
idle timeout free a slot, and idleness ends the runtime session.

Driven over real HTTP against a real daemon, as a client that is not an SDK
sends its requests (tests/api/test_mcp_http.py's `post`, INITIALIZE, ACCEPT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.api.mcp_sessions import Caps, SessionTable, Tenant
from sidecar.core.memory import Scope
from tests.api.test_access_tokens import ADA, ADMIN, AGENT_A, tokens_file  # noqa: F401
from tests.api.test_mcp_http import (
    ACCEPT,
    bound,
    connect,
    mcp_sidecar,
    post,
    refusal,
    run,
    url,
)
from tests.conftest import CALL_SECONDS, MakeSidecar, Running, eventually

VERSION = {"MCP-Protocol-Version": "2025-11-25"}


def open_session(running: Running, **binding: str) -> httpx2.Response:
    return post(url(running), bound(**binding))


def opened(running: Running, **binding: str) -> str:
    answer = open_session(running, **binding)
    assert answer.status_code == 200, answer.text
    return str(answer.headers["mcp-session-id"])


def delete(running: Running, session: str, **binding: str) -> int:
    with httpx2.Client(timeout=CALL_SECONDS) as http:
        headers = {**ACCEPT, **bound(**binding), **VERSION, "Mcp-Session-Id": session}
        return http.delete(url(running), headers=headers).status_code


def exposed(running: Running, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample as Prometheus scrapes it (the registry's text, parsed)."""
    text = generate_latest(running.sidecar.metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == (labels or {}):
                return float(sample.value)
    raise AssertionError(f"{name}{labels or ''} is not exported")


def refused(running: Running, limit: str) -> float:
    return exposed(running, "memory_mcp_sessions_refused_total", {"limit": limit})


def exhausted(answer: httpx2.Response, limit: str) -> dict[str, Any]:
    assert answer.status_code == 429, answer.text
    error = refusal(answer)
    assert error["data"]["code"] == "RESOURCE_EXHAUSTED"
    assert error["data"]["reason"] == "MCP_SESSIONS_EXHAUSTED"
    assert error["data"]["metadata"]["limit"] == limit
    assert "DELETE" in error["message"]
    assert "server.mcp_session_idle_minutes" in error["message"]
    return error


def test_a_tenant_at_its_cap_is_refused_and_no_other_tenant_is(
    make_sidecar: MakeSidecar,
    tokens_file: Path,  # noqa: F811
) -> None:
    running = mcp_sidecar(
        make_sidecar, auth_tokens_file=str(tokens_file), mcp_max_sessions_per_tenant=3
    )
    for _ in range(3):
        opened(running, token=ADMIN)
    error = exhausted(open_session(running, token=ADMIN), "tenant")
    assert "3, server.mcp_max_sessions_per_tenant" in error["message"]
    assert error["data"]["metadata"]["max"] == "3"
    assert refused(running, "tenant") == 1
    # Another token in the same scope, and the same token in another scope,
    # are other tenants: neither is refused.
    opened(running, token=ADA)
    opened(running, agent="coder", user="bob", token=ADMIN)
    opened(running, agent="agent-a", token=AGENT_A)
    # A 2026-07-28 client opens no session, and is not counted.

    async def sessionless() -> bool:
        async with connect(url(running), "auto", token=ADMIN) as client:
            return bool((await client.list_tools()).tools)

    assert run(sessionless)
    assert refused(running, "tenant") == 1
    assert exposed(running, "memory_mcp_sessions_open") == 6


def test_a_token_is_capped_across_its_scopes_and_the_listener_in_all(
    make_sidecar: MakeSidecar,
    tokens_file: Path,  # noqa: F811
) -> None:
    running = mcp_sidecar(
        make_sidecar,
        auth_tokens_file=str(tokens_file),
        mcp_max_sessions_per_tenant=2,
        mcp_max_sessions_per_token=3,
        mcp_max_sessions=5,
    )
    opened(running, token=ADMIN)
    opened(running, token=ADMIN)
    opened(running, agent="coder", user="bob", token=ADMIN)
    exhausted(open_session(running, agent="x", user="y", token=ADMIN), "token")
    opened(running, token=ADA)
    opened(running, token=ADA)
    error = exhausted(open_session(running, agent="agent-a", token=AGENT_A), "total")
    assert "5, server.mcp_max_sessions;" in error["message"]
    assert (refused(running, "token"), refused(running, "total")) == (1, 1)


def test_delete_frees_a_slot(make_sidecar: MakeSidecar) -> None:
    running = mcp_sidecar(make_sidecar, mcp_max_sessions_per_tenant=1)
    session = opened(running)
    exhausted(open_session(running), "tenant")
    # Another scope's DELETE of it is not its owner's: 404, the slot kept.
    assert delete(running, session, agent="other") == 404
    exhausted(open_session(running), "tenant")
    assert delete(running, session) == 200
    opened(running)


def _read_block(running: Running, session: str) -> int:
    """Read the frozen block in `session` (which makes its runtime session)."""
    with httpx2.Client(timeout=CALL_SECONDS) as http:
        headers = {**ACCEPT, **bound(), **VERSION, "Mcp-Session-Id": session}
        ready = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        status = http.post(url(running), headers=headers, json=ready).status_code
        if status >= 400:
            return status
        read = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "resources/read",
            "params": {"uri": "memory://frozen-block"},
        }
        return http.post(url(running), headers=headers, json=read).status_code


def test_an_idle_session_is_closed_and_its_runtime_session_ended(
    make_sidecar: MakeSidecar,
) -> None:
    # 0.6 s idle: under load a session may expire before the test reads in
    # it; then the test opens another. Expiring late only makes it wait.
    running = mcp_sidecar(
        make_sidecar, mcp_max_sessions_per_tenant=1, mcp_session_idle_minutes=0.01
    )
    ended = {"reason": "session_end"}

    def read_in_a_session() -> str | None:
        session = open_session(running)
        if session.status_code == 429:  # the last one has not expired yet
            return None
        assert session.status_code == 200, session.text
        sid = str(session.headers["mcp-session-id"])
        return sid if _read_block(running, sid) == 200 else None

    before = exposed(running, "memory_snapshot_invalidations_total", ended)
    session = eventually(read_in_a_session, "a session that lived to read its block")
    eventually(
        lambda: exposed(running, "memory_snapshot_invalidations_total", ended) > before,
        "the idle session's runtime session to end",
    )
    eventually(lambda: open_session(running).status_code == 200, "the idle session's slot to free")
    assert _read_block(running, session) == 404


def test_the_table_counts_idleness_from_the_last_request_in_flight() -> None:
    now = [0.0]
    table = SessionTable(Caps(1, 1, 1, idle_seconds=60), clock=lambda: now[0])
    ada = Tenant("digest", Scope("coder", "ada"))
    assert table.admit(ada) is None
    table.opened("s", ada, principal=None, ends_runtime=True)
    session = table.owned("s", ada)
    assert session is not None
    assert table.owned("s", Tenant(None, Scope("coder", "ada"))) is None
    table.begin(session)
    now[0] = 120.0
    assert table.idle() == []  # a request in flight (a GET stream) is not idle
    table.end(session)
    now[0] = 179.0
    assert table.idle() == []
    now[0] = 180.0
    assert table.idle() == ["s"]
    assert table.admit(ada) is not None
    # A request that came after the sweep listed it keeps it open.
    table.begin(session)
    assert table.close_idle("s") is None
    table.end(session)
    assert table.close_idle("s") is None  # idle again from now
    now[0] = 240.0
    assert table.close_idle("s") is session
    assert table.admit(ada) is None
