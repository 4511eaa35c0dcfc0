"""The TypeScript client (clients/typescript) against a real daemon: its own
`node --test` suite, its worked agent loop, the README's example of it, and
its generated code checked against the proto."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from google.rpc import status_pb2

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.clients.cut_proxy import cut_proxy
from tests.conftest import CALL_SECONDS, ROOT, START_SECONDS, MakeSidecar, require_tool
from tests.test_readme import block

PACKAGE = ROOT / "clients" / "typescript"
# cut.test.ts's agents: one the export fills past the default budget, and
# one whose cut write this module checks was stored once.
CONFIG = "agents: {ts-bulk: {memory_char_limit: 0}}"
RETRY_AGENT = "ts-retry"


def node_and_packages() -> str:
    """Node's path, once the client's packages are installed."""
    node = require_tool(shutil.which("node"), "Node.js")
    require_tool(
        str(PACKAGE / "node_modules") if (PACKAGE / "node_modules").is_dir() else None,
        "the TypeScript client's package set (`make test` installs it with npm ci)",
    )
    return node


def run(*command: str, cwd: Path = PACKAGE, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        command,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def environment(address: str, **more: str) -> dict[str, str]:
    """The suite's: the daemon's address and each call's deadline."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith("MEMORY_SIDECAR_")}
    deadline = str(int(CALL_SECONDS * 1000))
    return {
        **keep,
        "MEMORY_SIDECAR_ADDRESS": address,
        "MEMORY_SIDECAR_TEST_TIMEOUT_MS": deadline,
        **more,
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package compiled by tsc (strict: the type check) into a directory
    of this worker's own, laid out as installed: its package.json (so that
    `@memory-sidecar/client` names itself), its node_modules and dist/."""
    node = node_and_packages()
    out = tmp_path_factory.mktemp("typescript-client")
    shutil.copy(PACKAGE / "package.json", out / "package.json")
    (out / "node_modules").symlink_to(PACKAGE / "node_modules", target_is_directory=True)
    tsc = str(PACKAGE / "node_modules" / "typescript" / "bin" / "tsc")
    run(node, tsc, "--project", str(PACKAGE / "tsconfig.json"), "--outDir", str(out / "dist"))
    return out


# test/*.test.ts, each run by a node of its own (its own daemon and bound):
# read-your-writes seen by an interceptor, typed errors, paging and the turn
# loop (client); through the cut proxy, a retried write stored once and
# export and watch resumed across a cut (cut); the retry policy against a
# stand-in server (retry).
SUITES = {"client": 0, "cut": 4, "retry": 0}  # each with the cuts it makes


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_the_client_suite_passes_against_a_real_daemon(
    make_sidecar: MakeSidecar, built: Path, suite: str
) -> None:
    node = node_and_packages()
    found = sorted(path.name for path in (built / "dist" / "test").glob("*.test.js"))
    assert found == [f"{name}.test.js" for name in sorted(SUITES)], "a suite nobody runs"
    running = make_sidecar(CONFIG)
    script = str(built / "dist" / "test" / f"{suite}.test.js")
    with cut_proxy(running.addresses.api) as proxy:
        env = environment(running.addresses.api, **proxy.environment())
        output = run(node, "--test", "--test-reporter=spec", script, cwd=built, env=env)
        assert proxy.cuts == SUITES[suite], output
    assert re.search(r"\bfail 0\b", output), output
    if suite == "cut":
        # The write cut after it was stored is there once.
        scope = pb.Scope(agent_id=RETRY_AGENT, user_id=f"{RETRY_AGENT}-user")
        assert [m.content for m in running.list(scope=scope).memories] == ["The build uses uv"]


def test_the_agent_loop_runs_against_a_real_daemon(make_sidecar: MakeSidecar, built: Path) -> None:
    node = node_and_packages()
    running = make_sidecar()
    output = run(
        node, str(built / "dist" / "examples" / "agent-loop.js"), running.addresses.api, cwd=built
    )
    steps = [json.loads(line) for line in output.splitlines()]
    assert steps[0] == {"step": "tools", "names": ["memory", "memory_search", "memory_list"]}
    assert steps[1] == {
        "step": "turn",
        "cache_hit": False,
        "system_block": False,
        "turn_context": False,
    }
    saved = [s for s in steps if s["step"] == "tool" and s["name"] == "memory"]
    assert [(s["is_error"], s["text"].split(" [")[0]) for s in saved] == [
        (False, "Saved to agent notes (target=memory)"),
        (False, "Saved to user profile (target=user)"),
    ]
    replies = [s["text"] for s in steps if s["step"] == "reply"]
    assert replies == ["Noted.", "We deploy to eu-west-1."]
    assert steps[-1] == {"step": "end", "dropped": True}
    listed = running.list(scope=pb.Scope(agent_id="coder", user_id="ada"))
    assert [m.content for m in listed.memories] == [
        "We deploy to eu-west-1",
        "Prefers short answers",
    ]


def test_the_readme_example_type_checks_and_runs(make_sidecar: MakeSidecar, built: Path) -> None:
    # README.md's TypeScript client block, as written: tsc --strict against
    # the built package, then run against a real daemon.
    node = node_and_packages()
    running = make_sidecar()
    code = block("@memory-sidecar/client").text
    example = built / "readme"
    example.mkdir()
    (example / "example.mts").write_text(code.replace("127.0.0.1:50051", running.addresses.api))
    options = {
        "strict": True,
        "module": "nodenext",
        "target": "es2022",
        "types": ["node"],
        "skipLibCheck": True,
    }
    config = {"compilerOptions": options, "files": ["example.mts"]}
    (example / "tsconfig.json").write_text(json.dumps(config))
    tsc = str(PACKAGE / "node_modules" / "typescript" / "bin" / "tsc")
    run(node, tsc, "--project", str(example / "tsconfig.json"), cwd=example)
    output = run(node, str(example / "example.mjs"), cwd=example)
    lines = output.splitlines()
    assert lines[0].startswith("Saved to agent notes (target=memory)"), output
    assert lines[1] == "TIER_BUDGET_EXCEEDED memory 63 2200 2153", output
    listed = running.list(scope=pb.Scope(agent_id="coder", user_id="ada"))
    assert [m.content for m in listed.memories] == [
        "The deploy script lives in ops/deploy.sh",
        "Deploys need the VPN",
    ]


# The one line of the generated files that names the protoc that made them
# (CI's is Debian's): everything else must match byte for byte.
PROTOC_VERSION = re.compile(r"^//   protoc +v.*$", flags=re.M)


def test_the_generated_code_is_what_the_proto_generates(tmp_path: Path) -> None:
    node = node_and_packages()
    require_tool(shutil.which("protoc"), "protoc")
    # google/rpc/*.proto from googleapis-common-protos, the daemon's own
    # dependency (clients/typescript/README.md, "Generated code").
    googleapis = Path(status_pb2.__file__).parents[2]
    run(
        node,
        str(PACKAGE / "scripts" / "generate.mjs"),
        "--out",
        str(tmp_path),
        "--googleapis",
        str(googleapis),
    )
    committed = PACKAGE / "src" / "gen"

    def files(root: Path) -> dict[str, str]:
        return {
            str(path.relative_to(root)): PROTOC_VERSION.sub("", path.read_text())
            for path in sorted(root.rglob("*.ts"))
        }

    fresh, stale = files(tmp_path), files(committed)
    assert sorted(fresh) == sorted(stale), "regenerate: npm run generate (clients/typescript)"
    for name, text in fresh.items():
        assert stale[name] == text, f"src/gen/{name} is stale: npm run generate"


def test_the_turn_overhead_probe_runs_against_a_real_daemon(
    make_sidecar: MakeSidecar, built: Path
) -> None:
    # What `make bench` section 26 runs (bench/client_probes.py), at a size
    # that only shows it builds, answers and reads cached turns.
    node = node_and_packages()
    running = make_sidecar()
    running.add(
        "The deploy script lives in ops/deploy.sh",
        scope=pb.Scope(agent_id="ts-bench", user_id="ts-user"),
    )
    probe = str(built / "dist" / "bench" / "turn-overhead.js")
    output = run(
        node, probe, running.addresses.api, "ts-bench", "ts-user", "deploy?", "20", cwd=built
    )
    figures = json.loads(output)
    assert figures["cached"] is True, output
    for path in ("stub", "client"):
        assert 0 < figures[path]["p50_us"] <= figures[path]["p99_us"], output
