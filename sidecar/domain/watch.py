"""Watches: WatchMemories' live streams, what wakes them, and the event
log's retention.

A watch reads a scope's events from the event log (sidecar.storage.events, the
store's `events`) in bounded batches, from a generation on, and then stays
live. Nothing is queued in memory: the log is the buffer, and a watch holds
at most one batch. It is woken by every generation change of a partition
it watches, which sidecar.domain.partition reports (`wake`) from the one place
both kinds arrive: this process's writes, after their commit, and the
change feed's news of other processes' writes (other replicas through
PostgreSQL's NOTIFY, other processes through SQLite's data_version poller).
A wake only says "read the log": a lost or early one costs a read, never an
event. While the feed is unverified, a watch polls the log instead.

A watcher that falls more than `watch_buffer_events` behind what the log
holds for it is ended (WATCH_TOO_SLOW) with the generation to resume from,
checked after each batch is sent: a stalled consumer blocks its stream's
sends, and the count is made as soon as they return. At most
`server.max_watches` streams run at once, since each holds a gRPC worker
thread for its whole life.

Bookmarks: the horizon follows the whole database's writes, so a scope
idle for longer than the retention would find its own last generation
below it. An idle watch therefore reads up to the settled bound every
`server.watch_bookmark_seconds` (its cursor moves past other scopes'
generations when none of its own lie between) and sends a Sync with the
new cursor: the client's resume point is never older than that.

Retention: `Retention.run_once(now)` deletes events older than
`server.event_retention_seconds` in bounded batches and raises the log's
horizon; a resume from before the horizon is refused rather than silently
missing events.

Owns: the watch registry and its cap, the wake-ups, a watch's read loop,
lag and horizon checks, the retention loop. Must not touch: gRPC and
protobuf (sidecar.api.watch renders), SQL (sidecar.storage.events), the
partition cache (it is only told of generations).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from datetime import datetime, timedelta
from typing import NamedTuple, Protocol

from sidecar.config.settings import ServerSettings
from sidecar.core.clock import Clock, system_clock, to_micros
from sidecar.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    Reason,
    ResourceExhausted,
    SidecarError,
    Unavailable,
)
from sidecar.core.memory import Scope, Tier
from sidecar.core.metrics import Metrics
from sidecar.storage.events import Event, EventLog

log = logging.getLogger("sidecar.watches")

Key = tuple[Tier, str]
# Events read from the log at a time, at most (fewer with a smaller buffer).
BATCH_EVENTS = 256
# How long a watch sleeps between looks at its cancellation and the server's
# stop when nothing wakes it; with an unverified feed, how often it polls.
IDLE_SECONDS = 1.0
POLL_SECONDS = 0.25


class Verifying(Protocol):
    """What says whether the change feed can be trusted (sidecar.domain.partition)."""

    @property
    def verified(self) -> bool: ...


class Sync(NamedTuple):
    """Where the stream stands: the first answer of a watch from now on,
    and an idle watch's bookmark (every event of the scope up to it sent)."""

    generation: int


