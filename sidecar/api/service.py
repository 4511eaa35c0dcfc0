"""MemoryService over gRPC: validate the request, call the engine, render.

One handler per RPC of memory.v1.MemoryService. Each resolves its scope first
(`_scope`): the one place a per-agent token's grant is enforced.

Errors are raised as SidecarErrors and turned into statuses by
sidecar.api.interceptors; nothing here builds a status itself.

Owns: the protobuf mapping (tiers, timestamps, strategies, counters), request
checks (limits, scope and grant), paging, and a cache of prebuilt frozen
answers. Must not touch: the store, partitions, snapshots or sessions (only
MemoryEngine), statuses, grpc itself (it subclasses the generated servicer).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.api import access, erasure, paging, replication, watch
from sidecar.api.export import ExportStream
from sidecar.config.settings import AgentSettings
from sidecar.core import tokens
from sidecar.core.caches import LRU
from sidecar.core.errors import InvalidArgument, Reason
from sidecar.core.limits import Limits, checked, counted
from sidecar.core.memory import Memory, Scope, Tier, Usage, check_confidence, clean_content
from sidecar.domain.engine import MemoryEngine
from sidecar.domain.expiry import Requested
from sidecar.domain.tool_definitions import ToolDef
from sidecar.domain.tools import Tools, arguments_of
from sidecar.domain.turns import Injection
from sidecar.storage.writes import Edit, NewEntry

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MemoryService"].full_name

_TIER_TO_PB = {Tier.MEMORY: pb.TIER_MEMORY, Tier.USER: pb.TIER_USER}
_PB_TO_TIER: dict[int, Tier] = {int(v): k for k, v in _TIER_TO_PB.items()}
DEFAULT_SEARCH_LIMIT = 20
MAX_SEARCH_LIMIT = 1000
FROZEN_CACHE_SIZE = 4096
# GetMemories' largest page (and its default): AIP-158's usual 1000.
MAX_PAGE_SIZE = 1000


def _tier_number(value: int) -> int:
    if value != pb.TIER_UNSPECIFIED and value not in _PB_TO_TIER:
        raise InvalidArgument(
            f"unknown tier {value}; use TIER_MEMORY (1) or TIER_USER (2)",
            reason=Reason.TIER_UNKNOWN,
            metadata={"tier": value},
        )
    return value


def write_tier(value: int) -> Tier:
    """A write's tier: unspecified means agent notes (seed 003's default)."""
    number = _tier_number(value)
    return _PB_TO_TIER.get(number, Tier.MEMORY)


def read_tiers(value: int) -> tuple[Tier, ...]:
    """A read's tiers: unspecified means both."""
    number = _tier_number(value)
    return (_PB_TO_TIER[number],) if number in _PB_TO_TIER else tuple(Tier)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _timestamp(moment: datetime) -> Timestamp:
    """Timestamp.FromDatetime's value (naive taken as UTC), from the
    difference to the epoch: about 1 µs against FromDatetime's 5 µs (its
    time tuple and timegm), two or three per entry answered."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    since = moment - _EPOCH
    return Timestamp(seconds=since.days * 86400 + since.seconds, nanos=since.microseconds * 1000)


def memory_pb(memory: Memory) -> pb.Memory:
    return pb.Memory(
        id=memory.id,
        tier=_TIER_TO_PB[memory.tier],
        content=memory.content,
        category=memory.category,
        confidence=memory.confidence,
        created_at=_timestamp(memory.created_at),
        updated_at=_timestamp(memory.updated_at),
        expires_at=_timestamp(memory.expires_at) if memory.expires_at else None,
    )


def requested_expiry(request: pb.AddMemoryRequest | pb.UpdateMemoryRequest) -> Requested:
    """The expiry fields a write sets (sidecar.domain.expiry checks them)."""
    at = None
    if request.HasField("expires_at"):
        try:
            at = request.expires_at.ToDatetime(tzinfo=UTC)
        except (ValueError, OverflowError):
            raise InvalidArgument(
                "expires_at is not a valid timestamp",
                reason=Reason.EXPIRES_AT_INVALID,
                metadata={"field": "expires_at"},
            ) from None
    clear = isinstance(request, pb.UpdateMemoryRequest) and request.clear_expiry
    return Requested(at, request.ttl_seconds, clear)


def usage_pb(tier: Tier, usage: Usage, settings: AgentSettings) -> pb.TierUsage:
    policy = settings.policy(tier)
    return pb.TierUsage(
        tier=_TIER_TO_PB[tier],
        used_chars=usage.used_chars,
        limit_chars=policy.limit_chars,
        entry_count=usage.entry_count,
        enabled=policy.enabled,
    )


# A turn's usage repeats until the next write: keep recent messages around
# (protobuf copies them into each response).
_usage_pb_cached = functools.lru_cache(maxsize=1024)(usage_pb)


def _tool_pb(tool: ToolDef) -> pb.Tool:
    return pb.Tool(
        name=tool.name,
        description=tool.description,
        input_schema_json=json.dumps(tool.input_schema),
        openai_json=json.dumps(tool.openai()),
        anthropic_json=json.dumps(tool.anthropic()),
    )


_STRATEGIES = {
    pb.KEYWORD_STRATEGY_UNSPECIFIED: "",
    pb.KEYWORD_STRATEGY_LOCAL: "local",
    pb.KEYWORD_STRATEGY_LLM: "llm",
}
_COUNTERS = {
    tokens.TIKTOKEN: pb.TOKEN_COUNTER_TIKTOKEN_CL100K_BASE,
    tokens.CHARS_DIV_4: pb.TOKEN_COUNTER_CHARS_DIV_4,
}
MAX_INJECT_MEMORIES = 1000
MAX_INJECT_TOKENS = 1_000_000


def _bounded(name: str, value: int, maximum: int) -> int:
    if not 0 <= value <= maximum:
        raise InvalidArgument(
            f"{name} must be between 0 and {maximum:,}, got {value}",
            reason=Reason(f"{name.upper()}_OUT_OF_RANGE"),
            metadata={name: value, "max": maximum},
        )
    return value


def _still_wanted(context: Any) -> Callable[[], bool]:
    """Whether the caller still waits: not cancelled, deadline not passed."""

    def wanted() -> bool:
        remaining = context.time_remaining()
        return bool(context.is_active()) and (remaining is None or remaining > 0)

    return wanted


class FrozenAnswers(LRU[tuple[object, ...], pb.InjectForTurnResponse]):
    """The frozen half of InjectForTurn answers, by what they hold: views
    that render the same (every empty scope's, say) share one message, which
    costs about a kilobyte. They hold rendered content: `clear` is one of the
    engine's erasure listeners (MemoryEngine's `on_erasure`), so none
    outlives an erasure."""

    def __init__(self) -> None:
        super().__init__(FROZEN_CACHE_SIZE)

    def clear(self) -> None:
        self.expire(math.inf)


class MemoryService(pb_grpc.MemoryServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        engine: MemoryEngine,
        limits: Limits,
        pages: paging.PageTokens,
        frozen: FrozenAnswers,
    ) -> None:
        """`frozen`: the cache the engine empties on every erasure."""
        self._engine = engine
        self._limits = limits
        self._pages = pages
        self._tools = Tools(engine, limits)
        self._frozen = frozen
        self._export = ExportStream(engine, limits, read_tiers, pages)

    # --- request fields -----------------------------------------------------

    def _scope(self, message: pb.Scope) -> Scope:
        """The request's scope, valid and one the caller's token may address.

        Every RPC names its scope through here first, before it reads or
        writes anything: the one place per-agent tokens are enforced.
        """
        limit = self._limits.id_chars
        scope = Scope(
            agent_id=checked("scope.agent_id", message.agent_id, limit),
            user_id=checked("scope.user_id", message.user_id, limit),
        )
        access.authorize(scope)
        return scope

    def _id(self, field: str, value: str, what: str) -> str:
        if not value:
            reason = Reason.SESSION_ID_EMPTY if field == "session_id" else Reason.ID_EMPTY
            raise InvalidArgument(f"{field} is empty; name the {what}", reason=reason)
        return checked(field, value, self._limits.id_chars)

    def _target(
        self, request: pb.UpdateMemoryRequest | pb.DeleteMemoryRequest, what: str
    ) -> tuple[str, str, Tier]:
        """The entry an update or delete names: (id, "", tier) or ("", match,
        tier). Exactly one of id and match must be set; the tier (unspecified:
        agent notes) is where a match is looked for."""
        tier = write_tier(request.tier)
        if not request.match:
            if not request.id:
                raise InvalidArgument(
                    f"id and match are both empty; name the {what} by its id, or by text "
                    "that occurs in its content (match)",
                    reason=Reason.ID_EMPTY,
                )
            return self._id("id", request.id, what), "", tier
        if request.id:
            raise InvalidArgument(
                f"both id and match are set; name the {what} by one of them",
                reason=Reason.ID_AND_MATCH,
                metadata={"field": "match"},
            )
        match = checked("match", request.match, self._limits.content_chars, multiline=True)
        if not match.strip():
            raise InvalidArgument(
                "match holds only whitespace; quote text that occurs in the entry's content",
                reason=Reason.MATCH_EMPTY,
                metadata={"field": "match"},
            )
        return "", match, tier

    def _content(self, value: str) -> str:
        return clean_content(checked("content", value, self._limits.content_chars, multiline=True))

    def _category(self, value: str) -> str:
        return checked("category", value, self._limits.category_chars)

    # --- RPCs ---------------------------------------------------------------

    def AddMemory(self, request: pb.AddMemoryRequest, context: Any) -> pb.AddMemoryResponse:
        scope = self._scope(request.scope)
        tier = write_tier(request.tier)
        content = self._content(request.content)
        category = self._category(request.category)
        confidence = check_confidence(request.confidence) if request.HasField("confidence") else 1.0
        key = checked("idempotency_key", request.idempotency_key, self._limits.id_chars)
        added = self._engine.add(
            NewEntry(scope, tier, content, category, confidence, idempotency_key=key),
            expiry=requested_expiry(request),
            still_wanted=_still_wanted(context),
        )
        return pb.AddMemoryResponse(
            memory=memory_pb(added.memory),
            usage=usage_pb(tier, added.usage, self._engine.settings(scope)),
            created=added.created,
            generation=added.generation,
            similar=[
                pb.SimilarMemory(memory=memory_pb(s.memory), score=s.score) for s in added.similar
            ],
        )

    def UpdateMemory(
        self, request: pb.UpdateMemoryRequest, context: Any
    ) -> pb.UpdateMemoryResponse:
        scope = self._scope(request.scope)
        memory_id, match, tier = self._target(request, "memory to change")
        content = self._content(request.content) if request.HasField("content") else None
        confidence = (
            check_confidence(request.confidence) if request.HasField("confidence") else None
        )
        category = self._category(request.category) if request.HasField("category") else None
        edit = Edit(
            scope,
            memory_id,
            match=match,
            tier=tier,
            content=content,
            category=category,
            confidence=confidence,
        )
        memory, usage, generation = self._engine.update(
            edit, expiry=requested_expiry(request), still_wanted=_still_wanted(context)
        )
        return pb.UpdateMemoryResponse(
            memory=memory_pb(memory),
            usage=usage_pb(memory.tier, usage, self._engine.settings(scope)),
            generation=generation,
        )

    def DeleteMemory(
        self, request: pb.DeleteMemoryRequest, context: Any
    ) -> pb.DeleteMemoryResponse:
        scope = self._scope(request.scope)
        memory_id, match, tier = self._target(request, "memory to delete")
        memory, usage, generation = self._engine.delete(
            scope, memory_id, still_wanted=_still_wanted(context), match=match, tier=tier
        )
        return pb.DeleteMemoryResponse(
            memory=memory_pb(memory),
            usage=usage_pb(memory.tier, usage, self._engine.settings(scope)),
            generation=generation,
        )

    def GetMemories(self, request: pb.GetMemoriesRequest, context: Any) -> pb.GetMemoriesResponse:
        scope = self._scope(request.scope)
        tiers = read_tiers(request.tier)
        category = self._category(request.category)
        size = paging.page_size(request.page_size, default=MAX_PAGE_SIZE, maximum=MAX_PAGE_SIZE)
        bound_to = paging.digest(scope, tiers, category)
        after = self._pages.decode(request.page_token, "list", bound_to)
        replication.caught_up(self._engine, scope, tiers, request.min_generation, context)
        # One more than the page holds: whether another page follows.
        memories, usage = self._engine.list_memories(
            scope,
            tiers,
            category,
            after_seq=after,
            limit=size + 1,
            include_expired=request.include_expired,
        )
        settings = self._engine.settings(scope)
        response = pb.GetMemoriesResponse(
            usage=[usage_pb(tier, usage[tier], settings) for tier in tiers]
        )
        budget = paging.Budget(self._limits.response_bytes, response)
        taken = 0
        for memory in memories[:size]:
            item = memory_pb(memory)
            if not budget.take(item, first=not taken):
                break
            response.memories.append(item)
            taken += 1
        if taken < len(memories):
            response.next_page_token = self._pages.encode("list", bound_to, memories[taken - 1].seq)
        return response

    def SearchMemories(
        self, request: pb.SearchMemoriesRequest, context: Any
    ) -> pb.SearchMemoriesResponse:
        scope = self._scope(request.scope)
        tiers = read_tiers(request.tier)
        query = checked("query", request.query, self._limits.query_chars, multiline=True)
        category = self._category(request.category)
        limit = _bounded("limit", request.limit, MAX_SEARCH_LIMIT) or DEFAULT_SEARCH_LIMIT
        size = paging.page_size(request.page_size, default=limit, maximum=MAX_SEARCH_LIMIT)
        bound_to = paging.digest(scope, tiers, query, category, limit, request.match_all)
        offset = self._pages.decode(request.page_token, "search", bound_to)
        replication.caught_up(self._engine, scope, tiers, request.min_generation, context)
        hits = self._engine.search(
            scope, query, tiers, category=category, limit=limit, match_all=request.match_all
        )
        response = pb.SearchMemoriesResponse()
        budget = paging.Budget(self._limits.response_bytes, response)
        end = offset
        for memory, score in hits[offset : offset + size]:
            hit = pb.SearchHit(memory=memory_pb(memory), score=score)
            if not budget.take(hit, first=end == offset):
                break
            response.hits.append(hit)
            end += 1
        if end < len(hits):
            response.next_page_token = self._pages.encode("search", bound_to, end)
        return response

    def InjectForTurn(
        self, request: pb.InjectForTurnRequest, context: Any
    ) -> pb.InjectForTurnResponse:
        scope = self._scope(request.scope)
        session_id = self._id("session_id", request.session_id, "runtime session")
        message, recent, given = self._turn_texts(request)
        replication.caught_up(self._engine, scope, Tier, request.min_generation, context)
        turn = self._engine.inject(
            scope,
            session_id,
            user_message=message,
            recent_messages=recent,
            given_keywords=given,
            strategy=_STRATEGIES[request.strategy],
            max_memories=_bounded("max_memories", request.max_memories, MAX_INJECT_MEMORIES),
            max_tokens=_bounded("max_tokens", request.max_tokens, MAX_INJECT_TOKENS),
        )
        response = self._turn_response(turn, self._engine.settings(scope))
        self._refuse_if_too_large(turn, response)
        return response

    def _turn_texts(self, request: pb.InjectForTurnRequest) -> tuple[str, list[str], list[str]]:
        """The turn's strategy checked, and its user message, recent
        messages and given keywords, each within its limits."""
        limits = self._limits
        if request.strategy not in _STRATEGIES:
            raise InvalidArgument(
                f"unknown keyword strategy {request.strategy}; use LOCAL (1) or LLM (2)",
                reason=Reason.STRATEGY_UNKNOWN,
                metadata={"strategy": request.strategy},
            )
        message = checked(
            "user_message", request.user_message, limits.message_chars, multiline=True
        )
        counted("recent_messages", len(request.recent_messages), limits.recent_messages)
        recent = [
            checked(f"recent_messages[{i}]", text, limits.message_chars, multiline=True)
            for i, text in enumerate(request.recent_messages)
        ]
        counted("keywords", len(request.keywords), limits.keywords)
        given = [
            checked(f"keywords[{i}]", word, limits.query_chars)
            for i, word in enumerate(request.keywords)
        ]
        return message, recent, given

    def _frozen_answer(self, turn: Injection) -> pb.InjectForTurnResponse:
        """The frozen half of the answer, the same for every turn served from
        one snapshot: built once, copied (in C) per turn."""
        key = turn.snapshot.content_key
        frozen = self._frozen.get(key)
        if frozen is None:
            frozen = pb.InjectForTurnResponse(
                system_block=turn.system_block,
                snapshot_generation=turn.generation,
                snapshot_sha256=turn.sha256,
                system_block_memory_ids=turn.system_memory_ids,
                system_block_tokens=turn.system_tokens,
                token_counter=_COUNTERS[turn.token_counter],
            )
            self._frozen.put(key, frozen)
        return frozen

    def _turn_response(self, turn: Injection, settings: AgentSettings) -> pb.InjectForTurnResponse:
        response = pb.InjectForTurnResponse()
        response.CopyFrom(self._frozen_answer(turn))
        response.cache_hit = turn.cache_hit
        response.turn_context = turn.turn_context
        response.injected_memory_ids.extend(turn.turn_memory_ids)
        response.turn_context_tokens = turn.turn_tokens
        response.usage.extend(_usage_pb_cached(tier, turn.usage[tier], settings) for tier in Tier)
        return response

    def _refuse_if_too_large(self, turn: Injection, response: pb.InjectForTurnResponse) -> None:
        # Only a frozen block near the limit (a tier budget of megabytes) can
        # make a turn too large; measuring every turn would cost the cached path.
        chars = len(turn.system_block) + len(turn.turn_context)
        ids = len(turn.system_memory_ids) + len(turn.turn_memory_ids)
        if paging.turn_bound(chars, ids, self._limits.id_chars) > self._limits.response_bytes:
            paging.refuse_if_too_large(
                response,
                self._limits.response_bytes,
                "InjectForTurn answer",
                "lower the tiers' char limits or max_injection_tokens",
            )

    def NotifyCompaction(
        self, request: pb.NotifyCompactionRequest, context: Any
    ) -> pb.NotifyCompactionResponse:
        scope = self._scope(request.scope)
        session_id = self._id("session_id", request.session_id, "runtime session")
        invalidated, broadcast = self._engine.notify_compaction(scope, session_id)
        return pb.NotifyCompactionResponse(invalidated=invalidated, broadcast=broadcast)

    def EndSession(self, request: pb.EndSessionRequest, context: Any) -> pb.EndSessionResponse:
        scope = self._scope(request.scope)
        session_id = self._id("session_id", request.session_id, "runtime session")
        dropped, broadcast = self._engine.end_session(scope, session_id)
        return pb.EndSessionResponse(dropped=dropped, broadcast=broadcast)

    def ListTools(self, request: pb.ListToolsRequest, context: Any) -> pb.ListToolsResponse:
        scope = self._scope(request.scope)
        return pb.ListToolsResponse(
            tools=[_tool_pb(tool) for tool in self._tools.definitions(scope)],
            claude_memory_tool=_tool_pb(self._tools.claude_memory_tool()),
        )

    def CallTool(self, request: pb.CallToolRequest, context: Any) -> pb.CallToolResponse:
        scope = self._scope(request.scope)
        session_id = checked("session_id", request.session_id, self._limits.id_chars)
        name = checked("name", request.name, self._limits.id_chars)
        arguments = arguments_of(request.arguments_json)
        result = self._tools.call(scope, session_id, name, arguments)
        return pb.CallToolResponse(
            text=result.text,
            is_error=result.is_error,
            structured_json=json.dumps(result.structured),
            generation=result.generation,
        )

    def ExportMemories(
        self, request: pb.ExportMemoriesRequest, context: Any
    ) -> Iterator[pb.ExportMemoriesResponse]:
        return self._export(request, context)

    def WatchMemories(
        self, request: pb.WatchMemoriesRequest, context: Any
    ) -> Iterator[pb.WatchMemoriesResponse]:
        # A generator: the scope is checked at the first step, under the grant.
        scope, tiers = self._scope(request.scope), read_tiers(request.tier)
        yield from watch.stream(self._engine, scope, tiers, request, context, memory_pb)

    def ForgetUser(self, request: pb.ForgetUserRequest, context: Any) -> pb.ForgetUserResponse:
        return erasure.forget_user(self._engine, self._limits, request)

    def DeleteScope(self, request: pb.DeleteScopeRequest, context: Any) -> pb.DeleteScopeResponse:
        actor = access.authorize_erasure("DeleteScope")  # before the scope: see sidecar.api.erasure
        scope, tiers = self._scope(request.scope), read_tiers(request.tier)
        return erasure.delete_scope(self._engine, actor, scope, tiers)
