"""The Go client (clients/go): its own `go test` suite against a real daemon
(SQLite) with a cut proxy in front, the worked agent loop as the README
builds and runs it, and committed stubs that match the proto.

Everything builds offline in GOPATH mode against the Go sources Debian
installs under /usr/share/gocode, as tests/test_go_client.py's example does:
a temporary GOPATH holds the module's path as a link to clients/go.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.clients.cut_proxy import cut_proxy
from tests.conftest import ROOT, START_SECONDS, MakeSidecar, require_tool
from tests.test_go_client import _debian_go_sources, _go_build_cache

CLIENT = ROOT / "clients" / "go"
MODULE = "github.com/memory-sidecar/memory-sidecar/clients/go"
# What a generated file says of the tools that wrote it: lines that differ
# between protoc releases without the code differing.
VERSION_LINE = re.compile(r"^//[ \t]+protoc(-gen-go|-gen-go-grpc)?[ \t]+v?\d.*$", flags=re.M)


def _require_go() -> None:
    require_tool(shutil.which("go"), "go (Debian's golang-go package)")
    require_tool(
        _debian_go_sources(),
        "the Go libraries' sources (Debian's golang-google-grpc-dev, "
        "golang-google-genproto-dev and golang-github-golang-protobuf-1-5-dev)",
    )


def _go_env(tmp_path: Path) -> dict[str, str]:
    """GOPATH mode over a temporary GOPATH and Debian's sources; none of the
    developer's own Go settings leak in but the build cache, which is keyed
    by content (a rerun links grpc-go instead of compiling it again)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GO")}
    env.update(TMPDIR=str(tmp_path), GOENV="off", GOPROXY="off", GO111MODULE="off")
    env["GOCACHE"] = _go_build_cache(env) or str(tmp_path / "gocache")
    env["GOPATH"] = f"{tmp_path / 'gopath'}:/usr/share/gocode"
    return env


def _module_dir(tmp_path: Path) -> Path:
    """The module's import path inside the temporary GOPATH, linked to
    clients/go (GOPATH mode finds packages by their path only)."""
    linked = tmp_path / "gopath" / "src" / MODULE
    linked.parent.mkdir(parents=True, exist_ok=True)
    linked.symlink_to(CLIENT, target_is_directory=True)
    return linked


def test_go_client_suite_passes_against_a_real_daemon(
    make_sidecar: MakeSidecar, tmp_path: Path
) -> None:
    _require_go()
    running = make_sidecar()
    env = _go_env(tmp_path)
    with cut_proxy(running.addresses.api) as proxy:
        env.update(proxy.environment(), MEMORY_SIDECAR_ADDRESS=running.addresses.api)
        # The bound is a cold build cache's: grpc-go compiles first. The
        # turn overhead benchmark (`make bench` section 26 runs it at size)
        # runs a few times, to show it still answers.
        bench = ["-bench", "^BenchmarkDaemonTurnOverhead$", "-benchtime", "5x"]
        result = subprocess.run(
            ["go", "test", "-count=1", "-v", *bench, "./..."],
            cwd=_module_dir(tmp_path),
            env=env,
            capture_output=True,
            text=True,
            timeout=START_SECONDS * 3,
            check=False,
        )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    passed = set(re.findall(r"^--- PASS: (\w+)", result.stdout, flags=re.M))
    skipped = re.findall(r"^--- SKIP: (\w+)", result.stdout, flags=re.M)
    assert skipped == [], f"skipped with a daemon running: {skipped}"
    assert re.search(r"^BenchmarkDaemonTurnOverhead\S*\s+5\s.* p50-ratio\b", result.stdout, re.M), (
        result.stdout[-4000:]
    )
    # The cases, each against the daemon (the cut ones through the proxy).
    assert {
        "TestDaemonAWriteRetriedAfterACutIsStoredOnce",
        "TestDaemonReadsAfterAWriteCarryItsGenerationAndSeeIt",
        "TestDaemonABudgetRefusalCarriesItsUsage",
        "TestDaemonExportResumesAcrossACut",
        "TestDaemonWatchResumesAcrossACutMissingAndRepeatingNothing",
        "TestDaemonTheTurnLoop",
        "TestReadsCarryTheHighestGenerationWritten",
        "TestReadsCarryAToolCallsGeneration",
        "TestDaemonReadsAfterAToolWriteCarryItsGeneration",
    } <= passed, sorted(passed)


def _readme_go_commands() -> str:
    readme = (ROOT / "README.md").read_text()
    go_section = readme[readme.index("- **Go**:") :]
    block = re.search(r"```sh\n(.*?)```", go_section, flags=re.DOTALL)
    assert block is not None, "no sh block in the README's Go section"
    return textwrap.dedent(block[1])


