"""The contract from outside Python: the Node example against a real daemon."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import ROOT, MakeSidecar, require_tool

EXAMPLE = ROOT / "examples" / "node"

# The ErrorInfo every client example prints for its over-budget write.
BUDGET_ERROR_INFO = {
    "reason": "TIER_BUDGET_EXCEEDED",
    "domain": "memory.v1",
    "metadata": {
        "tier": "memory",
        "used_chars": "40",
        "limit_chars": "2200",
        "requested_chars": "2173",
    },
}


def run_example(script: str, address: str) -> list[dict[str, Any]]:
    """The JSON lines a Node example prints against the daemon at `address`."""
    node = require_tool(shutil.which("node"), "Node.js")
    require_tool(
        str(EXAMPLE / "node_modules") if (EXAMPLE / "node_modules").is_dir() else None,
        "the Node example's packages (`make node-example` installs them with npm)",
    )
    result = subprocess.run(
        [node, str(EXAMPLE / script), address],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_node_client_adds_turns_reads_error_details_and_ends(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar()
    steps = run_example("client.js", running.addresses.api)

    assert [s["step"] for s in steps] == ["add", "add", "turn", "turn", "budget", "end"]
    assert [(s["tier"], s["limit"]) for s in steps[:2]] == [
        ("TIER_MEMORY", 2200),
        ("TIER_USER", 1375),
    ]
    first, second = steps[2], steps[3]
    assert (first["cache_hit"], second["cache_hit"]) == (False, True)
    assert first["sha256"] == second["sha256"]
    assert first["has_notes"]
    assert first["has_profile"]
    budget = steps[4]
    assert budget["refused"] is True
    assert budget["code"] == "FAILED_PRECONDITION"
    assert budget["info"] == BUDGET_ERROR_INFO
    assert steps[5] == {"step": "end", "dropped": True}
    # The daemon saw exactly what the client wrote.
    listed = running.list(scope=pb.Scope(agent_id="node-agent", user_id="node-user"))
    assert [m.content for m in listed.memories] == [
        "The deploy script lives in ops/deploy.sh",
        "The user prefers answers in French",
    ]


def test_node_runs_the_models_tool_calls_through_list_tools_and_call_tool(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar()
    steps = run_example("tools.js", running.addresses.api)
    assert steps[0] == {"step": "tools", "names": ["memory", "memory_search", "memory_list"]}
    calls = steps[1:]
    assert [c["is_error"] for c in calls] == [False, False, False, False]
    assert calls[0]["text"] == (
        "Saved to agent notes (target=memory) [1% — 30/2,200 chars]: Deploy target is AWS us-east-1"
    )
    assert calls[2]["outcome"]["memory"]["content"] == "Deploy target is AWS eu-west-1"
    assert calls[3]["text"].splitlines() == [
        "agent notes (target=memory) [1% — 30/2,200 chars]:",
        "1. (30 chars) Deploy target is AWS eu-west-1",
        "user profile (target=user) [2% — 30/1,375 chars]:",
        "1. (30 chars) The user prefers short answers",
    ]
    listed = running.list(scope=pb.Scope(agent_id="node-agent", user_id="node-user"))
    assert [m.content for m in listed.memories] == [
        "Deploy target is AWS eu-west-1",
        "The user prefers short answers",
    ]
