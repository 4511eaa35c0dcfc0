"""What the sync and the asyncio client share: the scope and token, the
deadlines, the highest generation written (read-your-writes), the requests
each method sends, the resume points of the two streams, and the turn
loop's shapes. Only sending and waiting differ between the two clients.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from memory_sidecar_client._policy import CLAUDE_MEMORY_TOOL, RetryPolicy
from memory_sidecar_client._proto.memory.v1 import memory_pb2 as pb

DEFAULT_TIMEOUT = 10.0
ToolFormat = Literal["openai", "anthropic"]


@dataclass(frozen=True)
class Turn:
    """What to put into the prompt before one model call: the frozen block
    (the system prompt's memory, byte-identical between writes) and the
    turn block (relevant memories the frozen block lacks), with the
    snapshot's generation and digest. `response` is the whole answer."""

    system_block: str
    turn_context: str
    snapshot_generation: int
    snapshot_sha256: str
    cache_hit: bool
    response: pb.InjectForTurnResponse = field(repr=False)


@dataclass(frozen=True)
class ToolResult:
    """A tool call's outcome: `text` goes back to the model (as the tool
    result, marked as an error when `is_error`); `structured` is for the
    runtime; `generation` is the highest its writes took (0: it wrote
    nothing), which the client's next reads wait for (read-your-writes)."""

    text: str
    is_error: bool
    structured: dict[str, Any]
    generation: int = 0


class Core:
    """A client's settings and state, and the requests it sends."""

    def __init__(
        self,
        agent_id: str,
        user_id: str,
        token: str | None,
        timeout: float,
        retry: RetryPolicy,
        read_your_writes: bool,
    ) -> None:
        self.scope = pb.Scope(agent_id=agent_id, user_id=user_id)
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self.timeout = timeout
        self.retry = retry
        self.read_your_writes = read_your_writes
        self._generation = 0
        # Several threads may share one client; the maximum must not go back.
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        """The highest generation a write of this client returned."""
        return self._generation

    def wrote(self, generation: int) -> None:
        with self._lock:
            self._generation = max(self._generation, generation)

    def min_generation(self) -> int:
        return self._generation if self.read_your_writes else 0

    def deadline(self, timeout: float | None, stream: bool = False) -> float | None:
        """When a call must be done by (time.monotonic()): `timeout` seconds
        from now; the client's default for a unary call, none for a stream."""
        if timeout is None:
            if stream:
                return None
            timeout = self.timeout
        return time.monotonic() + timeout

    # --- requests ------------------------------------------------------------

    def add(
        self,
        content: str,
        tier: pb.Tier,
        category: str,
        confidence: float | None,
        idempotency_key: str | None,
        ttl_seconds: int,
        expires_at: datetime | None,
    ) -> pb.AddMemoryRequest:
        request = pb.AddMemoryRequest(
            scope=self.scope,
            tier=tier,
            content=content,
            category=category,
            # Generated when the caller gave none, so that a retry after a
            # cut connection finds the first attempt's entry.
            idempotency_key=idempotency_key or str(uuid.uuid4()),
            ttl_seconds=ttl_seconds,
        )
        if confidence is not None:
            request.confidence = confidence
        if expires_at is not None:
            request.expires_at.FromDatetime(expires_at)
        return request

    def update(
        self, fields: Mapping[str, Any], expires_at: datetime | None
    ) -> pb.UpdateMemoryRequest:
        request = pb.UpdateMemoryRequest(
            scope=self.scope, **{k: v for k, v in fields.items() if v is not None}
        )
        if expires_at is not None:
            request.expires_at.FromDatetime(expires_at)
        return request

    def delete(self, memory_id: str, match: str, tier: pb.Tier) -> pb.DeleteMemoryRequest:
        return pb.DeleteMemoryRequest(scope=self.scope, id=memory_id, match=match, tier=tier)

    def get(
        self,
        tier: pb.Tier,
        category: str,
        page_size: int,
        page_token: str,
        include_expired: bool,
    ) -> pb.GetMemoriesRequest:
        return pb.GetMemoriesRequest(
            scope=self.scope,
            tier=tier,
            category=category,
            page_size=page_size,
            page_token=page_token,
            include_expired=include_expired,
            min_generation=self.min_generation(),
        )

    def search(
        self,
        query: str,
        tier: pb.Tier,
        category: str,
        limit: int,
        match_all: bool,
        page_size: int,
        page_token: str,
    ) -> pb.SearchMemoriesRequest:
        return pb.SearchMemoriesRequest(
            scope=self.scope,
            query=query,
            tier=tier,
            category=category,
            limit=limit,
            match_all=match_all,
            page_size=page_size,
            page_token=page_token,
            min_generation=self.min_generation(),
        )

    def inject(
        self,
        session: str,
        message: str,
        recent_messages: Iterable[str],
        keywords: Iterable[str],
        max_memories: int,
        max_tokens: int,
    ) -> pb.InjectForTurnRequest:
        return pb.InjectForTurnRequest(
            scope=self.scope,
            session_id=session,
            user_message=message,
            recent_messages=list(recent_messages),
            keywords=list(keywords),
            max_memories=max_memories,
            max_tokens=max_tokens,
            min_generation=self.min_generation(),
        )

    def call_tool(self, session: str, name: str, arguments_json: str) -> pb.CallToolRequest:
        return pb.CallToolRequest(
            scope=self.scope, session_id=session, name=name, arguments_json=arguments_json
        )


def turn_of(response: pb.InjectForTurnResponse) -> Turn:
    return Turn(
        response.system_block,
        response.turn_context,
        response.snapshot_generation,
        response.snapshot_sha256,
        response.cache_hit,
        response,
    )


def tool_result(response: pb.CallToolResponse) -> ToolResult:
    structured = json.loads(response.structured_json) if response.structured_json else {}
    return ToolResult(response.text, response.is_error, structured, response.generation)


def tool_name(name: str, arguments: Mapping[str, Any]) -> str:
    """The name CallTool takes. Anthropic's memory tool is declared under
    the name `memory`, as the sidecar's own memory tool is: its calls say
    `command` where the other's say `action`."""
    if name == "memory" and "command" in arguments and "action" not in arguments:
        return CLAUDE_MEMORY_TOOL
    return name


def tool_shapes(
    response: pb.ListToolsResponse, shape: ToolFormat, claude_memory_tool: bool
) -> list[dict[str, Any]]:
    """The tools as a model API takes them: OpenAI's function tools, or
    Anthropic's tools with Claude's memory tool in place of `memory`."""
    if shape == "openai":
        return [json.loads(tool.openai_json) for tool in response.tools]
    if shape != "anthropic":
        raise ValueError(f"tool format {shape!r}: 'openai' or 'anthropic'")
    claude = claude_memory_tool and response.HasField("claude_memory_tool")
    shaped = []
    for tool in response.tools:
        if claude and tool.name == "memory":
            shaped.append(json.loads(response.claude_memory_tool.anthropic_json))
        else:
            shaped.append(json.loads(tool.anthropic_json))
    return shaped


class ExportResume:
    """Where an export stands: the cursor of the last batch received."""

    def __init__(self, request: pb.ExportMemoriesRequest) -> None:
        self._request = request
        self.done = False

    def request(self) -> pb.ExportMemoriesRequest:
        return self._request

    def advance(self, batch: pb.ExportMemoriesResponse) -> None:
        self._request.cursor = batch.cursor
        self.done = batch.done


class WatchResume:
    """Where a watch stands: the last event yielded (its generation, and its
    tier and id when it has one, as a generation may hold several)."""

    def __init__(self, request: pb.WatchMemoriesRequest) -> None:
        self._request = request
        self.done = False

    def request(self) -> pb.WatchMemoriesRequest:
        return self._request

    def advance(self, message: pb.WatchMemoriesResponse) -> None:
        event = message.event
        self._request.after_generation = event.generation
        if event.id:
            self._request.after_tier = event.tier
            self._request.after_id = event.id
        else:
            self._request.ClearField("after_tier")
            self._request.ClearField("after_id")


def remaining(deadline: float | None) -> float | None:
    """The timeout to give one attempt: what is left of the call's deadline."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)