class Watches:
    """This process's watches: the registry, its cap, and the wake-ups."""

    def __init__(
        self,
        events: EventLog,
        server: ServerSettings,
        metrics: Metrics | None = None,
        feed: Verifying | None = None,
        *,
        clock: Clock = system_clock,
    ) -> None:
        self.log = events
        self.limit = server.watch_limit
        self.buffer = server.watch_buffer_events
        self.batch = min(self.buffer, BATCH_EVENTS)
        self.bookmark = server.watch_bookmark_seconds
        # Whether news of other processes' writes can be trusted (the
        # engine's partitions); without it this process is the only writer.
        self._feed = feed
        self._lock = threading.Lock()
        self._by_key: dict[Key, set[Watch]] = {}
        self._open: set[Watch] = set()
        self._stopping = False
        self.retention = Retention(events, server.event_retention_seconds, clock=clock)
        if metrics is not None:
            metrics.watches_open.set_function(lambda: len(self._open))

    def __len__(self) -> int:
        return len(self._open)

    def verified(self) -> bool:
        return self._feed is None or self._feed.verified

    def wake(self, key: Key, generation: int) -> None:
        """A partition's generation changed (sidecar.domain.partition calls this on
        every write of this process and every piece of the feed's news)."""
        # Most partitions nobody watches: one dictionary lookup, no lock.
        if key not in self._by_key:
            return
        with self._lock:
            for watch in self._by_key.get(key, ()):
                watch.signal.set()

    @contextlib.contextmanager
    def open(self, scope: Scope, tiers: Sequence[Tier]) -> Iterator[Watch]:
        """A watch of the scope's tiers, counted against max_watches while open."""
        watch = Watch(self, [(tier, scope.owner(tier)) for tier in tiers])
        with self._lock:
            if self._stopping:
                raise _stopping(None)
            if len(self._open) >= self.limit:
                raise ResourceExhausted(
                    f"this replica already serves {self.limit} watches (server.max_watches); "
                    "close one, or watch through another replica",
                    reason=Reason.WATCHES_EXHAUSTED,
                    metadata={"max_watches": self.limit},
                )
            self._open.add(watch)
            for key in watch.keys:
                self._by_key.setdefault(key, set()).add(watch)
        try:
            yield watch
        finally:
            with self._lock:
                self._open.discard(watch)
                for key in watch.keys:
                    watching = self._by_key.get(key)
                    if watching is not None:
                        watching.discard(watch)
                        if not watching:
                            del self._by_key[key]

    def start(self) -> None:
        self.retention.start()

    def stop(self, wait: bool = True) -> None:
        """End every watch (UNAVAILABLE, with where to resume) and refuse new
        ones, so the server's stop is not held up by streams that never end;
        stop the retention loop (`wait`: and wait for its pass under way)."""
        with self._lock:
            self._stopping = True
            for watch in self._open:
                watch.signal.set()
        self.retention.stop(wait)

    @property
    def stopping(self) -> bool:
        return self._stopping


def _stopping(generation: int | None) -> Unavailable:
    return Unavailable(
        "the server is stopping; watch again (through another replica)"
        + ("" if generation is None else f" with after_generation {generation}"),
        reason=Reason.SERVER_STOPPING,
        metadata={} if generation is None else {"resume_generation": generation},
    )


class Watch:
    """One stream: its partitions, its wake-up signal, its read loop."""

    def __init__(self, hub: Watches, keys: list[Key]) -> None:
        self._hub = hub
        self.keys = keys
        # Set by a wake, a cancel or the server's stop; cleared before each
        # read of the log, so news during a read is never lost.
        self.signal = threading.Event()
        self.cancelled = False

    def cancel(self) -> None:
        """The caller went away: end the loop now (a gRPC callback)."""
        self.cancelled = True
        self.signal.set()

    def events(self, after: int, within: Key | None = None) -> Iterator[Event | Sync]:
        """The scope's events after generation `after` (0: from now on,
        first a Sync), in generation order, then live until cancelled.
        With `within` (the tier and id of the last event received), the
        rest of generation `after` comes first: a stream cut inside it."""
        hub = self._hub
        if after < 0:
            raise _bad_generation(after)
        cursor, sent, began = yield from self._opening(after, within)
        # When the next bookmark is due (a monotonic time).
        due = time.monotonic() + hub.bookmark
        while True:
            self.signal.clear()
            through = hub.log.settled(self.keys)
            began = through if began is None else began
            caught = yield from self._caught_up(cursor, through, began, sent)
            if caught is None:
                return
            cursor, sent = caught
            if time.monotonic() >= due:
                # The client's resume point, if the cursor moved past it.
                if cursor > sent:
                    yield Sync(cursor)
                    sent = cursor
                due = time.monotonic() + hub.bookmark
            if not self._wait(cursor, due):
                return

    def _opening(
        self, after: int, within: Key | None
    ) -> Generator[Event | Sync, None, tuple[int, int, int | None]]:
        """The watch's first sends: a Sync at the settled bound from now on
        (`after` 0), else the rest of generation `after` if `within` says
        where a stream was cut. Returns the cursor, the generation last
        sent, and `began` when the watch began at the Sync."""
        log_ = self._hub.log
        # Events up to `began` were logged before the watch began: catching
        # up on them is never "too slow", however many there are. From now
        # on, that is the Sync point itself.
        if after == 0:
            cursor = log_.settled(self.keys)
            yield Sync(cursor)
            return cursor, cursor, cursor
        newest = log_.newest()
        if after > newest:
            raise FailedPrecondition(
                f"after_generation {after} is ahead of this database (its newest "
                f"generation is {newest}): it comes from another database, or one "
                "restored from a backup; export the scope and watch from now on (0)",
                reason=Reason.WATCH_GENERATION_AHEAD,
                metadata={"after_generation": after, "newest_generation": newest},
            )
        if within is not None:
            rest = log_.rest(self.keys, after, within)
            # Generation `after` itself must still be held.
            if rest.horizon >= after:
                raise _pruned(after, rest.horizon)
            yield from rest.events
        return after, after, None

    def _caught_up(
        self, cursor: int, through: int, began: int, sent: int
    ) -> Generator[Event, None, tuple[int, int] | None]:
        """The events after `cursor` up to `through`, a batch at a time;
        returns the cursor and the generation last sent, or None once the
        caller is gone. Ends the watch if the log was pruned past the
        cursor, the server stops, or the watcher falls too far behind."""
        hub = self._hub
        log_ = hub.log
        while cursor < through:
            batch = log_.read(self.keys, cursor, through, hub.batch)
            if batch.horizon > cursor:
                raise _pruned(cursor, batch.horizon)
            yield from batch.events
            if batch.events:
                sent = batch.events[-1].generation
            cursor = batch.through
            if self.cancelled:
                return None
            if hub.stopping:
                raise _stopping(cursor)
            # Every send of the batch has returned. With news since it
            # was read (or none to trust), count what was logged after
            # the watch began and not sent yet: the bounded buffer a
            # watcher that keeps up never fills.
            if self.signal.is_set() or not hub.verified():
                behind = log_.backlog(self.keys, max(cursor, began), hub.buffer + 1)
                if behind > hub.buffer:
                    raise _too_slow(cursor, hub.buffer)
        return cursor, sent

    def _wait(self, cursor: int, due: float) -> bool:
        """Sleep until woken or a bookmark is due; False when the caller
        went away."""
        while True:
            verified = self._hub.verified()
            nap = IDLE_SECONDS if verified else POLL_SECONDS
            woken = self.signal.wait(max(0.0, min(nap, due - time.monotonic())))
            if self.cancelled:
                return False
            if self._hub.stopping:
                raise _stopping(cursor)
            if woken or not verified or time.monotonic() >= due:
                return True


