"""What is retried, and how long to wait: the same rules for the sync and
the asyncio client (clients/README.md, "Retries").

UNAVAILABLE is retried with exponential back-off and full jitter, whatever
its reason. Reads, AddMemory (which always carries an idempotency key) and
calls that are idempotent by themselves (an erasure, ending a session)
retry as they are. A write without a key field (UpdateMemory, DeleteMemory,
a writing CallTool) is sent again only when the daemon answered that it
wrote nothing (DATABASE_BUSY, DATABASE_UNAVAILABLE): after a cut it may
have committed.
"""

from __future__ import annotations

import enum
import json
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from memory_sidecar_client.errors import SidecarError

# The tools (and the memory_20250818 command) that only read.
READING_TOOLS = frozenset({"memory_search", "memory_list"})
CLAUDE_MEMORY_TOOL = "memory_20250818"


class Safety(enum.Enum):
    """How freely a call may be sent again."""

    READ = "read"
    IDEMPOTENT = "idempotent"
    WRITE = "write"


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts in all (1: never retry) and the back-off between them: a
    random pause up to first_backoff * multiplier**n, capped at max_backoff."""

    attempts: int = 4
    first_backoff: float = 0.05
    multiplier: float = 2.0
    max_backoff: float = 2.0

    def backoff(self, retry: int, uniform: Callable[[], float] = random.random) -> float:
        """The pause before retry number `retry` (1 for the first)."""
        ceiling = min(self.max_backoff, self.first_backoff * self.multiplier ** (retry - 1))
        return uniform() * ceiling

    def pause(
        self,
        error: SidecarError,
        safety: Safety,
        attempts: int,
        deadline: float | None,
        uniform: Callable[[], float] = random.random,
    ) -> float | None:
        """Seconds to wait before trying again after `attempts` failed, or
        None to give up and raise `error`."""
        if not retryable(error, safety) or attempts >= self.attempts:
            return None
        pause = self.backoff(attempts, uniform)
        if deadline is not None and time.monotonic() + pause >= deadline:
            return None
        return pause


# Reasons for which the daemon says a failed write wrote nothing: a write
# without an idempotency key may be sent again after them, never after a cut.
NOTHING_WRITTEN = frozenset({"DATABASE_BUSY", "DATABASE_UNAVAILABLE"})


def retryable(error: SidecarError, safety: Safety) -> bool:
    if error.code != grpc.StatusCode.UNAVAILABLE:
        return False
    return safety is not Safety.WRITE or error.reason in NOTHING_WRITTEN


def tool_safety(name: str, arguments: Mapping[str, Any]) -> Safety:
    """A tool call that only reads is retried as a read; any other (an
    unknown name included) as a write without a key."""
    if name in READING_TOOLS:
        return Safety.READ
    if name == CLAUDE_MEMORY_TOOL and arguments.get("command") == "view":
        return Safety.READ
    return Safety.WRITE


def tool_arguments(arguments: Mapping[str, Any] | str) -> tuple[str, dict[str, Any]]:
    """The arguments as CallTool takes them (a JSON string) and as a dict.
    A model's arguments arrive as either, depending on the API."""
    if isinstance(arguments, str):
        parsed = json.loads(arguments) if arguments.strip() else {}
        return arguments or "{}", parsed if isinstance(parsed, dict) else {}
    return json.dumps(dict(arguments)), dict(arguments)
