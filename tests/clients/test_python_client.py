"""The Python client (clients/python) against a real daemon on SQLite: its
own suite, run as its users run it (the installed package, not the source
tree, and never the server package), and its worked agent loop."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.clients.cut_proxy import cut_proxy
from tests.conftest import CALL_SECONDS, ROOT, START_SECONDS, Running

CLIENT = ROOT / "clients" / "python"


def client_environment(**extra: str) -> dict[str, str]:
    """The environment of a client process: no PYTHONPATH (the client must
    be installed: `make test` installs it into the venv) and none of the
    developer's MEMORY_SIDECAR_* settings."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "PYTHONPATH" and not key.startswith("MEMORY_SIDECAR_")
    }
    env["MEMORY_SIDECAR_CALL_SECONDS"] = str(CALL_SECONDS)
    return {**env, **extra}


def test_the_clients_own_suite_passes_against_a_daemon(sidecar: Running) -> None:
    with cut_proxy(sidecar.addresses.api) as proxy:
        env = client_environment(
            MEMORY_SIDECAR_ADDRESS=sidecar.addresses.api, **proxy.environment()
        )
        result = subprocess.run(
            # The client's own pytest configuration (clients/python/pyproject.toml);
            # no cache directory written into the source tree.
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
            cwd=CLIENT,
            env=env,
            capture_output=True,
            text=True,
            timeout=START_SECONDS,
            check=False,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    # Every test ran: none skipped for want of the daemon or the proxy.
    assert re.fullmatch(r"\d+ passed in .*", summary), result.stdout


def test_the_worked_agent_loop_runs_against_a_daemon(sidecar: Running) -> None:
    result = subprocess.run(
        [sys.executable, str(CLIENT / "examples" / "agent_loop.py"), sidecar.addresses.api],
        env=client_environment(),
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line) for line in result.stdout.splitlines()]
    assert [s["step"] for s in steps] == [
        "tools",
        "turn",
        "tool",
        "tool",
        "answer",
        "compaction",
        "turn",
        "answer",
        "end",
    ]
    assert steps[0]["names"] == ["memory", "memory_search", "memory_list"]
    # The model's tool calls wrote both tiers, and the next turn's frozen
    # block (after the compaction) shows them; the model answers from it.
    assert [s["is_error"] for s in steps[2:4]] == [False, False]
    assert steps[5]["invalidated"]
    assert "The repo uses uv, not pip" in steps[6]["system_block"]
    assert "Name: Ada" in steps[6]["system_block"]
    assert steps[7]["text"] == "From memory: The repo uses uv, not pip"
    assert steps[8]["dropped"]
    stored = sidecar.list(scope=pb.Scope(agent_id="loop-agent", user_id="ada"))
    assert sorted(m.content for m in stored.memories) == ["Name: Ada", "The repo uses uv, not pip"]


def test_the_client_readme_example_runs(sidecar: Running) -> None:
    readme = (CLIENT / "README.md").read_text()
    (example,) = [
        block
        for block in re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
        if 'with Client("127.0.0.1:50051"' in block
    ]
    code = example.replace("127.0.0.1:50051", sidecar.addresses.api)
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=client_environment(),
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert [line.split(" ", 1)[1] for line in result.stdout.splitlines()] == [
        "The repo uses uv, not pip",
        "Ada prefers short answers",
    ]


def test_the_wheel_carries_typed_stubs_and_needs_only_grpcio_and_protobuf(tmp_path: Path) -> None:
    # Built from a copy, so that setuptools' build directory stays out of the
    # source tree; with the setuptools the dev install has, as in test_proto.
    source = tmp_path / "source"
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=START_SECONDS,
    )
    (wheel,) = tmp_path.glob("memory_sidecar_client-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        headers = Parser().parsestr(archive.read(metadata).decode())
    assert {
        "memory_sidecar_client/py.typed",
        "memory_sidecar_client/_proto/memory/v1/memory_pb2.py",
        "memory_sidecar_client/_proto/memory/v1/memory_pb2.pyi",
        "memory_sidecar_client/_proto/memory/v1/memory_pb2_grpc.py",
    } <= names
    assert not [n for n in names if n.startswith("sidecar/")]
    assert sorted(headers.get_all("Requires-Dist") or []) == ["grpcio>=1.85.1", "protobuf>=7.35.1"]