def _bad_generation(after: int) -> InvalidArgument:
    return InvalidArgument(
        f"after_generation must be 0 (from now on) or a generation received, got {after}",
        reason=Reason.GENERATION_INVALID,
        metadata={"field": "after_generation", "after_generation": after},
    )


def _pruned(after: int, horizon: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"the event log no longer holds the events after generation {after} (events up to "
        f"{horizon} were pruned, see server.event_retention_seconds): export the scope "
        "(ExportMemories), then watch from now on (after_generation 0, or the generation "
        "read before exporting)",
        reason=Reason.WATCH_GENERATION_PRUNED,
        metadata={"after_generation": after, "oldest_resumable_generation": horizon},
    )


def _too_slow(cursor: int, buffer: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"this watcher fell more than {buffer} events behind (server.watch_buffer_events); "
        f"watch again with after_generation {cursor} and read faster",
        reason=Reason.WATCH_TOO_SLOW,
        metadata={"resume_generation": cursor, "watch_buffer_events": buffer},
    )


class Retention:
    """Deletes events older than `seconds` (0: never), a batch at a time.

    Steppable: `run_once(now)`; `start` runs it every `interval` seconds on
    a thread of its own until `stop`.
    """

    def __init__(
        self,
        events: EventLog,
        seconds: int,
        *,
        batch: int = 1000,
        interval: float = 60.0,
        clock: Clock = system_clock,
    ) -> None:
        self._events = events
        self.seconds = seconds
        self._batch = batch
        self._interval = interval
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, now: datetime) -> int:
        """Prune every event logged before `now` minus the retention, one
        short transaction per batch; how many were deleted."""
        if not self.seconds:
            return 0
        before = to_micros(now - timedelta(seconds=self.seconds))
        total = 0
        while not self._stop.is_set():
            deleted, _horizon = self._events.prune(before, self._batch)
            total += deleted
            if deleted < self._batch:
                break
        return total

    def start(self) -> None:
        if not self.seconds or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="event-retention", daemon=True)
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop the loop; with `wait`, also wait for a pass under way (which
        may be waiting on a database lock for up to busy_timeout_ms)."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once(self._clock())
            except SidecarError as exc:  # a database fault: its reason says it all
                log.warning(
                    "pruning the event log failed: %s (%s); trying again in %.0f s",
                    exc,
                    exc.reason,
                    self._interval,
                )
            except Exception:
                # A loop that dies stops pruning for good; keep trying.
                log.exception("pruning the event log failed; trying again later")
            self._stop.wait(self._interval)
