"""`AsyncClient`: `Client` over asyncio (grpc.aio), method for method.

The requests, the retry policy, the error decoding and the tool shapes come
from the same modules as the sync client's; only sending and waiting differ.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any

import grpc
from google.protobuf.message import Message

from memory_sidecar_client._core import (
    DEFAULT_TIMEOUT,
    Core,
    ExportResume,
    ToolFormat,
    ToolResult,
    Turn,
    WatchResume,
    remaining,
    tool_name,
    tool_result,
    tool_shapes,
    turn_of,
)
from memory_sidecar_client._policy import RetryPolicy, Safety, tool_arguments, tool_safety
from memory_sidecar_client._proto.memory.v1 import memory_pb2 as pb
from memory_sidecar_client._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from memory_sidecar_client.errors import from_rpc_error

_MEMORY, _BOTH = pb.TIER_MEMORY, pb.TIER_UNSPECIFIED


class AsyncClient:
    """The memory.v1 API in one scope (`agent_id`, `user_id`), over asyncio.

    `target` is the daemon's address (`127.0.0.1:50051`, `unix:/path`);
    `token` is sent as a bearer token on every call; `timeout` is each unary
    call's deadline in seconds (retries included), unless a call gives its
    own; streams have none unless given. `credentials` makes a TLS channel;
    `channel` uses one of the caller's instead (it is not closed here).
    `read_your_writes=False` stops sending `min_generation`.
    """

    def __init__(
        self,
        target: str = "",
        *,
        agent_id: str = "",
        user_id: str = "",
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        read_your_writes: bool = True,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self._core = Core(
            agent_id, user_id, token, timeout, retry or RetryPolicy(), read_your_writes
        )
        self._owned = channel is None
        if channel is None:
            if credentials is None:
                channel = grpc.aio.insecure_channel(target, options=options)
            else:
                channel = grpc.aio.secure_channel(target, credentials, options=options)
        self.channel = channel
        self._stub = pb_grpc.MemoryServiceStub(channel)

    @property
    def scope(self) -> pb.Scope:
        return self._core.scope

    @property
    def generation(self) -> int:
        """The highest generation a write of this client returned: what its
        reads wait for (read-your-writes)."""
        return self._core.generation

    async def close(self) -> None:
        if self._owned:
            await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    # --- memories ------------------------------------------------------------

    async def add_memory(
        self,
        content: str,
        *,
        tier: pb.Tier = _MEMORY,
        category: str = "",
        confidence: float | None = None,
        idempotency_key: str | None = None,
        ttl_seconds: int = 0,
        expires_at: datetime | None = None,
        timeout: float | None = None,
    ) -> pb.AddMemoryResponse:
        """Store an entry. Without `idempotency_key` one is generated, so a
        retry never stores it twice."""
        request = self._core.add(
            content, tier, category, confidence, idempotency_key, ttl_seconds, expires_at
        )
        response: pb.AddMemoryResponse = await self._call(
            "AddMemory", request, Safety.IDEMPOTENT, timeout
        )
        self._core.wrote(response.generation)
        return response

    async def update_memory(
        self,
        id: str = "",  # the proto names it so
        *,
        match: str = "",
        tier: pb.Tier = _BOTH,
        content: str | None = None,
        category: str | None = None,
        confidence: float | None = None,
        ttl_seconds: int = 0,
        expires_at: datetime | None = None,
        clear_expiry: bool = False,
        timeout: float | None = None,
    ) -> pb.UpdateMemoryResponse:
        """Change the given fields of the entry named by `id` or `match`."""
        fields = {
            "id": id,
            "match": match,
            "tier": tier,
            "content": content,
            "category": category,
            "confidence": confidence,
            "ttl_seconds": ttl_seconds,
            "clear_expiry": clear_expiry,
        }
        request = self._core.update(fields, expires_at)
        response: pb.UpdateMemoryResponse = await self._call(
            "UpdateMemory", request, Safety.WRITE, timeout
        )
        self._core.wrote(response.generation)
        return response

    async def delete_memory(
        self,
        id: str = "",  # the proto names it so
        *,
        match: str = "",
        tier: pb.Tier = _BOTH,
        timeout: float | None = None,
    ) -> pb.DeleteMemoryResponse:
        """Remove the entry named by `id` or `match`."""
        request = self._core.delete(id, match, tier)
        response: pb.DeleteMemoryResponse = await self._call(
            "DeleteMemory", request, Safety.WRITE, timeout
        )
        self._core.wrote(response.generation)
        return response

    async def get_memories(
        self,
        *,
        tier: pb.Tier = _BOTH,
        category: str = "",
        page_size: int = 0,
        page_token: str = "",
        include_expired: bool = False,
        timeout: float | None = None,
    ) -> pb.GetMemoriesResponse:
        """One page of entries, with each tier's usage."""
        request = self._core.get(tier, category, page_size, page_token, include_expired)
        response: pb.GetMemoriesResponse = await self._call(
            "GetMemories", request, Safety.READ, timeout
        )
        return response

    async def list_memories(
        self,
        *,
        tier: pb.Tier = _BOTH,
        category: str = "",
        page_size: int = 0,
        include_expired: bool = False,
        timeout: float | None = None,
    ) -> AsyncGenerator[pb.Memory, None]:
        """Every entry, page after page (each page a call of its own)."""
        request = self._core.get(tier, category, page_size, "", include_expired)
        while True:
            page: pb.GetMemoriesResponse = await self._call(
                "GetMemories", request, Safety.READ, timeout
            )
            for memory in page.memories:
                yield memory
            if not page.next_page_token:
                return
            request.page_token = page.next_page_token

    async def search_memories(
        self,
        query: str,
        *,
        tier: pb.Tier = _BOTH,
        category: str = "",
        limit: int = 0,
        match_all: bool = False,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> pb.SearchMemoriesResponse:
        """One page of hits, best first."""
        request = self._core.search(query, tier, category, limit, match_all, page_size, page_token)
        response: pb.SearchMemoriesResponse = await self._call(
            "SearchMemories", request, Safety.READ, timeout
        )
        return response

    async def search_hits(
        self,
        query: str,
        *,
        tier: pb.Tier = _BOTH,
        category: str = "",
        limit: int = 0,
        match_all: bool = False,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> AsyncGenerator[pb.SearchHit, None]:
        """Every hit (up to `limit`), page after page."""
        request = self._core.search(query, tier, category, limit, match_all, page_size, "")
        while True:
            page: pb.SearchMemoriesResponse = await self._call(
                "SearchMemories", request, Safety.READ, timeout
            )
            for hit in page.hits:
                yield hit
            if not page.next_page_token:
                return
            request.page_token = page.next_page_token

    async def export_memories(
        self,
        *,
        tier: pb.Tier = _BOTH,
        for_user: bool = False,
        batch_size: int = 0,
        cursor: str = "",
        timeout: float | None = None,
    ) -> AsyncGenerator[pb.ExportMemoriesResponse, None]:
        """The scope's entries as batches of JSONL lines; after a cut it
        resumes from the last batch's cursor, so no line comes twice."""
        request = pb.ExportMemoriesRequest(
            scope=self._core.scope,
            tier=tier,
            for_user=for_user,
            batch_size=batch_size,
            cursor=cursor,
        )
        async for batch in self._stream("ExportMemories", ExportResume(request), timeout):
            yield batch

    async def watch_memories(
        self,
        *,
        tier: pb.Tier = _BOTH,
        after_generation: int = 0,
        after_tier: pb.Tier = _BOTH,
        after_id: str = "",
        timeout: float | None = None,
    ) -> AsyncGenerator[pb.MemoryEvent, None]:
        """The scope's changes as they happen (from `after_generation` on;
        0: from now, after a SYNC event). After a cut it resumes after the
        last event yielded: none is missed or repeated."""
        request = pb.WatchMemoriesRequest(
            scope=self._core.scope,
            tier=tier,
            after_generation=after_generation,
            after_tier=after_tier,
            after_id=after_id,
        )
        async for message in self._stream("WatchMemories", WatchResume(request), timeout):
            yield message.event

    async def forget_user(
        self,
        user_id: str,
        *,
        erase_agent_notes_written_for_user: bool = False,
        timeout: float | None = None,
    ) -> pb.ForgetUserResponse:
        """Erase everything stored for `user_id` (a token granted `erase`)."""
        request = pb.ForgetUserRequest(
            user_id=user_id,
            erase_agent_notes_written_for_user=erase_agent_notes_written_for_user,
        )
        response: pb.ForgetUserResponse = await self._call(
            "ForgetUser", request, Safety.IDEMPOTENT, timeout
        )
        self._core.wrote(response.erasure.generation)
        return response

    async def delete_scope(
        self, *, tier: pb.Tier = _BOTH, timeout: float | None = None
    ) -> pb.DeleteScopeResponse:
        """Erase this scope's tiers, or one of them (a token granted `erase`)."""
        request = pb.DeleteScopeRequest(scope=self._core.scope, tier=tier)
        response: pb.DeleteScopeResponse = await self._call(
            "DeleteScope", request, Safety.IDEMPOTENT, timeout
        )
        self._core.wrote(response.erasure.generation)
        return response

    # --- the turn loop -------------------------------------------------------

    async def turn(
        self,
        session: str,
        message: str,
        *,
        recent_messages: Iterable[str] = (),
        keywords: Iterable[str] = (),
        max_memories: int = 0,
        max_tokens: int = 0,
        timeout: float | None = None,
    ) -> Turn:
        """What to inject before the model call answering `message`."""
        request = self._core.inject(
            session, message, recent_messages, keywords, max_memories, max_tokens
        )
        response: pb.InjectForTurnResponse = await self._call(
            "InjectForTurn", request, Safety.READ, timeout
        )
        return turn_of(response)

    async def list_tools(self, *, timeout: float | None = None) -> pb.ListToolsResponse:
        request = pb.ListToolsRequest(scope=self._core.scope)
        response: pb.ListToolsResponse = await self._call(
            "ListTools", request, Safety.READ, timeout
        )
        return response

    async def tools(
        self,
        format: ToolFormat = "openai",
        *,
        claude_memory_tool: bool = True,
        timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        """The memory tools to declare to a model API: "openai" (function
        tools) or "anthropic" (with Claude's memory_20250818 in place of the
        memory tool, unless `claude_memory_tool=False`)."""
        return tool_shapes(await self.list_tools(timeout=timeout), format, claude_memory_tool)

    async def call_tool(
        self,
        session: str,
        name: str,
        arguments: Mapping[str, Any] | str,
        *,
        timeout: float | None = None,
    ) -> ToolResult:
        """Run one tool call of the model; `text` is the tool result to hand
        back. Arguments as the model API gave them (a dict or JSON text)."""
        arguments_json, parsed = tool_arguments(arguments)
        name = tool_name(name, parsed)
        request = self._core.call_tool(session, name, arguments_json)
        safety = tool_safety(name, parsed)
        response: pb.CallToolResponse = await self._call("CallTool", request, safety, timeout)
        # A writing tool's generation counts as AddMemory's (0: it wrote nothing).
        self._core.wrote(response.generation)
        return tool_result(response)

    async def notify_compaction(
        self, session: str, *, timeout: float | None = None
    ) -> pb.NotifyCompactionResponse:
        """The runtime compacted the session's context: its frozen block may be rebuilt."""
        request = pb.NotifyCompactionRequest(session_id=session, scope=self._core.scope)
        response: pb.NotifyCompactionResponse = await self._call(
            "NotifyCompaction", request, Safety.IDEMPOTENT, timeout
        )
        return response

    async def end_session(
        self, session: str, *, timeout: float | None = None
    ) -> pb.EndSessionResponse:
        """The session ended: its snapshot is dropped."""
        request = pb.EndSessionRequest(session_id=session, scope=self._core.scope)
        response: pb.EndSessionResponse = await self._call(
            "EndSession", request, Safety.IDEMPOTENT, timeout
        )
        return response

    # --- sending -------------------------------------------------------------

    async def _call(
        self, method: str, request: Message, safety: Safety, timeout: float | None
    ) -> Any:
        """One unary call, retried as the policy says within one deadline."""
        send = getattr(self._stub, method)
        core = self._core
        deadline = core.deadline(timeout)
        attempts = 0
        while True:
            attempts += 1
            try:
                # A retry waits for the channel to reconnect, within the deadline.
                return await send(
                    request,
                    timeout=remaining(deadline),
                    metadata=core.metadata,
                    wait_for_ready=attempts > 1 or None,
                )
            except grpc.RpcError as raw:
                error = from_rpc_error(raw)
                pause = core.retry.pause(error, safety, attempts, deadline)
                if pause is None:
                    raise error from raw
            await asyncio.sleep(pause)

    async def _stream(
        self, method: str, resume: ExportResume | WatchResume, timeout: float | None
    ) -> AsyncGenerator[Any, None]:
        """A server stream, opened again from its resume point after a cut
        (attempts count failures since the last message received)."""
        send = getattr(self._stub, method)
        deadline = self._core.deadline(timeout, stream=True)
        failures = 0
        while not resume.done:
            call = send(
                resume.request(),
                timeout=remaining(deadline),
                metadata=self._core.metadata,
                wait_for_ready=failures > 0 or None,
            )
            try:
                async for message in call:
                    failures = 0
                    resume.advance(message)
                    yield message
                return
            except grpc.RpcError as raw:
                error = from_rpc_error(raw)
                failures += 1
                pause = self._core.retry.pause(error, Safety.READ, failures, deadline)
                if pause is None:
                    raise error from raw
            finally:
                call.cancel()
            await asyncio.sleep(pause)
