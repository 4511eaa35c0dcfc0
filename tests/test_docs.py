"""What the docs show works as shown."""

from __future__ import annotations

import doctest
import importlib
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.api.access import TokensFile
from sidecar.config import settings
from sidecar.core.memory import Scope
from sidecar.core.metrics import Metrics
from sidecar.domain.engine import MemoryEngine
from sidecar.domain.tools import Tools
from sidecar.storage.store import Store
from tests.conftest import (
    ROOT,
    START_SECONDS,
    Running,
)


def test_readme_client_example_runs(sidecar: Running) -> None:
    readme = (ROOT / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert 'ADDRESS = "127.0.0.1:50051"' in example
    code = example.replace("127.0.0.1:50051", sidecar.addresses.api)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("TIER_MEMORY ")
    assert lines[0].endswith(" The repo uses uv, not pip")
    assert lines[1].endswith(" Ada prefers short answers")
    assert lines[2:4] == ["TIER_MEMORY 25/2200 chars", "TIER_USER 25/1375 chars"]
    assert lines[5] == "MEMORY (agent notes) [1% — 25/2,200 chars]"
    assert "Ada prefers short answers" in lines
    # As the README says: the frozen block shows every memory, the
    # transient block repeats none.
    assert lines[-2] == "''"
    # "Long notes " * 199, stripped: 2,188 characters and the separator.
    assert lines[-1] == "TIER_BUDGET_EXCEEDED 25 2200 2191"


def test_example_config_is_valid_and_states_the_defaults() -> None:
    example = settings.load(ROOT / "deploy" / "config.example.yaml", environ={})
    assert example == settings.Config()


def test_readme_names_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme
    assert "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_make_run_installs_the_daemon_without_the_dev_tools(tmp_path: Path) -> None:
    # A dry run against a venv that does not exist yet: what a fresh machine
    # would do.
    planned = subprocess.run(
        ["make", "-n", "run", f"VENV={tmp_path}/venv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installs = [line for line in planned.splitlines() if "pip install" in line and " -e " in line]
    assert installs == [f"{tmp_path}/venv/bin/python -m pip install --quiet -e '.[postgres,mcp]'"]
    assert "memory-sidecar serve" in planned
    # With its MCP listener on loopback by default, and none with MCP_LISTEN=.
    assert "--mcp-listen 127.0.0.1:8765" in planned
    none = subprocess.run(
        ["make", "-n", "run", f"VENV={tmp_path}/venv", "MCP_LISTEN="],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "memory-sidecar serve" in none
    assert "--mcp-listen" not in none


def _planned(target: str, tmp_path: Path) -> str:
    """What `make -n TARGET` would run on a fresh machine (no venv, no buf)."""
    return subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path}/venv", "BUF=" + str(tmp_path / "no-buf")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_make_test_does_not_install_the_lint_tools(tmp_path: Path) -> None:
    # buf (93 MB from npm) serves `make lint` only.
    planned = _planned("test", tmp_path)
    assert "@bufbuild/buf" not in planned
    assert "-m pytest" in planned
    assert "@bufbuild/buf" in _planned("lint", tmp_path)


# --- the `>>>` examples in sidecar/ -------------------------------------------


def _modules_with_examples() -> list[str]:
    """Every sidecar module whose source shows a `>>>` example."""
    return [
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in sorted((ROOT / "sidecar").rglob("*.py"))
        if "_proto" not in path.parts and ">>>" in path.read_text()
    ]


@pytest.fixture
def example_globals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """What the examples use without making it, as real as the daemon's: a
    config listening on free ports, an open store and an engine over it, a
    scope, a tokens file (tokens.yaml, giving "token-of-agent-a" to
    agent-a), a listening socket. Run in a directory of their own, so a file
    an example names lands there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent-a.token").write_text("token-of-agent-a\n")
    (tmp_path / "tokens.yaml").write_text(
        "tokens: [{token_file: agent-a.token, agents: [agent-a], users: ['*']}]\n"
    )
    db = str(tmp_path / "daemon.db")
    flags = {"db": db, "listen": "127.0.0.1:0", "mcp_listen": "127.0.0.1:0"}
    config = settings.load(None, environ={}, flags=flags)
    metrics = Metrics(CollectorRegistry())
    store = Store(db)
    store.open()
    engine = MemoryEngine(config, store, metrics=metrics)
    sock = socket.create_server(("127.0.0.1", 0))
    try:
        yield {
            "config": config,
            "metrics": metrics,
            "store": store,
            "engine": engine,
            "tools": Tools(engine, config.server.limits()),
            "scope": Scope("coder", "ada"),
            "tokens": TokensFile("tokens.yaml"),
            "sock": sock,
        }
    finally:
        sock.close()
        assert engine.stop_indexing(30)
        store.close()


def test_sidecar_has_docstring_examples() -> None:
    assert _modules_with_examples()


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run_as_shown(name: str, example_globals: dict[str, Any]) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, extraglobs=example_globals, optionflags=doctest.ELLIPSIS, report=False
    )
    assert result.attempted, f"{name} shows a `>>>` that is not in a docstring doctest finds"
    assert result.failed == 0, f"{name}: the example's output is above"
