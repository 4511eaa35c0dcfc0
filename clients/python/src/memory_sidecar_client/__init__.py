"""A client of the memory-sidecar daemon's memory.v1 API.

    from memory_sidecar_client import Client

    with Client("127.0.0.1:50051", agent_id="coder", user_id="ada") as memory:
        memory.add_memory("The repo uses uv, not pip")
        turn = memory.turn("chat-42", "Which package manager?")

`Client` blocks; `AsyncClient` is the same over asyncio. `pb` is the
memory.v1 message module (`pb.TIER_USER`, `pb.Memory`).
"""

from __future__ import annotations

from memory_sidecar_client._core import ToolFormat, ToolResult, Turn
from memory_sidecar_client._policy import RetryPolicy
from memory_sidecar_client._proto.memory.v1 import memory_pb2 as pb
from memory_sidecar_client.aio import AsyncClient
from memory_sidecar_client.client import Client
from memory_sidecar_client.errors import BudgetExceeded, SidecarError

# The proto's package is memory.v1: every release of this client is 1.x.
__version__ = "1.0.0"

__all__ = [
    "AsyncClient",
    "BudgetExceeded",
    "Client",
    "RetryPolicy",
    "SidecarError",
    "ToolFormat",
    "ToolResult",
    "Turn",
    "__version__",
    "pb",
]
