"""WatchMemories over gRPC: open a watch, render its events, end on cancel.

MemoryService.WatchMemories resolves the scope (and the caller's grant)
and the tiers, then delegates here. The domain (sidecar.watches) decides
what is sent and when a stream ends; its SidecarErrors (WATCHES_EXHAUSTED,
WATCH_TOO_SLOW, WATCH_GENERATION_PRUNED, SERVER_STOPPING) become statuses
in sidecar.interceptors, as every handler's do.

Owns: the protobuf form of a MemoryEvent, the cancellation callback. Must
not touch: the event log, the watch registry's rules, statuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.event_log import Event
from sidecar.memory import Memory, Scope, Tier
from sidecar.watches import Sync, Watches

_KINDS = {
    "add": pb.MemoryEvent.KIND_ADD,
    "update": pb.MemoryEvent.KIND_UPDATE,
    "delete": pb.MemoryEvent.KIND_DELETE,
    "expire": pb.MemoryEvent.KIND_EXPIRE,
    "erase": pb.MemoryEvent.KIND_ERASE,
}
_TIERS = {Tier.MEMORY: pb.TIER_MEMORY, Tier.USER: pb.TIER_USER}


def stream(
    watches: Watches,
    scope: Scope,
    tiers: Sequence[Tier],
    request: pb.WatchMemoriesRequest,
    context: Any,
    render: Callable[[Memory], pb.Memory],
) -> Iterator[pb.WatchMemoriesResponse]:
    """The responses of one WatchMemories call, until the caller cancels,
    the server stops, or the domain ends the stream."""
    with watches.open(scope, tiers) as watch:
        # A cancel (or a passed deadline) wakes the watch at once, so its
        # worker thread and its slot are free again without waiting.
        if not context.add_callback(watch.cancel):
            return
        for item in watch.events(request.after_generation):
            yield pb.WatchMemoriesResponse(event=event_pb(item, render))


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
