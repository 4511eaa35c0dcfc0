"""Change feeds: how one process hears about writes another process made.

Every write advances its partition's generation in the database (see
sidecar._backend). A feed delivers those generations to sidecar.partitions,
which then knows which cached partitions and snapshots are stale, so a cached turn
still runs no query at all.

- SQLite (sidecar._sqlite): a background thread polls `PRAGMA data_version`
  on a connection of its own; when another connection has committed, it
  reads the state rows whose generation passed its watermark.
- PostgreSQL (sidecar._postgres): LISTEN on a dedicated connection; writes
  NOTIFY inside their transaction. After a reconnect it re-LISTENs, then
  re-reads every state row once. A heartbeat proves the connection alive.

A feed is *verified* while its last successful cycle is recent. While it is
not (a dead listener, a poller that keeps failing), the engine reads the
generations of the partitions a call uses from the database before trusting
its caches: slower, never stale.

Owns: the ChangeFeed base: its thread, steppable cycle, verified/stale verdict,
counters, and the OnChange type. Must not touch: SQL or a driver (the subclasses
in sidecar._sqlite and sidecar._postgres do), the caches it informs (it only
calls the callback it is given), gRPC.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable
from typing import ClassVar

from sidecar.errors import Unavailable

log = logging.getLogger(__name__)

# (owner, tier, generation, erased) of a partition some process has written:
# erased is the generation of its last erasure (0 for none), so every
# replica drops what showed erased content (sidecar.erasure).
OnChange = Callable[[str, str, int, int], None]
_NEVER = float("-inf")
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_change = on_change
        self.interval = interval
        self._stale_after = stale_after
        self._clock = clock
        self._last_ok = _NEVER
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Seen by metrics and tests.
        self.failures = 0
        self.connects = 0
        # Failed cycles in a row: the back-off, and when to warn again.
        self._streak = 0
        self._warned = _NEVER

    # True: a cycle returns at once and the thread sleeps between cycles.
    # False: a cycle itself blocks until news or the interval has passed.
    polls: ClassVar[bool] = True

    @property
    def verified(self) -> bool:
        """Whether every write committed more than a moment ago has been delivered."""
        return self._clock() - self._last_ok < self._stale_after

    def start(self) -> None:
        """Connect in the caller's thread (so start-up fails loudly), then run."""
        try:
            self._open()
        except Exception as exc:
            self._close()
            raise Unavailable(
                f"cannot start the change feed: {exc}", reason="DATABASE_UNAVAILABLE"
            ) from exc
        self._last_ok = self._clock()
        self._thread = threading.Thread(target=self._run, name="change-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
        self._close()

    def run_once(self) -> None:
        # A successful cycle proves delivered what was committed before it
        # began, not before it ended: `verified` then means every write older
        # than stale_after was delivered (sidecar.forgetting relies on it).
        started = self._clock()
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
            self.run_once()
            if self.polls or not self.verified:
                # The poll interval, or a back-off before reconnecting; a stop
                # wakes the thread at once.
                self._stop.wait(self.retry_seconds)

    @property
    def settle_seconds(self) -> float:
        """How long after a commit every feed with these settings has either
        delivered it or stopped being verified (and then checks the
        database before trusting its caches): stale_after, and one interval
        more (see sidecar.forgetting.Forgetting.settle)."""
        return self._stale_after + self.interval

    def _deliver(self, owner: str, tier: str, generation: int, erased: int = 0) -> None:
        self._on_change(owner, tier, generation, erased)

    @abc.abstractmethod
    def _open(self) -> bool:
        """Connect and catch up, unless connected already; whether it connected."""

    @abc.abstractmethod
    def _cycle(self) -> bool:
        """Deliver the news; whether the path to the database was proved alive."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Drop the connection; the next cycle reconnects."""
