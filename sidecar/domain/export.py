"""Exports: which partitions an ExportMemories stream reads, and how many
streams may read at once.

An export reads straight from the database (sidecar.storage.archive.exported: one
read transaction, keyset batches), never from the cached partitions: it
must see every entry as of one snapshot, not what this replica happens to
hold. A stream holds a gRPC worker thread and a pooled connection for as
long as it runs, so only `max_concurrent` run at once and one more is
refused rather than queued: the client retries, and turns keep their
workers.

A stream already running over a partition erased meanwhile (ForgetUser,
DeleteScope) must not go on sending the erased entries from its snapshot:
the erasures this process handles (its own, and other processes' through
the change feed: Partitions.on_erased, wired by sidecar.domain.rooms) are
counted for the partitions being exported, and a stream checks them between
responses (`erased_since`). An erasure the stream's snapshot already missed ends it
too: rare, and the client's retry exports what is left.

Owns: resolving an export's partitions (a scope's tiers, or one user's
profile), the cap on concurrent exports, the erasures of what is being
exported. Must not touch: grpc or protobuf
(sidecar.api.export renders), Peewee or SQL (sidecar.storage.archive reads),
the caches of sidecar.domain.partition.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence

from sidecar.core.errors import Reason, ResourceExhausted
from sidecar.core.memory import Memory, Scope, Tier
from sidecar.storage import archive
from sidecar.storage.store import Store

Partition = tuple[str, Tier]


class Exports:
    """The export streams of one engine (one daemon).

    >>> exports = Exports(store, max_concurrent=2)
    >>> with exports.slot():
    ...     for owner, memory in exports.entries(exports.partitions(scope, (Tier.USER,)), [0], 500):
    ...         ...
    """

    def __init__(self, store: Store, max_concurrent: int) -> None:
        self._store = store
        self._max = max_concurrent
        self._running = 0
        self._lock = threading.Condition()
        # Per partition some stream reads now: how many streams read it, and
        # how many erasures of it were heard of since the first began
        # (bounded by what is being exported).
        self._readers: Counter[Partition] = Counter()
        self._erasures: Counter[Partition] = Counter()

    @property
    def running(self) -> int:
        """Export streams holding a slot now."""
        return self._running

    @staticmethod
    def partitions(
        scope: Scope, tiers: Sequence[Tier], *, for_user: bool = False
    ) -> list[Partition]:
        """(owner, tier) of what to export: the scope's tiers, or with
        `for_user` the user tier of scope.user_id and the agent notes
        written for that user (archive.written_for). The user tier is
        keyed by the user, not the agent, so that one partition holds every
        entry any agent stored in the user's profile."""
        if for_user:
            # And the agent notes written for the user (their agents' own).
            return [(scope.user_id, Tier.USER), archive.written_for(scope.user_id)]
        return [(scope.owner(tier), tier) for tier in tiers]

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Held for a stream's whole run; RESOURCE_EXHAUSTED (EXPORTS_BUSY)
        when `max_concurrent` streams hold one already."""
        with self._lock:
            if self._running >= self._max:
                raise ResourceExhausted(
                    f"{self._running} exports are running, the most server.max_concurrent_exports "
                    "allows; retry when one has finished",
                    reason=Reason.EXPORTS_BUSY,
                    metadata={"max": self._max},
                )
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._lock.notify_all()

    @contextlib.contextmanager
    def reading(self, partitions: Sequence[Partition]) -> Iterator[Callable[[], Partition | None]]:
        """Held while a stream reads these partitions: yields a check, the
        partition erased since the block began (None if none was)."""
        keys = set(partitions)
        with self._lock:
            self._readers.update(keys)
            began = {key: self._erasures[key] for key in keys}

        def erased_since() -> Partition | None:
            with self._lock:
                return next((key for key in keys if self._erasures[key] != began[key]), None)

        try:
            yield erased_since
        finally:
            with self._lock:
                self._readers.subtract(keys)
                for key in keys:
                    if self._readers[key] <= 0:
                        del self._readers[key]
                        self._erasures.pop(key, None)

    def erased(self, key: tuple[Tier, str], generation: int, followed: bool) -> int:
        """A listener of Partitions.on_erased: the partition (tier, owner)
        was erased; no session is dropped here (0)."""
        partition = (key[1], key[0])
        with self._lock:
            if partition in self._readers:
                self._erasures[partition] += 1
        return 0

    def drain(self, timeout: float) -> bool:
        """Wait until no stream holds a slot, up to `timeout` seconds; whether
        none does. For stopping: a cancelled stream lets go at its next
        response, and the store must not close under its read."""
        with self._lock:
            return self._lock.wait_for(lambda: self._running == 0, timeout)

    def entries(
        self, partitions: Sequence[Partition], after: Sequence[int], batch: int
    ) -> Generator[tuple[str, Memory]]:
        """(owner, memory) of each partition with a seq above that
        partition's in `after`, in insertion order, from one snapshot, read
        `batch` rows at a time. Holds a connection until exhausted or closed
        (close it on the thread that iterated it)."""
        return archive.exported(self._store, partitions, after, batch)