def test_the_agent_loop_runs_as_the_readme_builds_it(
    make_sidecar: MakeSidecar, tmp_path: Path
) -> None:
    _require_go()
    commands = _readme_go_commands()
    assert commands.count("127.0.0.1:50051") == 1
    running = make_sidecar()
    env = _go_env(tmp_path)
    del env["GOPATH"], env["GO111MODULE"]  # the README's commands set them
    result = subprocess.run(
        ["bash", "-euc", commands.replace("127.0.0.1:50051", running.addresses.api)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_SECONDS * 3,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    print(result.stdout)  # the loop's steps, shown when a check below fails
    steps = [json.loads(line) for line in result.stdout.splitlines()]
    kinds = [s["step"] for s in steps]
    assert kinds == [
        "tools",
        *("turn", "tool", "answer"),
        *("turn", "tool", "answer"),
        *("turn", "answer"),
        "compaction",
        "end",
    ]
    assert {"memory", "memory_search", "memory_list"} <= set(steps[0]["names"])
    turns = [s for s in steps if s["step"] == "turn"]
    tools = [s for s in steps if s["step"] == "tool"]
    answers = [s["text"] for s in steps if s["step"] == "answer"]
    # The model saw the user's profile in the frozen block from the start,
    # saved a note with the memory tool, found it with memory_search, and
    # answered the last question from what was injected.
    assert "The user's name is Ada" in turns[0]["system_block"]
    assert turns[0]["cache_hit"] is False
    assert [(t["name"], t["is_error"]) for t in tools] == [
        ("memory", False),
        ("memory_search", False),
    ]
    assert "deploys go through ops/deploy.sh" in tools[1]["text"]
    assert "ops/deploy.sh" in turns[2]["system_block"] + turns[2]["turn_context"]
    assert answers[2] == "From memory: deploys go through ops/deploy.sh"
    assert steps[-1] == {"step": "end", "dropped": True}
    # The daemon holds what the loop wrote, once.
    scope = pb.Scope(agent_id="go-loop-agent", user_id="go-loop-user")
    stored = [m.content for m in running.list(scope=scope).memories]
    assert stored == ["The user's name is Ada", "deploys go through ops/deploy.sh"]


def test_the_committed_stubs_are_what_protoc_generates(tmp_path: Path) -> None:
    for tool, package in [
        ("protoc", "protobuf-compiler"),
        ("protoc-gen-go", "protoc-gen-go"),
        ("protoc-gen-go-grpc", "protoc-gen-go-grpc"),
    ]:
        require_tool(shutil.which(tool), f"{tool} (Debian's {package} package)")
    subprocess.run(
        [
            "protoc",
            "-I",
            str(ROOT / "protos"),
            f"--go_out={tmp_path}",
            f"--go_opt=module={MODULE}",
            f"--go-grpc_out={tmp_path}",
            f"--go-grpc_opt=module={MODULE}",
            "memory/v1/memory.proto",
        ],
        check=True,
        timeout=START_SECONDS,
    )
    generated = sorted(p.name for p in (tmp_path / "memoryv1").iterdir())
    committed = sorted(p.name for p in (CLIENT / "memoryv1").iterdir())
    assert generated == committed == ["memory.pb.go", "memory_grpc.pb.go"]
    for name in generated:
        fresh = VERSION_LINE.sub("", (tmp_path / "memoryv1" / name).read_text())
        kept = VERSION_LINE.sub("", (CLIENT / "memoryv1" / name).read_text())
        assert fresh == kept, (
            f"clients/go/memoryv1/{name} is stale: regenerate it (clients/go/README.md)"
        )


def test_the_client_readmes_example_is_the_one_go_test_compiles() -> None:
    readme = (CLIENT / "README.md").read_text()
    block = re.search(r"```go\n(.*?)```", readme, flags=re.DOTALL)
    assert block is not None, "no go block in clients/go/README.md"
    compiled = (CLIENT / "memory" / "example_test.go").read_text()
    lines = [line.strip() for line in compiled.splitlines()]
    at = 0
    for line in filter(None, (line.strip() for line in block[1].splitlines())):
        assert line in lines[at:], f"example_test.go lacks (in order) {line!r}"
        at = lines.index(line, at) + 1


def test_the_go_client_is_gofmt_clean() -> None:
    gofmt = require_tool(shutil.which("gofmt"), "gofmt (Debian's golang-go package)")
    result = subprocess.run(
        [gofmt, "-l", str(CLIENT)],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=True,
    )
    assert result.stdout == "", f"run gofmt -w on {result.stdout}"
