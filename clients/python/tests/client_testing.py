"""What the client's tests share: the wait bound, the cut proxy's control
socket and an AsyncClient maker (conftest.py holds the fixtures)."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
from memory_sidecar_client import AsyncClient

# A bound on every wait (the caller scales it on slow machines); never a
# timing claim.
CALL_SECONDS = float(os.environ.get("MEMORY_SIDECAR_CALL_SECONDS") or 60)


def environment(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        pytest.skip(f"{name} is not set: run through tests/clients/test_python_client.py")
    return value


class Cuts:
    """The cut proxy's control socket: `arm headers 1`, `arm data 1`, `cuts`."""

    def __init__(self, control: str, target: str) -> None:
        host, _, port = control.rpartition(":")
        self.target = target
        self._socket = socket.create_connection((host, int(port)), timeout=CALL_SECONDS)
        self._lines = self._socket.makefile("rw", encoding="ascii", newline="\n")

    def _ask(self, command: str) -> str:
        self._lines.write(command + "\n")
        self._lines.flush()
        return self._lines.readline().strip()

    def arm(self, kind: str, count: int = 1) -> None:
        assert self._ask(f"arm {kind} {count}") == "ok"

    def count(self) -> int:
        return int(self._ask("cuts"))

    def close(self) -> None:
        self._ask("disarm")
        self._lines.close()
        self._socket.close()


def async_client(target: str, scope: tuple[str, str], **options: Any) -> AsyncClient:
    """An AsyncClient for a test's coroutine (each test runs its own event
    loop with asyncio.run: no plugin needed)."""
    return AsyncClient(target, agent_id=scope[0], user_id=scope[1], timeout=CALL_SECONDS, **options)
