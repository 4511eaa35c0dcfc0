"""PostgreSQL's change feed: a LISTEN on a dedicated connection that hears
every replica's commits (and session events and fences) as they happen.

Owns: the listener's connection, its LISTENs and heartbeat, the re-read of
every state row after each (re)connect, and taking a slot from the pool
when the server has none free.
Must not touch: SQLite, caches, the engine, gRPC; writing anything (the
notifications are sent by sidecar.storage._postgres).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from sidecar.storage._backend import STATE_TABLE
from sidecar.storage._pgpool import Pool, out_of_slots
from sidecar.storage.changes import ChangeFeed, OnChange, OnSession

CHANNEL = "memory_sidecar_changes"
# Session events and fences (sidecar.storage.changes), on the same connection: one
# queue, delivered in commit order across channels. A channel of their own
# keeps them from releases that read every CHANNEL payload as a write.
EVENTS_CHANNEL = "memory_sidecar_events"
# The longest the listener waits for notifications at a time.
_SLICE = 0.1
# The longest it waits for one of the pool's connections to come back.
_CLAIM_SECONDS = 5.0


def _cause_out_of_slots(exc: BaseException) -> bool:
    cause = exc.__cause__
    return cause is not None and out_of_slots(cause)


class NotifyListener(ChangeFeed):
    """LISTENs on a dedicated connection; every cycle ends with a heartbeat.

    After every (re)connect it LISTENs first and only then re-reads every
    state row: a write that committed in between is seen by the read, the
    notification, or both, never by neither.
    """

    polls = False
    # Generations are drawn before commit: one drawn later may commit first.
    ordered = False

    def __init__(
        self,
        connect: Callable[[], Any],
        on_change: OnChange,
        *,
        heartbeat: float,
        publish: Callable[[str], None],
        pool: Pool | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_session: OnSession | None = None,
        on_resync: Callable[[], None] | None = None,
        adopt: Callable[[Any], None] = lambda connection: None,
    ) -> None:
        super().__init__(
            on_change,
            interval=heartbeat,
            stale_after=3 * heartbeat,
            publish=publish,
            clock=clock,
            on_session=on_session,
            on_resync=on_resync,
        )
        self._connect = connect
        self._pool = pool
        # Makes a connection taken over from the pool the listener's.
        self._adopt = adopt
        self._connection: Any = None
        self._beat = 0.0

    def _open(self) -> bool:
        if self._connection is not None:
            return False
        if self._pool is not None:
            self._pool.reap()
        try:
            connection = self._connect()
        except Exception as exc:
            # The backend's connect turns the driver's refusal into
            # DATABASE_BUSY, keeping it as the cause.
            if self._pool is None or not (out_of_slots(exc) or _cause_out_of_slots(exc)):
                raise
            connection = self._take_over(self._pool)
        if self._pool is not None:
            self._pool.release()
        self._connection = connection
        connection.execute(f"LISTEN {CHANNEL}")
        connection.execute(f"LISTEN {EVENTS_CHANNEL}")
        self.connects += 1
        if self.connects > 1:
            # Session events sent while it was away are lost with the
            # connection: every session rebuilds once.
            self._resync()
        # The re-read below proves every fence issued before it, and the
        # LISTENs above hear every one issued after: none is lost between.
        with self._caught_up:
            issued = self._issued
        with connection.cursor() as cursor:
            for owner, tier, generation, erased in cursor.stream(
                f"SELECT owner, tier, generation, erased FROM {STATE_TABLE}"
            ):
                self._deliver(owner, tier, int(generation), int(erased))
        self._proved(issued)
        self._beat = self._clock()
        return True

    def _take_over(self, pool: Pool) -> Any:
        """No free slot. Without the listener every call checks the database,
        so it comes before the pool's calls: it takes one of the pool's
        connections, and the slot with it (one given back to the server
        goes to whoever asks first, under load another replica's pool)."""
        taken = pool.surrender(min(self.interval, _CLAIM_SECONDS))
        if taken is not None:
            try:
                self._adopt(taken)
            except Exception:
                with contextlib.suppress(Exception):
                    taken.close()
                raise
            return taken
        # The pool has none: it gives back what comes idle and grows no
        # more; try again at once (the feed backs off if another process
        # took the slot first).
        pool.make_room()
        try:
            return self._connect()
        except Exception:
            if self._thread is None or not self._thread.is_alive():
                # start() failing: no thread will connect and release the
                # hold, and a held pool would fail every later start-up
                # attempt (DATABASE_BUSY) for good.
                pool.release()
            raise

    def _cycle(self) -> bool:
        # Short waits, so that a stop never waits a whole heartbeat.
        for note in self._connection.notifies(timeout=min(self.interval, _SLICE)):
            if note.channel == EVENTS_CHANNEL:
                self._session_event(note.payload)
                continue
            # [owner, tier, generation], and the erased generation after an
            # erasure (see _erase_sql).
            owner, tier, generation, *erased = json.loads(note.payload)
            self._deliver(owner, tier, int(generation), int(erased[0]) if erased else 0)
        if self._clock() - self._beat < self.interval:
            return False
        # The heartbeat: a connection that died quietly fails here.
        self._connection.execute("SELECT 1")
        self._beat = self._clock()
        if self._pool is not None:
            self._pool.reap()
        return True

    def _request_fence(self, ticket: int) -> None:
        self._send(json.dumps(["fence", self.origin, ticket]))

    def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()
