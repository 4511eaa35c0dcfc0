"""The client's own suite runs against a real daemon that its caller
started (tests/clients/test_python_client.py, from `make test`):

- MEMORY_SIDECAR_ADDRESS: the daemon's API address;
- MEMORY_SIDECAR_CUT_TARGET: the same daemon through a proxy that cuts a
  connection on cue; MEMORY_SIDECAR_CUT_CONTROL: its control socket.

Without them the tests that need a daemon are skipped; the others run.
Each test works in a scope of its own, so tests never see each other's
entries in the one shared daemon.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from client_testing import CALL_SECONDS, Cuts, environment
from memory_sidecar_client import Client


@pytest.fixture
def address() -> str:
    return environment("MEMORY_SIDECAR_ADDRESS")


@pytest.fixture
def cuts() -> Iterator[Cuts]:
    control = Cuts(
        environment("MEMORY_SIDECAR_CUT_CONTROL"), environment("MEMORY_SIDECAR_CUT_TARGET")
    )
    yield control
    control.close()


@pytest.fixture
def scope() -> tuple[str, str]:
    """(agent_id, user_id) no other test uses."""
    unique = uuid.uuid4().hex[:12]
    return f"agent-{unique}", f"user-{unique}"


@pytest.fixture
def client(address: str, scope: tuple[str, str]) -> Iterator[Client]:
    with Client(address, agent_id=scope[0], user_id=scope[1], timeout=CALL_SECONDS) as made:
        yield made
