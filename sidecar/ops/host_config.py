"""`memory-sidecar mcp-config`: an agent host's entry for this sidecar, ready to paste.

An MCP host (Claude Code, Claude Desktop, Cursor) starts a stdio server with
its own environment: its PATH rarely holds the venv, and its working
directory is not the checkout. So the entry names everything absolutely:
the `memory-sidecar` script beside the interpreter running this command (or
that interpreter with `-m sidecar`, and PYTHONPATH, when the package is
importable only from a checkout on PYTHONPATH), the token and CA files,
the configuration file.

    >>> print(render(Entry("cursor", "http", agent_id="coder")))
    {
      "mcpServers": {
        "memory": {
          "url": "http://127.0.0.1:8765/mcp",
          "headers": {
            "X-Memory-Agent-Id": "coder"
          }
        }
      }
    }

Two transports:

- stdio (every host; the only one Claude Desktop's config file takes): the
  bridge `memory-sidecar mcp` with the online commands' --address,
  --token-file and --tls-ca-file, and the scope on its command line. The
  bridge reads the token file itself: the entry holds no secret.
- http (Claude Code, Cursor): the daemon's own MCP listener (`url`), the
  scope in the X-Memory-* headers. A token would have to sit in the host's
  file, so a JSON entry with a token is refused (use stdio); Claude Code's
  `claude mcp add` line reads it with `$(cat FILE)` when it is run.

Owns: the hosts' entry formats, the launcher (absolute command, args, env).
Must not touch: the daemon, RPCs, os.environ (whether the entry needs
PYTHONPATH is found by starting the interpreter isolated, `-I`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import sidecar
from sidecar.core.errors import InvalidArgument

HOSTS = ("claude-code", "claude-desktop", "cursor")
TRANSPORTS = ("stdio", "http")
# The daemon's scope headers (sidecar.api.mcp_http, as hosts spell them).
AGENT_HEADER = "X-Memory-Agent-Id"
USER_HEADER = "X-Memory-User-Id"
# Where `make run` serves MCP.
DEFAULT_URL = "http://127.0.0.1:8765/mcp"


@dataclass(frozen=True, slots=True)
class Launcher:
    """How a host starts `memory-sidecar`, whatever its PATH and directory."""

    command: str
    prefix: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Entry:
    """What the entry says: the host, the transport, the scope, the daemon."""

    host: str
    transport: str = "stdio"
    name: str = "memory"
    agent_id: str = ""
    user_id: str = ""
    address: str = "127.0.0.1:50051"
    url: str = DEFAULT_URL
    token_file: str = ""
    tls_ca_file: str = ""
    config: str = ""
    as_json: bool = False


def _importable_in_isolation(python: str) -> bool:
    """Whether `python`, without PYTHONPATH and outside the checkout (-I),
    imports this very package (an install, editable or not)."""
    probe = "import sidecar, sys; sys.stdout.write(sidecar.__file__ or '')"
    try:
        found = subprocess.run(
            [python, "-I", "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd="/",
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    mine = Path(sidecar.__file__ or "").resolve()
    return bool(found) and Path(found).resolve() == mine


def launcher(python: str = sys.executable) -> Launcher:
    """The running interpreter's `memory-sidecar` script when it runs this
    package; else the interpreter with `-m sidecar` (and PYTHONPATH set to
    the checkout when only PYTHONPATH makes the package importable). The
    interpreter's path is kept as it is: resolving a venv's python symlink
    would leave the venv."""
    python = os.path.abspath(python)
    if _importable_in_isolation(python):
        script = Path(python).parent / "memory-sidecar"
        if script.is_file() and os.access(script, os.X_OK):
            return Launcher(str(script))
        return Launcher(python, ("-m", "sidecar"))
    checkout = str(Path(sidecar.__file__ or "").resolve().parent.parent)
    return Launcher(python, ("-m", "sidecar"), {"PYTHONPATH": checkout})


def reachable_address(address: str) -> str:
    """An address a host can use from any directory: a relative Unix
    socket made absolute, a wildcard host made loopback."""
    if address.startswith("unix:") and not address.startswith("unix:/"):
        return "unix:" + os.path.abspath(address.removeprefix("unix:"))
    if address.startswith("0.0.0.0:"):
        return "127.0.0.1:" + address.rpartition(":")[2]
    return address


def bridge_args(entry: Entry) -> list[str]:
    """The stdio bridge's arguments, every path absolute."""
    args = ["mcp", "--address", reachable_address(entry.address)]
    for flag, value in (("--agent-id", entry.agent_id), ("--user-id", entry.user_id)):
        if value:
            args += [flag, value]
    for flag, path in (
        ("--token-file", entry.token_file),
        ("--tls-ca-file", entry.tls_ca_file),
        ("--config", entry.config),
    ):
        if path:
            args += [flag, os.path.abspath(path)]
    return args


