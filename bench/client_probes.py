"""The Go and TypeScript clients' probes for section 26 of `make bench`.

Owns building them and running them against a daemon section 26 started:
the Go client's BenchmarkDaemonTurnOverhead (clients/go/memory/daemon_test.go),
compiled as a test binary offline in GOPATH mode over the Go sources Debian
installs (as tests/clients/test_go_client.py builds the client), and
clients/typescript/bench/turn-overhead.ts, compiled by the package's own tsc
into a directory laid out as installed (as
tests/clients/test_typescript_client.py compiles it). Each gives the raw
stub's and the client's p50 and p99 of a cached InjectForTurn measured in one
process, or why it could not run (a missing toolchain is a reason, not a
failure: the row says so).

Must not touch the clients' sources or the daemon; it builds into `work`
only and measures nothing itself (the probes time their own calls).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GO_CLIENT = ROOT / "clients" / "go"
GO_MODULE = "github.com/memory-sidecar/memory-sidecar/clients/go"
# Debian's golang-google-grpc-dev and friends: what the client imports.
GO_SOURCES = Path("/usr/share/gocode/src")
GO_NEEDS = (
    "google.golang.org/grpc/status",
    "google.golang.org/genproto/googleapis/rpc/errdetails",
    "google.golang.org/protobuf/proto",
    "github.com/golang/protobuf/proto/registry.go",
)
TS_CLIENT = ROOT / "clients" / "typescript"
# A cold Go build cache compiles grpc-go first; a loaded machine is slow.
BUILD_SECONDS = 900
RUN_SECONDS = 600
# `go test -bench`'s result line: the name, b.N, then "value unit" pairs.
GO_RESULT = re.compile(r"^BenchmarkDaemonTurnOverhead\S*\s+\d+\s+(.*)$", flags=re.M)


@dataclass
class Probe:
    """One client's figures in seconds, or `skipped`: why there are none."""

    stub: tuple[float, float] = (0.0, 0.0)  # p50, p99
    client: tuple[float, float] = (0.0, 0.0)
    cached: bool = False
    skipped: str = ""


@dataclass
class Built:
    """A probe ready to run against an address, or why it is not."""

    command: list[str]
    env: dict[str, str]
    skipped: str = ""


def _run(command: list[str], env: dict[str, str] | None, cwd: Path, seconds: int) -> str:
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=seconds, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return done.stdout


def build_go(work: Path) -> Built:
    """The Go client's test binary, built offline in GOPATH mode."""
    go = shutil.which("go")
    if go is None:
        return Built([], {}, "go not found")
    if not all((GO_SOURCES / path).exists() for path in GO_NEEDS):
        return Built([], {}, "Debian's Go gRPC sources not installed")
    # None of the developer's Go settings but the build cache, which is keyed
    # by content: a warm one links grpc-go instead of compiling it again.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GO", "MEMORY_SIDECAR_"))}
    cache = os.environ.get("GOCACHE", "")
    if not os.path.isabs(cache):
        found = subprocess.run(
            [go, "env", "GOCACHE"], env=env, capture_output=True, text=True, timeout=60
        )
        cache = found.stdout.strip() if found.returncode == 0 else ""
    gopath = work / "gopath"
    env.update(TMPDIR=str(work), GOENV="off", GOPROXY="off", GO111MODULE="off")
    env.update(GOCACHE=cache if os.path.isabs(cache) else str(work / "gocache"))
    env["GOPATH"] = f"{gopath}:{GO_SOURCES.parent}"
    # GOPATH mode finds a package by its import path only.
    linked = gopath / "src" / GO_MODULE
    linked.parent.mkdir(parents=True, exist_ok=True)
    linked.symlink_to(GO_CLIENT, target_is_directory=True)
    binary = work / "memory.test"
    _run([go, "test", "-c", "-o", str(binary), "./memory"], env, linked, BUILD_SECONDS)
    return Built([str(binary)], env)


def build_typescript(work: Path) -> Built:
    """The package compiled by its tsc into `work`, laid out as installed
    (its package.json, so `@memory-sidecar/client` names itself)."""
    node = shutil.which("node")
    if node is None:
        return Built([], {}, "node not found")
    if not (TS_CLIENT / "node_modules").is_dir():
        return Built([], {}, "clients/typescript has no node_modules: make typescript-client")
    out = work / "typescript"
    out.mkdir()
    shutil.copy(TS_CLIENT / "package.json", out / "package.json")
    (out / "node_modules").symlink_to(TS_CLIENT / "node_modules", target_is_directory=True)
    tsc = str(TS_CLIENT / "node_modules" / "typescript" / "bin" / "tsc")
    tsconfig = str(TS_CLIENT / "tsconfig.json")
    _run(
        [node, tsc, "--project", tsconfig, "--outDir", str(out / "dist")], None, out, BUILD_SECONDS
    )
    return Built([node, str(out / "dist" / "bench" / "turn-overhead.js")], dict(os.environ))


def run_go(built: Built, address: str, agent: str, user: str, message: str, count: int) -> Probe:
    if built.skipped:
        return Probe(skipped=built.skipped)
    env = {
        **built.env,
        "MEMORY_SIDECAR_ADDRESS": address,
        "MEMORY_SIDECAR_BENCH_AGENT": agent,
        "MEMORY_SIDECAR_BENCH_USER": user,
        "MEMORY_SIDECAR_BENCH_MESSAGE": message,
    }
    flags = ["-test.run", "^$", "-test.bench", "^BenchmarkDaemonTurnOverhead$"]
    flags += ["-test.benchtime", f"{count}x", "-test.count", "1"]
    output = _run(built.command + flags, env, GO_CLIENT / "memory", RUN_SECONDS)
    result = GO_RESULT.search(output)
    if result is None:
        raise RuntimeError(f"no benchmark result in:\n{output[-4000:]}")
    metrics = {unit: float(value) for value, unit in re.findall(r"(\S+) (\S+)", result[1])}
    seconds = {unit: value / 1e6 for unit, value in metrics.items() if unit.endswith("-us")}
    # The benchmark fails when a timed turn missed the snapshot.
    return Probe(
        (seconds["stub-p50-us"], seconds["stub-p99-us"]),
        (seconds["client-p50-us"], seconds["client-p99-us"]),
        cached=True,
    )


def run_typescript(
    built: Built, address: str, agent: str, user: str, message: str, count: int
) -> Probe:
    if built.skipped:
        return Probe(skipped=built.skipped)
    command = [*built.command, address, agent, user, message, str(count)]
    answer = json.loads(_run(command, built.env, ROOT, RUN_SECONDS))
    stub, client = answer["stub"], answer["client"]
    return Probe(
        (stub["p50_us"] / 1e6, stub["p99_us"] / 1e6),
        (client["p50_us"] / 1e6, client["p99_us"] / 1e6),
        cached=answer["cached"],
    )
