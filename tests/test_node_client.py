"""The contract from outside Python: the Node example against a real daemon."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import (
    ROOT,
    START_SECONDS,
    MakeSidecar,
    require_tool,
)
from tests.endpoint import JsonEndpoint

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


def node_and_packages() -> str:
    """Node's path, once the Node example's packages are installed."""
    node = require_tool(shutil.which("node"), "Node.js")
    require_tool(
        str(EXAMPLE / "node_modules") if (EXAMPLE / "node_modules").is_dir() else None,
        "the Node example's packages (`make node-example` installs them with npm)",
    )
    return node


def run_example(script: str, address: str) -> list[dict[str, Any]]:
    """The JSON lines a Node example prints against the daemon at `address`."""
    node = node_and_packages()
    result = subprocess.run(
        [node, str(EXAMPLE / script), address],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
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


def test_node_drives_claudes_memory_tool_through_the_sdks_helper(
    make_sidecar: MakeSidecar,
) -> None:
    # examples/node/claude_memory.js: @anthropic-ai/sdk's betaMemoryTool parses
    # each tool_use input and its handlers forward the command to CallTool.
    running = make_sidecar()
    steps = run_example("claude_memory.js", running.addresses.api)
    declaration = {"type": "memory_20250818", "name": "memory"}
    assert steps[0] == {"step": "declaration", "listed": declaration, "sdk": declaration}
    results = [s["tool_result"] for s in steps[1:]]
    assert [r["tool_use_id"] for r in results] == [f"toolu_{n}" for n in range(8)]
    assert [r["is_error"] for r in results] == [False] * 5 + [True] * 3
    texts = [r["content"] for r in results]
    assert texts[0].splitlines() == [
        "Here're the files and directories up to 2 levels deep in /memories, excluding hidden "
        "items:",
        "0B\t/memories",
        "0B\t/memories/notes.md",
        "0B\t/memories/user.md",
    ]
    assert texts[1] == "File created successfully at: /memories/notes.md"
    assert texts[2].splitlines() == [
        "The memory file has been edited. Here is the snippet showing the change (with line "
        "numbers):",
        "     1\tDeploy target is AWS eu-west-1",
        "     2\tCI runs on Debian",
    ]
    assert texts[3] == "The file /memories/user.md has been edited."
    assert texts[4] == (
        "Here's the content of /memories/notes.md with line numbers:\n"
        "     1\tDeploy target is AWS eu-west-1"
    )
    assert texts[5] == (
        "No replacement was performed, old_str `Windows` did not appear verbatim in "
        "/memories/notes.md."
    )
    assert texts[6].startswith("Cannot delete /memories/notes.md: the two memory files")
    assert texts[7] == "Path /memories/../etc/passwd would escape /memories directory"
    listed = running.list(scope=pb.Scope(agent_id="node-agent", user_id="node-user"))
    assert [m.content for m in listed.memories] == [
        "Deploy target is AWS eu-west-1",
        "CI runs on Debian",
        "The user prefers short answers",
    ]


@dataclass
class MessagesApi(JsonEndpoint):
    """Anthropic's Messages API as far as the loop needs it: each POST gets
    the next of `replies` (a message's content blocks) as a message that
    stops for its tool_use blocks, or ends the turn without any."""

    replies: list[list[dict[str, Any]]] = field(default_factory=list)

    def answer(self, body: dict[str, Any]) -> bytes:
        content = self.replies[len(self.requests) - 1]
        uses = any(block["type"] == "tool_use" for block in content)
        message = {
            "id": f"msg_{len(self.requests)}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": "tool_use" if uses else "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
        return json.dumps(message).encode()


def test_the_typescript_loop_in_the_api_docs_type_checks_and_runs(
    make_sidecar: MakeSidecar, tmp_path: Path
) -> None:
    # docs/API.md's TypeScript loop, as written: checked by tsc --strict
    # against the SDK's and Node's types, then run against a real daemon with
    # a stand-in for Anthropic's API replying as Claude would (the same
    # replies as test_memory_files.py's Python loop gets).
    node = node_and_packages()
    tsc = EXAMPLE / "node_modules" / "typescript" / "bin" / "tsc"
    require_tool(
        str(tsc) if tsc.is_file() else None,
        "TypeScript in the Node example's packages (`make node-example` installs it)",
    )
    running = make_sidecar()
    api = (ROOT / "docs" / "API.md").read_text()
    loop = api[api.index("**The loop in TypeScript**") :]
    code = loop[loop.index("```ts\n") + len("```ts\n") : loop.index("```\n\nWith")]
    (tmp_path / "loop.mts").write_text(code.replace("127.0.0.1:50051", running.addresses.api))
    # Its imports resolve as in examples/node: that one's packages, and its
    # stubs.js (typed by tsc from the JavaScript, run from where it lies).
    (tmp_path / "node_modules").symlink_to(EXAMPLE / "node_modules", target_is_directory=True)
    (tmp_path / "stubs.js").symlink_to(EXAMPLE / "stubs.js")
    options = {
        "strict": True,
        "module": "nodenext",
        "target": "es2022",
        "types": ["node"],
        "allowJs": True,
        "skipLibCheck": True,
    }
    config = {"compilerOptions": options, "files": ["loop.mts"]}
    (tmp_path / "tsconfig.json").write_text(json.dumps(config))

    def compile_(*flags: str) -> None:
        result = subprocess.run(
            [node, str(tsc), "--project", str(tmp_path / "tsconfig.json"), *flags],
            capture_output=True,
            text=True,
            timeout=START_SECONDS,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr

    compile_("--noEmit")
    # To JavaScript (loop.mjs, beside it) without also emitting stubs.js,
    # which would then look for the protos from here: stubs.js untyped.
    compile_("--allowJs", "false", "--noImplicitAny", "false")

    messages_api = MessagesApi(
        replies=[
            [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "memory",
                    "input": {"command": "view", "path": "/memories/notes.md"},
                }
            ],
            [
                {"type": "text", "text": "Noted."},
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "memory",
                    "input": {
                        "command": "insert",
                        "path": "/memories/notes.md",
                        "insert_line": 0,
                        "insert_text": "We deploy to eu-west-1",
                    },
                },
            ],
            [{"type": "text", "text": "Saved."}],
        ]
    )
    environ = {
        name: value for name, value in os.environ.items() if not name.startswith("ANTHROPIC_")
    }
    with messages_api.serving():
        environ["ANTHROPIC_BASE_URL"] = f"http://127.0.0.1:{messages_api.port}"
        environ["ANTHROPIC_API_KEY"] = "sk-ant-test"
        result = subprocess.run(
            [node, str(tmp_path / "loop.mjs")],
            capture_output=True,
            text=True,
            timeout=START_SECONDS,
            env=environ,
            check=False,
        )
    assert result.returncode == 0, result.stderr

    requests = messages_api.requests
    assert [r["path"] for r in requests] == ["/v1/messages"] * 3
    bodies = [r["body"] for r in requests]
    assert [b["tools"] for b in bodies] == [[{"type": "memory_20250818", "name": "memory"}]] * 3
    assert bodies[0]["messages"] == [
        {"role": "user", "content": "Remember that we deploy to eu-west-1."}
    ]
    # Claude's reply goes back as it came, then the tool_result of its tool_use.
    assert bodies[1]["messages"][1] == {
        "role": "assistant",
        "content": messages_api.replies[0],
    }
    assert bodies[1]["messages"][2] == {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": "Here's the content of /memories/notes.md with line numbers:",
                "is_error": False,
            }
        ],
    }
    assert bodies[2]["messages"][-1]["content"] == [
        {
            "type": "tool_result",
            "tool_use_id": "toolu_2",
            "content": "The file /memories/notes.md has been edited.",
            "is_error": False,
        }
    ]
    listed = running.list(scope=pb.Scope(agent_id="coder", user_id="ada"))
    assert [m.content for m in listed.memories] == ["We deploy to eu-west-1"]
