"""Section 25 of `make bench`: what an open MCP session costs the daemon.

Owns `bench_mcp_sessions`: a daemon with the MCP listener, its session caps
raised to `many`, opened `many` handshake-era sessions (an initialize POST
each, none ended) by one client in one scope; the daemon's VmRSS before,
after 100 and after all, per session; the next one refused (429,
MCP_SESSIONS_EXHAUSTED); and VmRSS once all are ended again (DELETE). The
figure docs/SECURITY.md and docs/API.md state ("MCP sessions") is this one.

Must not touch the shared helpers (bench.measure) beyond a daemon and its
VmRSS; its database is mcp-sessions.db.
"""

from __future__ import annotations

from pathlib import Path

import httpx2

from bench.measure import Report, Row, daemon

_INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "bench", "version": "0"},
    },
}
_HEADERS = {
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
    "X-Memory-Agent-Id": "bench-agent",
    "X-Memory-User-Id": "bench-user",
}


def _open(http: httpx2.Client, url: str, count: int) -> list[str]:
    sessions = []
    for _ in range(count):
        answer = http.post(url, headers=_HEADERS, json=_INITIALIZE)
        answer.raise_for_status()
        sessions.append(answer.headers["mcp-session-id"])
    return sessions


def bench_mcp_sessions(report: Report, work: Path, many: int) -> None:
    config = (
        "server:\n"
        "  mcp_listen: 127.0.0.1:0\n"
        f"  mcp_max_sessions_per_tenant: {many}\n"
        f"  mcp_max_sessions_per_token: {many}\n"
        f"  mcp_max_sessions: {many}\n"
    )
    with daemon(work / "mcp-sessions.db", config) as d, httpx2.Client(timeout=60) as http:
        _open(http, d.mcp, 40)  # the first sessions' imports and caches
        base = d.rss_bytes()
        sessions = _open(http, d.mcp, 100)
        at_100 = d.rss_bytes()
        sessions += _open(http, d.mcp, many - 140)
        at_many = d.rss_bytes()
        refused = http.post(d.mcp, headers=_HEADERS, json=_INITIALIZE)
        reason = refused.json().get("error", {}).get("data", {}).get("reason", "")
        for session in sessions:
            http.delete(
                d.mcp,
                headers={
                    **_HEADERS,
                    "Mcp-Session-Id": session,
                    "MCP-Protocol-Version": "2025-11-25",
                },
            )
        ended = d.rss_bytes()
    opened = len(sessions)
    per = (at_many - base) / opened
    report.figures["mcp_session_bytes"] = round(per)
    rows: list[Row] = [
        ["before", "40", f"{base / 2**20:,.1f} MiB", ""],
        ["+100 sessions", "140", f"{at_100 / 2**20:,.1f} MiB", f"{(at_100 - base) / 100:,.0f}"],
        [f"+{opened:,} sessions", f"{many:,}", f"{at_many / 2**20:,.1f} MiB", f"{per:,.0f}"],
        ["all ended (DELETE)", "0", f"{ended / 2**20:,.1f} MiB", ""],
    ]
    report.add(
        "25. What an open MCP session costs",
        f"The daemon's VmRSS as one client opens {many:,} handshake-era MCP sessions (an "
        "initialize POST each, never ended) in one scope, with the session caps raised to "
        f"{many:,}; bytes per session over those opened after the first 40. The next one was "
        f"refused: HTTP {refused.status_code}, {reason}. Ending them all gives the memory back "
        "to the allocator, not all of it to the system.",
        ["after", "open", "VmRSS", "bytes / session"],
        rows,
    )
