"""WatchMemories over gRPC: open a watch, render its events, end on cancel.

MemoryService.WatchMemories resolves the scope (and the caller's grant)
and the tiers, then delegates here. The domain (sidecar.domain.watch) decides
what is sent and when a stream ends; its SidecarErrors (WATCHES_EXHAUSTED,
WATCH_TOO_SLOW, WATCH_GENERATION_PRUNED, SERVER_STOPPING) become statuses
in sidecar.api.interceptors, as every handler's do.

Owns: the protobuf form of a MemoryEvent, the resume point's checks, the
cancellation callback. Must not touch: the event log, the watch registry's
rules (only MemoryEngine.watch), statuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.core.errors import InvalidArgument, Reason
from sidecar.core.memory import Memory, Scope, Tier
from sidecar.domain.engine import MemoryEngine
from sidecar.domain.watch import Sync
from sidecar.storage.events import Event

_KINDS = {
    "add": pb.MemoryEvent.KIND_ADD,
    "update": pb.MemoryEvent.KIND_UPDATE,
    "delete": pb.MemoryEvent.KIND_DELETE,
    "expire": pb.MemoryEvent.KIND_EXPIRE,
    "erase": pb.MemoryEvent.KIND_ERASE,
}
_TIERS = {Tier.MEMORY: pb.TIER_MEMORY, Tier.USER: pb.TIER_USER}


def stream(
    engine: MemoryEngine,
    scope: Scope,
    tiers: Sequence[Tier],
    request: pb.WatchMemoriesRequest,
    context: Any,
    render: Callable[[Memory], pb.Memory],
) -> Iterator[pb.WatchMemoriesResponse]:
    """The responses of one WatchMemories call, until the caller cancels,
    the server stops, or the domain ends the stream."""
    with engine.watch(scope, tiers) as watch:
        # A cancel (or a passed deadline) wakes the watch at once, so its
        # worker thread and its slot are free again without waiting.
        if not context.add_callback(watch.cancel):
            return
        for item in watch.events(request.after_generation, _within(request, tiers)):
            yield pb.WatchMemoriesResponse(event=event_pb(item, render))


def _within(request: pb.WatchMemoriesRequest, tiers: Sequence[Tier]) -> tuple[Tier, str] | None:
    """Where inside after_generation to resume: the tier and id of the
    last event received, or None (after the whole generation)."""
    if not request.after_id and request.after_tier == pb.TIER_UNSPECIFIED:
        return None
    tier = next((t for t, number in _TIERS.items() if number == request.after_tier), None)
    if not request.after_id or tier is None or tier not in tiers or request.after_generation <= 0:
        raise InvalidArgument(
            "after_tier and after_id resume inside after_generation: give both (the tier and "
            "id of the last event received, a tier this call watches) with after_generation",
            reason=Reason.RESUME_POINT_INVALID,
            metadata={
                "field": "after_generation"
                if request.after_generation <= 0
                else ("after_id" if not request.after_id else "after_tier"),
                "after_tier": request.after_tier,
                "after_generation": request.after_generation,
            },
        )
    return tier, request.after_id


def event_pb(item: Event | Sync, render: Callable[[Memory], pb.Memory]) -> pb.MemoryEvent:
    if isinstance(item, Sync):
        return pb.MemoryEvent(kind=pb.MemoryEvent.KIND_SYNC, generation=item.generation)
    event = pb.MemoryEvent(
        kind=_KINDS.get(item.kind, pb.MemoryEvent.KIND_UNSPECIFIED),
        generation=item.generation,
        tier=_TIERS[item.tier],
        id=item.memory_id,
    )
    if item.memory is not None:
        event.memory.CopyFrom(render(item.memory))
    return event
