"""Group commit: writes of this process that arrive while another write
commits share the next write transaction and its commit.

On SQLite every write transaction takes the database's one write lock
(BEGIN IMMEDIATE), so concurrent writers only ever queue for it, and a
writer that finds it taken sleeps in SQLite's busy handler (1 ms, then
longer) rather than waking when it is free. Here they queue in the process
instead: the first writer leads at once (a lone write waits for no
window), and the writes that arrive while its transaction runs are run by
the next leader, one after another, in one transaction on one connection.

Each write of a group runs in a SAVEPOINT of its own: a refusal (budget,
duplicate, caller gone: any SidecarError the write raises) rolls back that
write only and becomes its caller's error, while the writes after it see
the ones before it (a budget is checked against the group's earlier
writes; an idempotency key retried within the group finds the first's
row). Every caller hears back only after the commit returns: if the commit
fails, every write of the group fails with its error and none is
acknowledged. The lead passes on as soon as the commit returns: the next
group's transaction runs while this group's callers' `after`s (the caches
above) are applied, in order, each group's only after the group before's.
A write that fails otherwise (a driver error: the disk full, an I/O error)
ends the group's transaction: it gets its error, and the other writes run
again, each in a transaction of its own, as without grouping.

Owns: GroupCommit (the queue of pending writes, the hand-over of the lead,
the group's transaction and savepoints, when each caller hears back) and
its counts. Must not touch: what a write does (sidecar.storage.store hands
each write in as a function), the caches above the storage layer (each
caller updates them after its own write returns, as without grouping), and
the backend's SQL.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from sidecar.core.errors import SidecarError
from sidecar.storage._backend import Backend

T = TypeVar("T")

# Writes per transaction at most: bounds how long the write lock is held
# and how long the last write of a group waits for the first.
MAX_GROUP = 64


_waiters = threading.local()


def _waiter() -> threading.Lock:
    """This thread's lock to wait on, held whenever the thread is not
    waiting: one per thread, rather than an Event (a Condition, and a lock
    per wait) per write."""
    lock: threading.Lock | None = getattr(_waiters, "lock", None)
    if lock is None:
        lock = _waiters.lock = threading.Lock()
        lock.acquire()
    return lock


class _Pending:
    """One caller's write: its function, and, once done, its outcome."""

    __slots__ = ("after", "error", "finished", "value", "wake", "write")

    def __init__(self, write: Callable[[], Any], after: Callable[[Any], None] | None) -> None:
        self.write = write
        self.after = after
        self.value: Any = None
        self.error: BaseException | None = None
        # A follower's (a leader never waits): released once, when the
        # outcome is known or when this caller is to lead (see _waiter).
        self.wake: threading.Lock | None = None
        self.finished = False

    def done(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error, self.finished = value, error, True

    def committed(self, value: Any) -> None:
        """Done, its transaction committed: its `after` first (an error
        there is the caller's, as it would be after a write alone)."""
        try:
            if self.after is not None:
                self.after(value)
        except Exception as exc:
            self.done(error=exc)
        else:
            self.done(value)

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class GroupCommit:
    """Runs writes, each a function to call inside a write transaction,
    alone or grouped with the writes that arrive while one commits.

    `enabled` False runs every write in a transaction of its own, as before
    grouping. `on_group` hears the number of writes of each commit.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        enabled: bool = True,
        max_group: int = MAX_GROUP,
        on_group: Callable[[int], None] | None = None,
    ) -> None:
        self._backend = backend
        self._db = backend.db
        self.enabled = enabled
        self._max = max(1, max_group)
        self.on_group = on_group
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._leading = False
        # Held by a leader from its commit to the end of its group's
        # `after`s. Taken before the lead passes on, so the next group's
        # `after`s wait for these: a cached partition takes its writes in
        # generation order (one out of order would leave it to reload).
        self._applying = threading.Lock()
        # Commits of writes, and the writes they held (what the tests and
        # the bench read: how much grouping happened).
        self.commits = 0
        self.writes = 0
        self.largest = 0

    def waiting(self) -> int:
        """Writes queued for the next group (not yet taken by a leader)."""
        with self._lock:
            return len(self._queue)

    def run(self, write: Callable[[], T], after: Callable[[T], None] | None = None) -> T:
        """Run `write` inside a write transaction; return what it returns,
        or raise what it raised, once its transaction has committed.

        `after(value)` runs once the transaction has committed and before
        any caller of the group hears back, in the order of the group's
        writes, and only after the groups before have run theirs: what
        this process caches of the write is updated there (a caller of a
        grouped write would otherwise update it after a later write of the
        group, or of the next group, had)."""
        if not self.enabled:
            pending = _Pending(write, after)
            pending.committed(self._alone(write))
            return cast(T, pending.outcome())
        pending = _Pending(write, after)
        with self._lock:
            self._queue.append(pending)
            lead = not self._leading
            self._leading = True
            if not lead:
                pending.wake = wake = _waiter()
        if not lead:
            wake.acquire()
        if not pending.finished:
            # First in, or handed the lead by the leader before: run the
            # writes waiting now, this one among them.
            self._lead(pending)
        return cast(T, pending.outcome())

    def _lead(self, own: _Pending) -> None:
        with self._lock:
            group = self._queue[: self._max]
            del self._queue[: self._max]
        applying = False
        try:
            committed = self._commit(group)
            self._applying.acquire()
            applying = True
            self._pass_lead()
            # The next transaction runs meanwhile (SQLite's calls release
            # the GIL); every caller still hears back only once its `after`
            # has run.
            for pending, value in committed:
                pending.committed(value)
        finally:
            if applying:
                self._applying.release()
            else:
                self._pass_lead()
            for pending in group:
                if not pending.finished:  # pragma: no cover - _commit finishes every one
                    pending.done(error=RuntimeError("the write's group ended without it"))
                if pending.wake is not None and pending is not own:
                    pending.wake.release()

    def _pass_lead(self) -> None:
        """Wake the first write queued meanwhile to lead the next group."""
        with self._lock:
            successor = self._queue[0] if self._queue else None
            self._leading = successor is not None
        if successor is not None and successor.wake is not None:
            successor.wake.release()

    def _commit(self, group: list[_Pending]) -> list[tuple[_Pending, Any]]:
        """Run the group's writes and commit them; finish every one but
        those committed, which it returns with their values (their
        `after`s are still to run)."""
        committed: list[tuple[_Pending, Any]] = []
        if len(group) == 1:
            self._finish_alone(group[0], committed)
        else:
            self._together(group, committed)
        with self._lock:
            self.commits += 1
            self.writes += len(group)
            self.largest = max(self.largest, len(group))
        if self.on_group is not None:
            # Every write is finished and committed: a failing observer
            # must not turn an acknowledged write into an error.
            with contextlib.suppress(Exception):
                self.on_group(len(group))
        return committed

    def _alone(self, write: Callable[[], T]) -> T:
        """A write in a transaction of its own (no savepoint: its error
        rolls the whole transaction back)."""
        backend = self._backend
        with backend.guard(), self._db.connection_context(), backend.write_transaction():
            return write()

    def _finish_alone(self, pending: _Pending, committed: list[tuple[_Pending, Any]]) -> None:
        try:
            value = self._alone(pending.write)
        except Exception as exc:
            pending.done(error=exc)
        else:
            committed.append((pending, value))

    def _together(self, group: list[_Pending], committed: list[tuple[_Pending, Any]]) -> None:
        """One transaction for the group, a savepoint per write."""
        results: list[tuple[_Pending, Any, BaseException | None]] = []
        broken: _Pending | None = None
        try:
            backend = self._backend
            with backend.guard(), self._db.connection_context(), backend.write_transaction():
                for pending in group:
                    try:
                        with self._db.savepoint():
                            results.append((pending, pending.write(), None))
                    except SidecarError as refused:
                        # Its own changes are rolled back; the group goes on.
                        results.append((pending, None, refused))
                    except Exception:
                        broken = pending
                        raise
        except Exception as exc:
            if broken is None:
                # The commit failed (or the transaction could not start):
                # nothing of the group is durable, so nothing is acknowledged.
                for pending in group:
                    pending.done(error=exc)
                return
            # Not a refusal: the write may have ended the transaction
            # (SQLite rolls back by itself on a full disk). It fails as it
            # would alone; the others were not committed, and run again.
            broken.done(error=exc)
            for pending in group:
                if pending is not broken:
                    self._finish_alone(pending, committed)
            return
        for pending, value, error in results:
            if error is None:
                committed.append((pending, value))
            else:
                pending.done(error=error)
