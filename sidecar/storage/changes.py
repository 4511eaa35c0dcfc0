"""Change feeds: how one process hears about writes another process made.

Every write advances its partition's generation in the database (see
sidecar.storage._backend). A feed delivers those generations to sidecar.domain.partition,
which then knows which cached partitions and snapshots are stale, so a cached turn
still runs no query at all.

- SQLite (sidecar.storage._sqlite): a background thread polls `PRAGMA data_version`
  on a connection of its own; when another connection has committed, it
  reads the state rows whose generation passed its watermark.
- PostgreSQL (sidecar.storage._postgres): LISTEN on a dedicated connection; writes
  NOTIFY inside their transaction. After a reconnect it re-LISTENs, then
  re-reads every state row once. A heartbeat proves the connection alive.

A feed is *verified* while its last successful cycle is recent. While it is
not (a dead listener, a poller that keeps failing), the engine reads the
generations of the partitions a call uses from the database before trusting
its caches: slower, never stale.

A feed also carries session events (a compaction or an end of session sent
to some replica: `publish`, `on_session`), and knows how far it has
`applied` the database's generations. `fence()` asks it to prove it has
delivered every write committed before the call: SQLite polls at once;
PostgreSQL sends a notification of its own, which arrives after every
notification committed before it (sidecar.domain.replication waits on it).

Owns: the ChangeFeed base: its thread, steppable cycle, verified/stale verdict,
counters, the applied generation and fences, session events' delivery, and
the OnChange and OnSession types. Must not touch: SQL or a driver (the subclasses
in sidecar.storage._sqlite and sidecar.storage._postgres do), the caches it informs (it only
calls the callback it is given), gRPC.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import ClassVar

from sidecar.core.errors import DatabaseUnavailable, SidecarError

log = logging.getLogger("sidecar.changes")

# (owner, tier, generation, erased) of a partition some process has written:
# erased is the generation of its last erasure (0 for none), so every
# replica drops what showed erased content (sidecar.storage.erasure).
OnChange = Callable[[str, str, int, int], None]
# (kind, agent_id, user_id, session_id) of a session event another replica
# published: kind is "compaction" or "end".
OnSession = Callable[[str, str, str, str], None]
_NEVER = float("-inf")


def session_payload(origin: str, kind: str, agent_id: str, user_id: str, session: str) -> str:
    """A session event as published (sidecar.storage._sqlite, sidecar.storage._postgres)."""
    return json.dumps(["session", origin, kind, agent_id, user_id, session])


# A failing feed retries for ever, doubling its wait from one interval up to
# this (or one interval, if longer), and warns at most this often.
BACKOFF_CAP_SECONDS = 5.0
_WARN_EVERY_SECONDS = 60.0


class ChangeFeed(abc.ABC):
    """A background thread that delivers other processes' writes.

    Steppable: `run_once()` runs one cycle (wait for news up to the interval,
    deliver it, prove the path alive), so tests can drive a feed without its
    thread. `stale_after` seconds without a successful cycle make the feed
    unverified.
    """

    def __init__(
        self,
        on_change: OnChange,
        *,
        interval: float,
        stale_after: float,
        publish: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        on_session: OnSession | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> None:
        # Whom the feed tells, given here and never attached later: a
        # listener set after start() could miss the first cycle's news.
        self._on_change = on_change
        # Sends a payload to every feed of the database (the backend's).
        self._send = publish
        self.interval = interval
        self._stale_after = stale_after
        self._clock = clock
        self._last_ok = _NEVER
        self._stop = threading.Event()
        # Set by a fence: the poll that sleeps between cycles runs at once.
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # start() and stop() agree on whether the thread runs.
        self._life = threading.Lock()
        # Seen by metrics and tests.
        self.failures = 0
        self.connects = 0
        # This feed's name in what it publishes: its own events come back
        # to it (PostgreSQL) and are skipped.
        self.origin = uuid.uuid4().hex[:16]
        self._on_session = on_session
        # Told when news may have been lost (a reconnect of a feed whose
        # session events are not kept): every session rebuilds.
        self._on_resync = on_resync
        # The newest generation delivered; fences issued and proved. All
        # three only grow, under _caught_up.
        self.applied = 0
        self._issued = 0
        self._fenced = 0
        self._caught_up = threading.Condition()
        # Failed cycles in a row: the back-off, and when to warn again.
        self._streak = 0
        self._warned = _NEVER

    # True: a cycle returns at once and the thread sleeps between cycles.
    # False: a cycle itself blocks until news or the interval has passed.
    polls: ClassVar[bool] = True
    # True: generations are delivered in the order they were drawn (SQLite's
    # one writer), so `applied` >= g means g was delivered. False
    # (PostgreSQL: a sequence drawn before commit): only a fence proves it.
    ordered: ClassVar[bool] = True

    @property
    def verified(self) -> bool:
        """Whether every write committed more than a moment ago has been delivered."""
        return self._clock() - self._last_ok < self._stale_after

    def verified_for(self) -> float:
        """Seconds until the feed turns unverified unless a cycle succeeds."""
        return self._last_ok + self._stale_after - self._clock()

    def start(self) -> None:
        """Connect in the caller's thread (so start-up fails loudly), then run.

        A SidecarError keeps its class and reason (DATABASE_BUSY for no free
        slot is retried at start-up, a refused login is not); anything else
        is DATABASE_UNAVAILABLE. Refused once stopped: a start-up attempt
        left behind by a stop must not leave a connection open."""
        if self._stop.is_set():
            raise DatabaseUnavailable("the change feed was stopped")
        try:
            self._open()
        except SidecarError:
            self._close()
            raise
        except Exception as exc:
            self._close()
            raise DatabaseUnavailable(f"cannot start the change feed: {exc}") from exc
        with self._life:
            if self._stop.is_set():  # stopped while it connected
                self._close()
                raise DatabaseUnavailable("the change feed was stopped")
            self._last_ok = self._clock()
            self._thread = threading.Thread(target=self._run, name="change-feed", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._life:
            self._stop.set()
            self._wake.set()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=self.interval + 5)
        self._close()

    def run_once(self) -> None:
        # A successful cycle proves delivered what was committed before it
        # began, not before it ended: `verified` then means every write older
        # than stale_after was delivered (sidecar.domain.erasure relies on it).
        started = self._clock()
        # Fences issued before this cycle began are proved by it (a poller:
        # it reads everything committed before it began).
        with self._caught_up:
            issued = self._issued
        try:
            opened = self._open()
            alive = self._cycle() or opened
        except Exception as exc:
            self.failures += 1
            self._streak += 1
            self._last_ok = _NEVER
            # One line per outage (and a reminder a minute), not per retry.
            if self._streak == 1 or self._clock() - self._warned >= _WARN_EVERY_SECONDS:
                self._warned = self._clock()
                log.warning(
                    "change feed failed (%s); caches are checked against the database"
                    " until it is back (retrying)",
                    exc,
                )
            self._close()
            return
        if self._streak:
            log.info("change feed back after %d failed attempts", self._streak)
            self._streak = 0
        if alive:
            self._last_ok = started
        if self.polls:
            self._proved(issued)

    @property
    def retry_seconds(self) -> float:
        """How long to wait before the next cycle after this many failures:
        one interval, doubling, capped."""
        if not self._streak:
            return self.interval
        cap = max(self.interval, BACKOFF_CAP_SECONDS)
        return float(min(cap, self.interval * 2 ** min(self._streak - 1, 16)))

    def _run(self) -> None:
        while not self._stop.is_set():
            # Cleared before the cycle: a fence set during it runs another.
            self._wake.clear()
            self.run_once()
            if self.polls or not self.verified:
                # The poll interval, or a back-off before reconnecting; a stop
                # or a fence wakes the thread at once.
                self._wake.wait(self.retry_seconds)

    # --- how far this replica has caught up -------------------------------------

    def delivered(self, generation: int) -> bool:
        """Whether every write up to `generation` is known delivered, without
        asking the database. Only an ordered feed knows: on PostgreSQL a
        smaller generation may commit after a larger one has arrived, and a
        write of this process's own says nothing of other processes' earlier
        ones (a fence proves every committed write)."""
        with self._caught_up:
            return self.ordered and self.applied >= generation

    def fence(self) -> int:
        """Ask the feed to prove it has delivered every write committed before
        now; the ticket to `wait` for (may raise the store's errors)."""
        with self._caught_up:
            self._issued += 1
            ticket = self._issued
        self._request_fence(ticket)
        return ticket

    def wait(self, ticket: int, generation: int, timeout: float) -> bool:
        """Wait (at most `timeout` s) until the fence `ticket` is proved and
        `generation` applied; whether it happened. Woken by the feed's news."""
        with self._caught_up:
            return self._caught_up.wait_for(
                lambda: self._fenced >= ticket and self.applied >= generation,
                timeout=max(0.0, timeout),
            )

    def _applied_through(self, generation: int) -> None:
        """Every write up to `generation` is delivered (a poller's first
        contact: nothing is cached yet)."""
        with self._caught_up:
            if generation > self.applied:
                self.applied = generation
                self._caught_up.notify_all()

    def _proved(self, ticket: int) -> None:
        with self._caught_up:
            if ticket > self._fenced:
                self._fenced = ticket
                self._caught_up.notify_all()

    def _request_fence(self, ticket: int) -> None:
        # A poller: its next cycle, which begins after this call, proves it.
        self._wake.set()

    def publish(self, kind: str, agent_id: str, user_id: str, session: str) -> None:
        """Tell every other replica of a session event (may raise the store's
        errors)."""
        self._send(session_payload(self.origin, kind, agent_id, user_id, session))

    def _session_event(self, payload: str) -> None:
        """Deliver a session event (see session_payload) or, on PostgreSQL, a
        fence of this feed's (["fence", origin, ticket])."""
        try:
            what, origin, *rest = json.loads(payload)
            if origin == self.origin:
                if what == "fence":
                    self._proved(int(rest[0]))
                return
            if what == "session" and self._on_session is not None:
                kind, agent_id, user_id, session = rest
                self._on_session(str(kind), str(agent_id), str(user_id), str(session))
        except (ValueError, TypeError) as exc:
            # Anyone who can reach the database can send one: a bad payload
            # must not take the feed down with it.
            log.warning("ignored a malformed session event (%s): %.200r", exc, payload)

    def _resync(self) -> None:
        if self._on_resync is not None:
            self._on_resync()

    @property
    def settle_seconds(self) -> float:
        """How long after a commit every feed with these settings has either
        delivered it or stopped being verified (and then checks the
        database before trusting its caches): stale_after, and one interval
        more (see sidecar.domain.erasure.Forgetting.settle)."""
        return self._stale_after + self.interval

    def _deliver(self, owner: str, tier: str, generation: int, erased: int = 0) -> None:
        self._on_change(owner, tier, generation, erased)
        # After the callback: a read woken by it finds the caches informed.
        with self._caught_up:
            if generation > self.applied:
                self.applied = generation
                self._caught_up.notify_all()

    @abc.abstractmethod
    def _open(self) -> bool:
        """Connect and catch up, unless connected already; whether it connected."""

    @abc.abstractmethod
    def _cycle(self) -> bool:
        """Deliver the news; whether the path to the database was proved alive."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Drop the connection; the next cycle reconnects."""
