"""PostgreSQL's connection slots: the pool that shares them with the change
feed's listener, and how to tell that the server has none left.

A server has `max_connections` slots (less the few reserved for
superusers), shared by every replica. Peewee's pool opens a connection per
concurrent request and keeps every one it ever opened, so after a burst of
load a few replicas can hold every slot idle, for ever: a listener whose
connection dropped then never gets back in, and its replica checks its
caches against the database on every call. So this pool

- closes connections idle longer than `idle_seconds` (the listener's
  heartbeat calls `reap`, so a replica with no calls at all shrinks too);
- opens at most `max_connections` (the daemon's `db_pool_size`);
- gives way to the listener: when the listener finds no free slot it takes
  one of the pool's connections (`surrender`: the first idle one, or the
  next one a call checks in), its slot with it. A slot given back to the
  server goes to whichever client asks first: under load another replica's
  pool, and the listener never got back in. Only when this pool has no
  connection at all does the listener fall back to `make_room`: hold the
  pool (no new connection) until the listener is back (`release`).

Owns: the pool's size cap, idle timeout, hold and hand-over, and the test
for "no free slot" (SQLSTATE 53300). Must not touch: SQL beyond connecting, the
listener itself or the error leaves (sidecar.storage._postgres), SQLite, gRPC.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any

from playhouse.pool import MaxConnectionsExceeded

try:
    from playhouse.postgres_ext import PooledPsycopg3Database
except ImportError:  # pragma: no cover - exercised only without the extra
    PooledPsycopg3Database = object

# SQLSTATE too_many_connections: "sorry, too many clients already" and
# "remaining connection slots are reserved for ...".
TOO_MANY_CONNECTIONS = "53300"
# libpq reports a refused connection without a SQLSTATE; these are the
# server's words for the refusals above and for a role's or database's
# CONNECTION LIMIT (PostgreSQL 13-17, English).
_NO_SLOT_WORDS = (
    "too many clients",
    "remaining connection slots are reserved",
    "too many connections for",
)


def out_of_slots(error: BaseException) -> bool:
    """Whether the server refused a connection for want of a free slot."""
    state = getattr(error, "sqlstate", None)
    if state is not None:
        return bool(state == TOO_MANY_CONNECTIONS)
    # Only a connection refused before any SQLSTATE: never an error that
    # might quote stored content back.
    text = str(error).lower()
    return any(words in text for words in _NO_SLOT_WORDS)


class Pool(PooledPsycopg3Database):  # type: ignore[misc]
    """Peewee's psycopg 3 pool with an idle timeout and a hold.

    `reap()` closes what has been idle past `idle_seconds`; `make_room()`
    closes every idle connection and holds the pool (no new connection
    while held: a request waits for one of those in use, then fails
    DATABASE_BUSY), until `release()`.
    """

    # Peewee's heap of idle connections: (opened at, tie-breaker, connection).
    _connections: list[tuple[float, int, Any]]

    def __init__(
        self,
        dsn: str,
        *,
        max_connections: int,
        idle_seconds: float,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        **connect_params: Any,
    ) -> None:
        self.idle_seconds = idle_seconds
        self._clock = clock
        # When each idle connection was checked in, by the pool's key.
        self._idle_since: dict[int, float] = {}
        self.held = False
        # Listeners waiting for a connection to take over (see surrender).
        self._claims = 0
        super().__init__(dsn, max_connections=max_connections, timeout=timeout, **connect_params)

    def _connect(self) -> Any:
        with self._pool_lock:
            if self._claims or (self.held and not self._connections):
                # Peewee's connect() waits for a check-in, up to its timeout:
                # while the listener claims one, the next goes to it.
                raise MaxConnectionsExceeded("held for the change feed's listener")
            conn = super()._connect()
            self._idle_since.pop(self.conn_key(conn), None)
            return conn

    def _close(self, conn: Any, close_conn: bool = False) -> None:
        with self._pool_lock:
            super()._close(conn, close_conn)
            key = self.conn_key(conn)
            if any(self.conn_key(idle) == key for _, _, idle in self._connections):
                self._idle_since[key] = self._clock()
            else:
                self._idle_since.pop(key, None)
            if self._claims:
                # Peewee wakes one waiter; it must be the listener's.
                self._pool_available.notify_all()

    def would_wait(self) -> bool:
        """Whether this thread's next connection would wait for one in use
        because the pool is held (none idle, none open here): for what is
        not worth that wait (a session event, a fence)."""
        with self._pool_lock:
            return bool(
                self.is_closed() and (self._claims or (self.held and not self._connections))
            )

    def idle_count(self) -> int:
        with self._pool_lock:
            return len(self._connections)

    def reap(self, idle_seconds: float | None = None) -> int:
        """Close the connections idle longer than idle_seconds (the pool's
        own by default); how many."""
        limit = self.idle_seconds if idle_seconds is None else idle_seconds
        with self._pool_lock:
            cutoff = self._clock() - limit
            keep: list[tuple[float, int, Any]] = []
            drop: list[tuple[float, int, Any]] = []
            for entry in self._connections:
                since = self._idle_since.get(self.conn_key(entry[2]), float("-inf"))
                (drop if since <= cutoff else keep).append(entry)
            if not drop:
                return 0
            heapq.heapify(keep)
            self._connections = keep
            for _, _, conn in drop:
                self._idle_since.pop(self.conn_key(conn), None)
                self._close_raw(conn)
            return len(drop)

    def surrender(self, timeout: float) -> Any | None:
        """The listener found no free slot: hand it a connection of this
        pool, the first idle one or the next one checked in (no call gets
        one meanwhile), within timeout; None when the pool has none at all
        or none came back in time. The connection leaves the pool for good."""
        deadline = time.monotonic() + timeout
        with self._pool_lock:
            self._claims += 1
            try:
                while True:
                    while self._connections:
                        _, _, conn = heapq.heappop(self._connections)
                        self._idle_since.pop(self.conn_key(conn), None)
                        if not self._is_closed(conn):
                            return conn
                    remaining = deadline - time.monotonic()
                    if not self._in_use or remaining <= 0:
                        return None
                    self._pool_available.wait(min(remaining, 1.0))
            finally:
                self._claims -= 1
                self._pool_available.notify_all()

    def make_room(self) -> int:
        """The listener found no free slot: give back every idle connection
        and take no new one until release(); how many were closed."""
        with self._pool_lock:
            self.held = True
            return self.reap(0.0)

    def release(self) -> None:
        with self._pool_lock:
            if self.held:
                self.held = False
                self._pool_available.notify_all()
