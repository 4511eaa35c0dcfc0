"""SQLite's change feed: a poller of `PRAGMA data_version` that hears every
other connection's commits (of this process or another) and reads what they
changed, and the session events other processes published.

Owns: the poller's own connection, its watermarks, reading changed partition
states and session events. Must not touch: PostgreSQL, caches, the engine,
gRPC; writing anything (session events are written by sidecar.storage._sqlite).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator

from sidecar.storage._backend import SESSION_EVENTS_TABLE, STATE_TABLE
from sidecar.storage.changes import ChangeFeed, OnChange, OnSession


class DataVersionPoller(ChangeFeed):
    """Polls `PRAGMA data_version` on a connection of its own.

    data_version changes whenever another connection (of this process or
    any other) commits, and costs no I/O when nothing did. Generations grow
    in commit order (writes hold the one write lock), so "rows whose
    generation passed the watermark" is exactly what changed since. Session
    events are rows of their own table, read past their own watermark.
    """

    def __init__(
        self,
        path: str,
        on_change: OnChange,
        *,
        interval: float,
        busy_timeout_ms: int,
        publish: Callable[[str], None],
        on_session: OnSession | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> None:
        # Unverified after a few missed polls, however short the interval:
        # a busy machine may delay a cycle, and each costs a query per call.
        super().__init__(
            on_change,
            interval=interval,
            stale_after=max(1.0, 10 * interval),
            publish=publish,
            on_session=on_session,
            on_resync=on_resync,
        )
        self._path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._connection: sqlite3.Connection | None = None
        self._version: int | None = None
        self._watermark: int | None = None
        self._events: int | None = None

    def _open(self) -> bool:
        if self._connection is not None:
            return False
        self._connection = sqlite3.connect(self._path, check_same_thread=False)
        self._connection.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
        self.connects += 1
        return True

    def _cycle(self) -> bool:
        assert self._connection is not None
        version = self._connection.execute("PRAGMA data_version").fetchone()[0]
        if version != self._version:
            self._version = version
            # One read transaction (one snapshot) for both: read apart, a
            # write and a compaction event committed in between would have
            # the event applied before the write reached the caches (a turn
            # then freezes a block without it).
            self._connection.execute("BEGIN")
            try:
                changed = list(self._changed())
                events = list(self._session_events())
            finally:
                self._connection.execute("COMMIT")
            for owner, tier, generation, erased in changed:
                self._deliver(owner, tier, generation, erased)
            for payload in events:
                self._session_event(payload)
        return True

    def _changed(self) -> Iterator[tuple[str, str, int, int]]:
        assert self._connection is not None
        if self._watermark is None:
            # First contact: nothing is cached yet, only the watermark matters.
            row = self._connection.execute(f"SELECT MAX(generation) FROM {STATE_TABLE}").fetchone()
            self._watermark = int(row[0] or 0)
            self._applied_through(self._watermark)
            return
        rows = self._connection.execute(
            f"SELECT owner, tier, generation, erased FROM {STATE_TABLE} WHERE generation > ?"
            " ORDER BY generation",
            (self._watermark,),
        ).fetchall()
        for owner, tier, generation, erased in rows:
            self._watermark = max(self._watermark, int(generation))
            yield owner, tier, int(generation), int(erased)

    def _session_events(self) -> Iterator[str]:
        assert self._connection is not None
        if self._events is None:
            row = self._connection.execute(f"SELECT MAX(id) FROM {SESSION_EVENTS_TABLE}").fetchone()
            self._events = int(row[0] or 0)
            return
        rows = self._connection.execute(
            f"SELECT id, payload FROM {SESSION_EVENTS_TABLE} WHERE id > ? ORDER BY id",
            (self._events,),
        ).fetchall()
        if rows and rows[0][0] > self._events + 1:
            # Events never read were pruned (or an insert rolled back).
            self._resync()
        for event_id, payload in rows:
            self._events = int(event_id)
            yield str(payload)

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
            self._version = None
