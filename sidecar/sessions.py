"""Sessions: which snapshot each runtime session is using, and when to let go.

A session maps a runtime's session_id to the snapshot (a `View`, built by the
engine) its frozen block came from. Sessions that never call EndSession are
evicted after an idle TTL, beyond a maximum count per agent, and beyond a
maximum count in all (least recently used first), so neither a leaky
runtime nor a flood of agent ids can grow the daemon without bound.

All state sits behind one lock held only for dictionary updates; building a
snapshot happens outside it. Nothing is kept for an agent without sessions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(slots=True)
class Session(Generic[V]):
    view: V | None
    last_used: float
    # Set by compaction: the next snapshot is read afresh from the database.
    compacted: bool = False
    # Advanced by every invalidation, so a rebuild that raced one can tell.
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class Limits:
    idle_ttl_seconds: float
    max_sessions: int


# A session's id within its agent: any hashable (the engine uses the
# runtime's session id with the scope's user_id).
SessionId = Hashable


class SessionTable(Generic[V]):
    """(agent_id, session_id) -> Session, in least-recently-used order.

    Session ids are per agent: two agents that both call their session
    "default" hold two sessions, and neither can invalidate, end or take
    over the other's. `limits(agent_id)` gives each agent's TTL and cap;
    `max_total` caps all sessions together: over it, the least recently
    used session of the least recently used agent goes. `on_evict(count)`
    is told how many sessions eviction removed.

    Plain dicts keep both orders (an entry moves to the end by being popped
    and put back): an OrderedDict costs twice the memory per agent.
    """

    def __init__(
        self,
        limits: Callable[[str], Limits],
        max_total: int = 1_000_000,
        on_evict: Callable[[int], None] = lambda n: None,
    ) -> None:
        self._limits = limits
        self._max_total = max_total
        self._on_evict = on_evict
        self._lock = threading.Lock()
        # Agents in least-recently-used order, each with its sessions in theirs.
        self._agents: dict[str, dict[SessionId, Session[V]]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def agents(self) -> int:
        return len(self._agents)

    def get(self, session_id: SessionId, agent_id: str, now: float) -> Session[V]:
        """The agent's session, marked as used now; a new one if unknown."""
        with self._lock:
            sessions = self._agents.pop(agent_id, None)
            if sessions is None:
                sessions = {}
            self._agents[agent_id] = sessions
            session = sessions.pop(session_id, None)
            if session is None:
                session = Session(None, now)
                self._count += 1
            else:
                session.last_used = now
            sessions[session_id] = session
            # Only the caps are enforced here, and only when exceeded; idle
            # sessions go in evict_idle, which the janitor runs periodically.
            # A cached turn then pays no scan of the table.
            evicted = 0
            if len(sessions) > self._limits(agent_id).max_sessions:
                evicted += self._evict_agent(agent_id, now, keep=session_id)
            while self._count > self._max_total:
                if not self._evict_least_recent(keep=(agent_id, session_id)):
                    break
                evicted += 1
        if evicted:
            self._on_evict(evicted)
        return session

    def invalidate(self, session_id: SessionId, agent_id: str) -> bool:
        """Forget a session's snapshot (it is rebuilt on its next turn)."""
        with self._lock:
            sessions = self._agents.get(agent_id)
            session = sessions.get(session_id) if sessions is not None else None
            if session is None:
                return False
            had_view = session.view is not None
            session.view = None
            session.compacted = True
            session.epoch += 1
            return had_view

    def attach(self, session: Session[V], view: V, epoch: int) -> bool:
        """Give a session the view built for it, unless it was invalidated since
        `epoch` was read: then it keeps no view and rebuilds on its next turn."""
        with self._lock:
            if session.epoch != epoch:
                return False
            session.view = view
            session.compacted = False
            return True

    def drop(self, session_id: SessionId, agent_id: str) -> bool:
        """End an agent's session; the same id later starts afresh."""
        with self._lock:
            sessions = self._agents.get(agent_id)
            if sessions is None or sessions.pop(session_id, None) is None:
                return False
            self._count -= 1
            if not sessions:
                del self._agents[agent_id]
            return True

    def views(self) -> list[V]:
        """The views sessions hold (for the janitor: a scan of every session)."""
        with self._lock:
            return [
                s.view
                for sessions in self._agents.values()
                for s in sessions.values()
                if s.view is not None
            ]

    def evict_idle(self, now: float) -> int:
        """Evict every session idle past its agent's TTL or over its cap."""
        with self._lock:
            evicted = sum(self._evict_agent(agent, now) for agent in list(self._agents))
        if evicted:
            self._on_evict(evicted)
        return evicted

    # --- under the lock -----------------------------------------------------

    def _evict_agent(self, agent_id: str, now: float, keep: SessionId | None = None) -> int:
        sessions = self._agents.get(agent_id)
        if not sessions:
            return 0
        limits = self._limits(agent_id)
        evicted = 0
        # Oldest first: the front of the dict is the least recently used.
        while sessions:
            session_id, session = next(iter(sessions.items()))
            if session_id == keep:
                break
            idle = now - session.last_used >= limits.idle_ttl_seconds
            if not idle and len(sessions) <= limits.max_sessions:
                break
            del sessions[session_id]
            evicted += 1
        self._count -= evicted
        if not sessions:
            del self._agents[agent_id]
        return evicted

    def _evict_least_recent(self, keep: tuple[str, SessionId]) -> bool:
        """Evict one session of the least recently used agent (never `keep`)."""
        for agent_id, sessions in self._agents.items():
            for session_id in sessions:
                if (agent_id, session_id) != keep:
                    del sessions[session_id]
                    self._count -= 1
                    if not sessions:
                        del self._agents[agent_id]
                    return True
        return False
