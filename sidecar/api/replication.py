"""min_generation on the read RPCs: wait, within the call's deadline and the
server's bound, until this replica has applied the write a client saw
acknowledged elsewhere.

Owns: turning a request's min_generation and the call's deadline into a
wait (sidecar.domain.replication). Must not touch: the feed or the store (the
domain waits), rendering (sidecar.api.service).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sidecar.core.memory import Scope, Tier
from sidecar.domain.engine import MemoryEngine

# Kept back from the deadline, so that REPLICA_BEHIND (which says how far
# behind) reaches the client before its own DEADLINE_EXCEEDED does.
MARGIN_SECONDS = 0.05


def caught_up(
    engine: MemoryEngine, scope: Scope, tiers: Iterable[Tier], min_generation: int, context: Any
) -> None:
    """Return once the replica serves the write of min_generation and every
    write acknowledged before the call (0: at once); UNAVAILABLE
    REPLICA_BEHIND if the deadline or the server's bound would pass first.
    A call without a deadline reports years remaining: the bound, applied
    by the domain whatever the timeout, ends it."""
    if min_generation <= 0:
        return
    remaining = context.time_remaining() if context is not None else None
    timeout = None if remaining is None else max(0.0, remaining - MARGIN_SECONDS)
    engine.caught_up(scope, tiers, min_generation, timeout)
