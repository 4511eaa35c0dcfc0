"""The MCP listener from outside Python: the official MCP TypeScript SDK's
client (examples/mcp-node) over streamable HTTP, against a real daemon."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import (
    ROOT,
    START_SECONDS,
    MakeSidecar,
    Running,
    require_tool,
)

EXAMPLE = ROOT / "examples" / "mcp-node"
SCOPE = pb.Scope(agent_id="node-agent", user_id="node-user")


def node_client(running: Running, *args: str) -> tuple[int, list[dict[str, Any]]]:
    node = require_tool(shutil.which("node"), "Node.js")
    require_tool(
        str(EXAMPLE / "node_modules") if (EXAMPLE / "node_modules").is_dir() else None,
        "the MCP Node example's packages (`make node-example` installs them with npm)",
    )
    assert running.addresses.mcp is not None
    result = subprocess.run(
        [node, str(EXAMPLE / "client.js"), running.addresses.mcp, *args],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    return result.returncode, [json.loads(line) for line in result.stdout.splitlines()]


def test_the_typescript_sdk_drives_every_tool_resource_and_prompt(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar(mcp_listen="127.0.0.1:0")
    code, steps = node_client(running)
    assert code == 0, steps
    by_step = {step["step"]: step for step in steps}
    assert list(by_step) == [
        "connect",
        "tools",
        "add",
        "profile",
        "search",
        "planted",
        "full",
        "unknown",
        "frozen",
        "prompt",
        "end",
    ]
    # The TypeScript SDK speaks the handshake era, with an MCP session.
    assert by_step["connect"] == {"step": "connect", "protocol": "2025-11-25", "session": True}
    assert by_step["tools"]["names"] == ["memory", "memory_search", "memory_list"]
    for step in ("add", "profile", "search"):
        assert by_step[step]["isError"] is False, by_step[step]
    assert by_step["profile"]["data"]["memory"]["target"] == "user"
    hits = by_step["search"]["data"]["hits"]
    assert [h["content"] for h in hits] == ["Deploys go through ops/deploy.sh"]
    planted = by_step["planted"]
    assert planted["isError"] is True
    assert planted["data"]["error"]["reason"] == "ARGUMENTS_INVALID"
    full = by_step["full"]
    assert full["isError"] is True
    assert full["data"]["error"]["reason"] == "TIER_BUDGET_EXCEEDED"
    assert "1. (32 chars) Deploys go through ops/deploy.sh" in full["text"]
    assert by_step["unknown"] == {"step": "unknown", "code": -32602, "reason": "TOOL_UNKNOWN"}
    assert "Deploys go through ops/deploy.sh" in by_step["frozen"]["text"]
    assert "Prefers answers in French" in by_step["frozen"]["text"]
    # Both entries are in the frozen block already: nothing to add.
    assert by_step["prompt"] == {
        "step": "prompt",
        "description": "No memories to add for this message",
        "messages": [],
    }
    # The daemon holds exactly what the client wrote, in the headers' scope.
    listed = running.list(scope=SCOPE)
    assert sorted(m.content for m in listed.memories) == [
        "Deploys go through ops/deploy.sh",
        "Prefers answers in French",
    ]
    assert running.list(scope=pb.Scope(agent_id="other-agent")).memories == []
    # Its DELETE ended the runtime session the resource read had opened.
    ended = running.sidecar.metrics.registry.get_sample_value(
        "memory_snapshot_invalidations_total", {"reason": "session_end"}
    )
    assert ended == 1


def test_the_typescript_sdk_is_refused_without_the_token(
    make_sidecar: MakeSidecar, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("node-token\n")
    running = make_sidecar(mcp_listen="127.0.0.1:0", auth_token_file=str(token))
    for presented, reason in (("", "TOKEN_MISSING"), ("not-it", "TOKEN_INVALID")):
        code, steps = node_client(running, *([presented] if presented else []))
        assert code == 1
        (refused,) = steps
        assert refused["refused"] is True
        assert f'"reason":"{reason}"' in refused["message"]
    code, steps = node_client(running, "node-token")
    assert code == 0
    assert steps[-1] == {"step": "end", "closed": True}
