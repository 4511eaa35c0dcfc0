"""MemoryService over gRPC: validate the request, call the store, render.

Errors are raised as SidecarErrors and turned into statuses by
sidecar.interceptors; nothing here builds a status itself.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.config import AgentSettings, Config
from sidecar.errors import InvalidArgument, Unimplemented
from sidecar.memory import Memory, Scope, Tier, Usage, check_confidence, clean_content
from sidecar.search import substring_search
from sidecar.store import Store

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MemoryService"].full_name

_TIER_TO_PB = {Tier.MEMORY: pb.TIER_MEMORY, Tier.USER: pb.TIER_USER}
_PB_TO_TIER: dict[int, Tier] = {int(v): k for k, v in _TIER_TO_PB.items()}
DEFAULT_SEARCH_LIMIT = 20
MAX_SEARCH_LIMIT = 1000


def _tier_number(value: int) -> int:
    if value != pb.TIER_UNSPECIFIED and value not in _PB_TO_TIER:
        raise InvalidArgument(
            f"unknown tier {value}; use TIER_MEMORY (1) or TIER_USER (2)",
            reason="TIER_UNKNOWN",
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


def scope_of(message: pb.Scope) -> Scope:
    return Scope(agent_id=message.agent_id, user_id=message.user_id)


def _timestamp(moment: Any) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def memory_pb(memory: Memory) -> pb.Memory:
    return pb.Memory(
        id=memory.id,
        tier=_TIER_TO_PB[memory.tier],
        content=memory.content,
        category=memory.category,
        confidence=memory.confidence,
        created_at=_timestamp(memory.created_at),
        updated_at=_timestamp(memory.updated_at),
    )


def usage_pb(tier: Tier, usage: Usage, settings: AgentSettings) -> pb.TierUsage:
    policy = settings.policy(tier)
    return pb.TierUsage(
        tier=_TIER_TO_PB[tier],
        used_chars=usage.used_chars,
        limit_chars=policy.limit_chars,
        entry_count=usage.entry_count,
        enabled=policy.enabled,
    )


def _require_id(memory_id: str) -> str:
    if not memory_id:
        raise InvalidArgument("id is empty; name the memory to change", reason="ID_EMPTY")
    return memory_id


class MemoryService(pb_grpc.MemoryServiceServicer):  # type: ignore[misc]
    def __init__(self, config: Config, store: Store) -> None:
        self._config = config
        self._store = store

    def _settings(self, scope: Scope) -> AgentSettings:
        return self._config.for_agent(scope.agent_id)

    def AddMemory(self, request: pb.AddMemoryRequest, context: Any) -> pb.AddMemoryResponse:
        scope = scope_of(request.scope)
        tier = write_tier(request.tier)
        content = clean_content(request.content)
        confidence = check_confidence(request.confidence) if request.HasField("confidence") else 1.0
        settings = self._settings(scope)
        memory, usage, created = self._store.add(
            scope, tier, content, request.category, confidence, settings.policy(tier)
        )
        return pb.AddMemoryResponse(
            memory=memory_pb(memory), usage=usage_pb(tier, usage, settings), created=created
        )

    def UpdateMemory(
        self, request: pb.UpdateMemoryRequest, context: Any
    ) -> pb.UpdateMemoryResponse:
        scope = scope_of(request.scope)
        memory_id = _require_id(request.id)
        content = clean_content(request.content) if request.HasField("content") else None
        confidence = (
            check_confidence(request.confidence) if request.HasField("confidence") else None
        )
        category = request.category if request.HasField("category") else None
        settings = self._settings(scope)
        memory, usage = self._store.update(
            scope,
            memory_id,
            settings.policies(),
            content=content,
            category=category,
            confidence=confidence,
        )
        return pb.UpdateMemoryResponse(
            memory=memory_pb(memory), usage=usage_pb(memory.tier, usage, settings)
        )

    def DeleteMemory(
        self, request: pb.DeleteMemoryRequest, context: Any
    ) -> pb.DeleteMemoryResponse:
        scope = scope_of(request.scope)
        memory, usage = self._store.delete(scope, _require_id(request.id))
        return pb.DeleteMemoryResponse(
            memory=memory_pb(memory),
            usage=usage_pb(memory.tier, usage, self._settings(scope)),
        )

    def GetMemories(self, request: pb.GetMemoriesRequest, context: Any) -> pb.GetMemoriesResponse:
        scope = scope_of(request.scope)
        tiers = read_tiers(request.tier)
        memories, usage = self._store.list(scope, tiers, request.category)
        settings = self._settings(scope)
        return pb.GetMemoriesResponse(
            memories=[memory_pb(m) for m in memories],
            usage=[usage_pb(tier, usage[tier], settings) for tier in tiers],
        )

    def SearchMemories(
        self, request: pb.SearchMemoriesRequest, context: Any
    ) -> pb.SearchMemoriesResponse:
        scope = scope_of(request.scope)
        tiers = read_tiers(request.tier)
        if request.limit < 0:
            raise InvalidArgument(
                f"limit must not be negative, got {request.limit}",
                reason="LIMIT_OUT_OF_RANGE",
                metadata={"limit": request.limit, "max": MAX_SEARCH_LIMIT},
            )
        limit = min(request.limit or DEFAULT_SEARCH_LIMIT, MAX_SEARCH_LIMIT)
        memories, _ = self._store.list(scope, tiers, request.category)
        hits = substring_search(memories, request.query, match_all=request.match_all)
        return pb.SearchMemoriesResponse(
            hits=[pb.SearchHit(memory=memory_pb(m), score=score) for m, score in hits[:limit]]
        )

    def InjectForTurn(self, request: Any, context: Any) -> Any:
        raise Unimplemented("InjectForTurn is not implemented in this release")

    def NotifyCompaction(self, request: Any, context: Any) -> Any:
        raise Unimplemented("NotifyCompaction is not implemented in this release")

    def EndSession(self, request: Any, context: Any) -> Any:
        raise Unimplemented("EndSession is not implemented in this release")
