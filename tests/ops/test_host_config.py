"""`memory-sidecar mcp-config`: each host's entry, every path absolute, no
secret in it, and what a host cannot take refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sidecar.api import mcp_http
from sidecar.core.errors import InvalidArgument
from sidecar.ops import cli, host_config
from sidecar.ops.host_config import Entry, Launcher, render

SCRIPT = Launcher("/opt/venv/bin/memory-sidecar")
CHECKOUT = Launcher("/opt/venv/bin/python", ("-m", "sidecar"), {"PYTHONPATH": "/src"})


def server(text: str, name: str = "memory") -> dict[str, object]:
    parsed: dict[str, object] = json.loads(text)["mcpServers"][name]
    return parsed


def test_the_stdio_entry_names_every_path_absolutely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    entry = Entry(
        "claude-desktop",
        agent_id="coder",
        user_id="ada",
        address="unix:run/api.sock",
        token_file="coder.token",
        config="memory.yaml",
    )
    shown = server(render(entry, SCRIPT))
    assert shown == {
        "command": "/opt/venv/bin/memory-sidecar",
        "args": [
            "mcp",
            "--address",
            f"unix:{tmp_path}/run/api.sock",
            "--agent-id",
            "coder",
            "--user-id",
            "ada",
            "--token-file",
            f"{tmp_path}/coder.token",
            "--config",
            f"{tmp_path}/memory.yaml",
        ],
    }
    # From a checkout on PYTHONPATH: the interpreter, and the checkout.
    shown = server(render(Entry("cursor", address="0.0.0.0:50051"), CHECKOUT))
    assert shown == {
        "command": "/opt/venv/bin/python",
        "args": ["-m", "sidecar", "mcp", "--address", "127.0.0.1:50051"],
        "env": {"PYTHONPATH": "/src"},
    }


def test_claude_code_gets_a_command_line_or_its_json(tmp_path: Path) -> None:
    line = render(Entry("claude-code", agent_id="coder", name="mem"), CHECKOUT)
    assert line == (
        "claude mcp add --env PYTHONPATH=/src mem -- /opt/venv/bin/python -m sidecar mcp"
        " --address 127.0.0.1:50051 --agent-id coder"
    )
    assert server(render(Entry("claude-code", as_json=True), SCRIPT))["type"] == "stdio"
    http = server(render(Entry("claude-code", "http", user_id="ada", as_json=True)))
    assert http == {
        "type": "http",
        "url": "http://127.0.0.1:8765/mcp",
        "headers": {"X-Memory-User-Id": "ada"},
    }
    # The token is read when the line is run, never copied into it.
    token = tmp_path / "coder.token"
    token.write_text("s3cret\n")
    line = render(Entry("claude-code", "http", token_file=str(token)))
    assert line.endswith(f' --header "Authorization: Bearer $(cat {token})"')
    assert "s3cret" not in line


def test_what_a_host_cannot_take_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="stdio servers only"):
        render(Entry("claude-desktop", "http"))
    with pytest.raises(InvalidArgument, match="would hold the bearer token"):
        render(Entry("cursor", "http", token_file="/x.token"))


def test_the_headers_are_the_listeners() -> None:
    assert host_config.AGENT_HEADER.lower() == mcp_http.AGENT_HEADER
    assert host_config.USER_HEADER.lower() == mcp_http.USER_HEADER


def test_the_command_uses_the_configuration_and_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "memory.yaml"
    token = tmp_path / "t"
    token.write_text("t")
    config.write_text(
        "server:\n  listen: 127.0.0.1:6001\n  mcp_listen: 0.0.0.0:6002\n"
        f"  auth_token_file: {token}\n"
    )
    argv = ["mcp-config", "--config", str(config), "--host", "cursor"]
    assert cli.main([*argv, "--host", "claude-code", "--transport", "http"], environ={}) == 0
    line = capsys.readouterr().out
    assert " http://127.0.0.1:6002/mcp " in line
    assert f"$(cat {token})" in line
    assert cli.main(argv, environ={}) == 0
    args = server(capsys.readouterr().out)["args"]
    assert isinstance(args, list)
    assert args[args.index("--address") + 1] == "127.0.0.1:6001"
    assert args[-4:] == ["--token-file", str(token), "--config", str(config)]
    refused = ["mcp-config", "--host", "claude-desktop", "--transport", "http"]
    assert cli.main(refused, environ={}) == 1
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith("memory-sidecar: INVALID_ARGUMENT: Claude Desktop's")


def test_the_launcher_is_this_interpreters(tmp_path: Path) -> None:
    # Whichever form fits where this suite runs: absolute, and runnable.
    launch = host_config.launcher()
    assert os.path.isabs(launch.command)
    assert os.access(launch.command, os.X_OK)
    if launch.prefix:
        assert launch.prefix == ("-m", "sidecar")


def test_a_token_file_it_cannot_read_is_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "gone.token")
    argv = ["mcp-config", "--host", "claude-desktop", "--token-file", missing]
    assert cli.main(argv, environ={}) == 0
    out, err = capsys.readouterr()
    args = server(out)["args"]
    assert isinstance(args, list)
    assert args[-2:] == ["--token-file", missing]
    (line,) = err.splitlines()
    assert line.startswith("memory-sidecar: warning: TOKEN_FILE_UNREADABLE: ")
