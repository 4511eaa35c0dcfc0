"""Replicas: read-your-writes across replicas, and session events that reach
every replica.

Read-your-writes. A write answers the generation it wrote (database-wide:
SQLite's largest plus one, PostgreSQL's sequence). A read given that
generation as `min_generation` first makes sure this replica has applied it
and every write committed before the read:

- known delivered (SQLite only: the feed's applied generation reached it,
  and generations commit in order): no cost;
- else (always on PostgreSQL, where a smaller generation may commit after a
  larger one, and for this replica's own writes too) a fence
  (sidecar.storage.changes.ChangeFeed.fence): a poll at once on SQLite, a
  notification of this replica's own on PostgreSQL, which arrives after
  every write committed before it. The call waits on a condition the feed
  signals, never polling;
- a feed that is not verified (or turns so while waiting): the partitions
  the read uses are checked against the database, which holds every
  acknowledged write;
- the deadline or the bound passing first, whichever is sooner:
  UNAVAILABLE REPLICA_BEHIND, with both generations; never a stale answer.
  The bound (`max_wait`, server.min_generation_wait_seconds; 0: the feed's
  settle time) holds whatever the deadline: a call without one (gRPC then
  reports years remaining) would otherwise hold its worker for ever.

Session events. NotifyCompaction and EndSession act on this replica's session
and publish the event to the others (their feeds call `heard`). The answer's
boolean still says whether this replica held the session; `broadcast` whether
the others were told (false: no feed, or the database refused). A replica whose
feed may have missed events (a PostgreSQL listener that reconnected, an
SQLite poller that fell past the events' retention) lets every session take
the current view at its next turn; while its feed is unverified, a frozen
block is served only if still current (sidecar.domain.engine.inject).

Owns: waiting for min_generation, publishing and hearing session events.
Must not touch: gRPC, SQL (the feed and the store do), views (the session
table holds them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from sidecar.core.errors import Reason, SidecarError, Unavailable
from sidecar.core.memory import Scope
from sidecar.core.metrics import Metrics
from sidecar.domain.partition import PartitionKey, Partitions
from sidecar.domain.sessions import SessionTable, session_key
from sidecar.domain.snapshots import View

log = logging.getLogger("sidecar.replication")

COMPACTION = "compaction"
END = "end"


class Replication:
    """Min-generation waits and session events over the partitions' feed.

    Without a feed (a process that is the database's only writer) both cost
    nothing: every write is applied before it is acknowledged, and no other
    replica holds a session.
    """

    def __init__(
        self,
        partitions: Partitions,
        sessions: SessionTable[View],
        metrics: Metrics,
        max_wait: float = 0.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._partitions = partitions
        self._max_wait = max_wait
        self._sessions = sessions
        self._metrics = metrics
        self._clock = clock
        # The feed tells `heard` and `resync` (wired by sidecar.domain.rooms
        # when the feed is built, before this room).
        self.feed = partitions.feed

    # --- read-your-writes -----------------------------------------------------

    def applied(self) -> int:
        """The newest generation this replica has applied (its feed's)."""
        return 0 if self.feed is None else self.feed.applied

    def caught_up(
        self, min_generation: int, keys: Iterable[PartitionKey], timeout: float | None
    ) -> None:
        """Return once this replica serves the write of `min_generation` and
        every write committed before the call (0: at once); raise
        REPLICA_BEHIND if `timeout` seconds (None: no deadline) or the bound
        pass first, whichever is sooner."""
        feed = self.feed
        if min_generation <= 0 or feed is None or feed.delivered(min_generation):
            return
        keys = list(keys)
        if not feed.verified:
            self._partitions.verify(keys, force=True)
            return
        bound = self._max_wait or feed.settle_seconds
        deadline = self._clock() + (bound if timeout is None else min(timeout, bound))
        ticket = feed.fence()
        while True:
            remaining = deadline - self._clock()
            # Wake when the feed would turn unverified, too: then the
            # database answers instead.
            step = min(remaining, max(feed.verified_for(), 0.01))
            if feed.wait(ticket, min_generation, step):
                return
            if not feed.verified:
                self._partitions.verify(keys, force=True)
                return
            if step >= remaining:
                applied = feed.applied
                self._metrics.replica_behind.inc()
                raise Unavailable(
                    f"this replica has applied generation {applied}, not yet "
                    f"{min_generation}; retry (here or on another replica)",
                    reason=Reason.REPLICA_BEHIND,
                    metadata={"min_generation": min_generation, "applied_generation": applied},
                )

    # --- session events -------------------------------------------------------

    def publish(self, kind: str, scope: Scope, session_id: str) -> bool:
        """Tell the other replicas; whether they were told. A database that
        refuses (full, busy, unreachable) costs the event, not the call: this
        replica has acted, and the answer's `broadcast` says the rest."""
        if self.feed is None:
            return False
        try:
            self.feed.publish(kind, scope.agent_id, scope.user_id, session_id)
        except SidecarError as exc:
            log.warning("could not tell the other replicas of a session's %s: %s", kind, exc)
            return False
        return True

    def heard(self, kind: str, agent_id: str, user_id: str, session_id: str) -> None:
        """Another replica's session event: act on this replica's session."""
        key = session_key(Scope(agent_id, user_id), session_id)
        if kind == COMPACTION:
            if self._sessions.invalidate(key, agent_id):
                self._metrics.snapshot_invalidations.labels("compaction").inc()
        elif kind == END:
            if self._sessions.drop(key, agent_id):
                self._metrics.snapshot_invalidations.labels("session_end").inc()
        else:
            log.warning("ignored a session event of unknown kind %r", kind)

    def resync(self) -> None:
        released = self._sessions.release_views()
        if released:
            log.info("change feed resynced: %d sessions take the current view", released)