def _headers(entry: Entry) -> dict[str, str]:
    headers = {}
    if entry.agent_id:
        headers[AGENT_HEADER] = entry.agent_id
    if entry.user_id:
        headers[USER_HEADER] = entry.user_id
    return headers


def _stdio_json(entry: Entry, launch: Launcher) -> dict[str, object]:
    server: dict[str, object] = {
        "command": launch.command,
        "args": [*launch.prefix, *bridge_args(entry)],
    }
    if entry.host == "claude-code":
        server = {"type": "stdio", **server}
    if launch.env:
        server["env"] = dict(launch.env)
    return server


def _http_json(entry: Entry) -> dict[str, object]:
    if entry.token_file:
        raise InvalidArgument(
            "an HTTP entry would hold the bearer token itself; the stdio entry reads "
            "--token-file when it starts: leave out --transport http"
        )
    server: dict[str, object] = {"url": entry.url, "headers": _headers(entry)}
    # Claude Code's .mcp.json names the transport; Cursor's mcp.json infers it.
    return {"type": "http", **server} if entry.host == "claude-code" else server


def _quoted(text: str) -> str:
    """A shell word in double quotes, as people write a header; shlex's
    single quotes when the text holds what double quotes would expand."""
    if any(ch in text for ch in '"$`\\!'):
        return shlex.quote(text)
    return f'"{text}"'


def _claude_mcp_add(entry: Entry, launch: Launcher) -> str:
    """The `claude mcp add` command line for Claude Code."""
    if entry.transport == "http":
        words = ["claude", "mcp", "add", "--transport", "http", entry.name, entry.url]
        line = shlex.join(words)
        for name, value in _headers(entry).items():
            line += " --header " + _quoted(f"{name}: {value}")
        if entry.token_file:
            path = shlex.quote(os.path.abspath(entry.token_file))
            line += f' --header "Authorization: Bearer $(cat {path})"'
        return line
    words = ["claude", "mcp", "add"]
    for key, value in launch.env.items():
        words += ["--env", f"{key}={value}"]
    words += [entry.name, "--", launch.command, *launch.prefix, *bridge_args(entry)]
    return shlex.join(words)


def render(entry: Entry, launch: Launcher | None = None) -> str:
    """The text to paste: a JSON entry, or Claude Code's command line."""
    if entry.host not in HOSTS or entry.transport not in TRANSPORTS:
        raise InvalidArgument(f"no entry for host {entry.host!r} over {entry.transport!r}")
    if entry.host == "claude-desktop" and entry.transport == "http":
        raise InvalidArgument(
            "Claude Desktop's claude_desktop_config.json starts stdio servers only "
            "(it skips an entry with a url): leave out --transport http"
        )
    launch = launch or (launcher() if entry.transport == "stdio" else Launcher(""))
    if entry.host == "claude-code" and not entry.as_json:
        return _claude_mcp_add(entry, launch)
    server = _stdio_json(entry, launch) if entry.transport == "stdio" else _http_json(entry)
    return json.dumps({"mcpServers": {entry.name: server}}, indent=2)
