"""The contract from Go with the raw stubs: examples/go/README.md's commands
generate stubs, build the Go example offline against Debian's Go sources, and
run it against a real daemon (the Go client, clients/go, has its own tests in
tests/clients/test_go_client.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import (
    ROOT,
    START_SECONDS,
    MakeSidecar,
    require_tool,
)
from tests.test_node_client import BUDGET_ERROR_INFO

EXAMPLE = ROOT / "examples" / "go"
# Where Debian's golang-*-dev packages install Go library sources.
GO_SOURCES = Path("/usr/share/gocode/src")


def _debian_go_sources() -> str | None:
    """/usr/share/gocode/src when it holds what the example imports.

    github.com/golang/protobuf must be 1.4 or later (Debian's 1-5 package,
    with proto/registry.go): grpc-go 1.33 marshals through it, and the 1.3
    package, which also satisfies golang-google-grpc-dev, builds the example
    but panics on the first message protoc-gen-go's stubs hand it.
    """
    needed = (
        "google.golang.org/grpc/status",
        "google.golang.org/genproto/googleapis/rpc/errdetails",
        "google.golang.org/protobuf/proto",
        "github.com/golang/protobuf/proto/registry.go",
    )
    found = all((GO_SOURCES / path).exists() for path in needed)
    return str(GO_SOURCES) if found else None


def _go_build_cache(env: dict[str, str]) -> str | None:
    """The build cache Go would use: $GOCACHE if set, else the default under
    the home directory; None when there is none (no $HOME, GOCACHE=off)."""
    configured = os.environ.get("GOCACHE", "")
    if os.path.isabs(configured):
        return configured
    found = subprocess.run(
        ["go", "env", "GOCACHE"],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    default = found.stdout.strip()
    return default if found.returncode == 0 and os.path.isabs(default) else None


def _readme_go_commands() -> str:
    readme = (EXAMPLE / "README.md").read_text()
    offline = readme[readme.index("## Offline, with Debian 12's packages") :]
    block = re.search(r"```sh\n(.*?)```", offline, flags=re.DOTALL)
    assert block is not None, "no sh block in examples/go/README.md's offline section"
    return textwrap.dedent(block[1])


def test_go_client_adds_turns_reads_error_details_and_ends(
    make_sidecar: MakeSidecar, tmp_path: Path
) -> None:
    for tool, package in [
        ("go", "golang-go"),
        ("protoc", "protobuf-compiler"),
        ("protoc-gen-go", "protoc-gen-go"),
        ("protoc-gen-go-grpc", "protoc-gen-go-grpc"),
    ]:
        require_tool(shutil.which(tool), f"{tool} (Debian's {package} package)")
    require_tool(
        _debian_go_sources(),
        "the Go libraries' sources (Debian's golang-google-grpc-dev, "
        "golang-google-genproto-dev and golang-github-golang-protobuf-1-5-dev)",
    )
    commands = _readme_go_commands()
    assert commands.count("127.0.0.1:50051") == 1
    running = make_sidecar()

    # The developer's own Go settings (GOFLAGS=-mod=mod, a go env file) must
    # not leak in; mktemp stays in this test's directory. The build cache is
    # the developer's own: it is keyed by content, so it cannot change what is
    # built, and with it a rerun links grpc-go instead of compiling it (15 s).
    env = {key: value for key, value in os.environ.items() if not key.startswith("GO")}
    env.update(TMPDIR=str(tmp_path), GOENV="off", GOPROXY="off")
    env["GOCACHE"] = _go_build_cache(env) or str(tmp_path / "gocache")
    result = subprocess.run(
        ["bash", "-euc", commands.replace("127.0.0.1:50051", running.addresses.api)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line) for line in result.stdout.splitlines()]

    assert [s["step"] for s in steps] == ["add", "add", "turn", "turn", "budget", "end"]
    assert [(s["tier"], s["used"], s["limit"]) for s in steps[:2]] == [
        ("TIER_MEMORY", 40, 2200),
        ("TIER_USER", 34, 1375),
    ]
    first, second = steps[2], steps[3]
    assert (first["cache_hit"], second["cache_hit"]) == (False, True)
    assert (first["sha256_match"], second["sha256_match"]) == (True, True)
    # A Python client in a session of its own sees the same two blocks.
    scope = pb.Scope(agent_id="go-agent", user_id="go-user")
    seen = running.turn("python-session", "Where is the deploy script?", scope=scope)
    assert first["sha256"] == second["sha256"] == seen.snapshot_sha256
    assert first["turn_context"] == second["turn_context"] == seen.turn_context
    budget = steps[4]
    assert (budget["refused"], budget["code"]) == (True, "FailedPrecondition")
    assert budget["info"] == BUDGET_ERROR_INFO
    assert steps[5] == {"step": "end", "dropped": True}
    listed = running.list(scope=scope)
    assert [m.content for m in listed.memories] == [
        "The deploy script lives in ops/deploy.sh",
        "The user prefers answers in French",
    ]
    assert listed.memories[1].confidence == 0.9

    # The stubs landed where `module=` puts them in the module's layout, under
    # the module path go.mod names (the route examples/go/README.md shows).
    (stubs,) = tmp_path.glob("tmp.*/src/example.com/memoryclient")
    assert sorted(p.name for p in (stubs / "memoryv1").iterdir()) == [
        "memory.pb.go",
        "memory_grpc.pb.go",
    ]
    assert "module example.com/memoryclient\n" in (EXAMPLE / "go.mod").read_text()


def test_go_example_is_gofmt_clean() -> None:
    gofmt = require_tool(shutil.which("gofmt"), "gofmt (Debian's golang-go package)")
    result = subprocess.run(
        [gofmt, "-l", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=True,
    )
    assert result.stdout == "", f"run gofmt -w on {result.stdout}"
