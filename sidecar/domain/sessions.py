"""Sessions: which snapshot each runtime session is using, and when to let go.

A session maps a runtime's session_id to the snapshot (a `View`, built by the
engine) its frozen block came from. Sessions that never call EndSession are
evicted after an idle TTL, beyond a maximum count per agent, and beyond a
maximum count in all (least recently used first), so neither a leaky
runtime nor a flood of agent ids can grow the daemon without bound.

All state sits behind one lock held only for dictionary updates; building a
snapshot happens outside it. Nothing is kept for an agent without sessions.

Owns: the session table: each session's view, epoch and compacted flag, the caps
per agent and in all, idle eviction, and session keys. Must not touch: views
(generic over V: never built, read or rendered here), partitions, the store,
metrics (evictions go to on_evict), the clock (callers pass `now`), gRPC.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from sidecar.core.memory import Scope

V = TypeVar("V")

# A session's id within its agent: any hashable (the engine uses the
# runtime's session id, with the scope's user_id when there is one).
SessionId = Hashable


@dataclass(slots=True)
class Session(Generic[V]):
    # Its id within its agent (an agent with one session keeps it bare).
    key: SessionId
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


# An agent's sessions: the one session itself, or by id in least-recently-used
# order. Most agents hold one session (one conversation): a dict for it would
# cost more than the session (about 220 bytes against 80).
_Sessions = Session[V] | dict[SessionId, Session[V]]


class SessionTable(Generic[V]):
    """(agent_id, session_id) -> Session, in least-recently-used order.

    Session ids are per agent: two agents that both call their session
    "default" hold two sessions, and neither can invalidate, end or take
    over the other's. `limits(agent_id)` gives each agent's TTL and cap;
    `max_total` caps all sessions together: over it, the least recently
    used session of the least recently used agent goes. `on_evict(count)`
    is told how many sessions eviction removed.

    Plain dicts keep both orders (an entry moves to the end by being popped
    and put back): an OrderedDict costs twice the memory per agent. An agent
    with a single session maps to that session, with no dict of its own
    (see _Sessions); a second session turns it into a dict, for good.
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
        self._agents: dict[str, _Sessions[V]] = {}
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
                # A new agent: its one session needs no dict (nor a cap check:
                # every cap is at least 1).
                session: Session[V] = Session(session_id, None, now)
                self._agents[agent_id] = session
                self._count += 1
            elif not isinstance(sessions, dict) and sessions.key == session_id:
                session = sessions
                session.last_used = now
                self._agents[agent_id] = session
            else:
                if not isinstance(sessions, dict):
                    sessions = {sessions.key: sessions}
                self._agents[agent_id] = sessions
                found = sessions.pop(session_id, None)
                if found is None:
                    session = Session(session_id, None, now)
                    self._count += 1
                else:
                    session = found
                    session.last_used = now
                sessions[session_id] = session
            # Only the caps are enforced here, and only when exceeded; idle
            # sessions go in evict_idle, which the janitor runs periodically.
            # A cached turn then pays no scan of the table.
            evicted = 0
            if isinstance(sessions, dict) and len(sessions) > self._limits(agent_id).max_sessions:
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
            session = self._find(session_id, agent_id)
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
            if sessions is None:
                return False
            if isinstance(sessions, dict):
                if sessions.pop(session_id, None) is None:
                    return False
                if not sessions:
                    del self._agents[agent_id]
            elif sessions.key == session_id:
                del self._agents[agent_id]
            else:
                return False
            self._count -= 1
            return True

    def drop_where(self, must_go: Callable[[V], bool]) -> int:
        """End every session whose view `must_go` (an erasure: its view showed
        erased content); how many. A scan of every session, under the lock."""
        dropped = 0
        with self._lock:
            for agent_id, sessions in list(self._agents.items()):
                if not isinstance(sessions, dict):
                    if sessions.view is not None and must_go(sessions.view):
                        del self._agents[agent_id]
                        dropped += 1
                    continue
                gone = [k for k, s in sessions.items() if s.view is not None and must_go(s.view)]
                for session_id in gone:
                    del sessions[session_id]
                dropped += len(gone)
                if not sessions:
                    del self._agents[agent_id]
            self._count -= dropped
        return dropped

    def release_views(self) -> int:
        """Every session lets go of its view and takes the current one at its
        next turn (a replica that may have missed compactions and ends of
        sessions sent to others); how many held one."""
        released = 0
        with self._lock:
            for sessions in self._agents.values():
                for session in _each(sessions):
                    released += session.view is not None
                    session.view = None
                    session.epoch += 1
        return released

    def views(self) -> list[tuple[str, SessionId, V]]:
        """(agent_id, session_id, view) of every session holding a view (for
        the janitor: a scan of every session)."""
        with self._lock:
            return [
                (agent_id, s.key, s.view)
                for agent_id, sessions in self._agents.items()
                for s in _each(sessions)
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

    def _find(self, session_id: SessionId, agent_id: str) -> Session[V] | None:
        sessions = self._agents.get(agent_id)
        if isinstance(sessions, dict):
            return sessions.get(session_id)
        return sessions if sessions is not None and sessions.key == session_id else None

    def _evict_agent(self, agent_id: str, now: float, keep: SessionId | None = None) -> int:
        sessions = self._agents.get(agent_id)
        if sessions is None:
            return 0
        limits = self._limits(agent_id)
        if not isinstance(sessions, dict):
            if sessions.key == keep or now - sessions.last_used < limits.idle_ttl_seconds:
                return 0
            del self._agents[agent_id]
            self._count -= 1
            return 1
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
            for session in _each(sessions):
                if (agent_id, session.key) != keep:
                    if isinstance(sessions, dict):
                        del sessions[session.key]
                        if not sessions:
                            del self._agents[agent_id]
                    else:
                        del self._agents[agent_id]
                    self._count -= 1
                    return True
        return False


def _each(sessions: _Sessions[V]) -> Iterator[Session[V]]:
    """An agent's sessions, least recently used first."""
    if isinstance(sessions, dict):
        yield from sessions.values()
    else:
        yield sessions


def session_key(scope: Scope, session_id: str) -> SessionId:
    """A session's id within its agent: sessions of different users of one
    agent are apart. Without a user_id (the usual case) the bare session id:
    a str never equals a tuple, and it saves a tuple per session."""
    return (scope.user_id, session_id) if scope.user_id else session_id


def session_scope(agent_id: str, key: SessionId) -> Scope:
    """The scope of the session with this id (see session_key)."""
    return Scope(agent_id, key[0]) if isinstance(key, tuple) else Scope(agent_id)
