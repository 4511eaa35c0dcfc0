"""Exports: which partitions an ExportMemories stream reads, and how many
streams may read at once.

An export reads straight from the database (sidecar.archive.exported: one
read transaction, keyset batches), never from the cached partitions: it
must see every entry as of one snapshot, not what this replica happens to
hold. A stream holds a gRPC worker thread and a pooled connection for as
long as it runs, so only `max_concurrent` run at once and one more is
refused rather than queued: the client retries, and turns keep their
workers.

Owns: resolving an export's partitions (a scope's tiers, or one user's
profile), the cap on concurrent exports. Must not touch: grpc or protobuf
(sidecar.export_stream renders), Peewee or SQL (sidecar.archive reads),
the caches of sidecar.partitions.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator, Iterator, Sequence

from sidecar import archive
from sidecar.errors import ResourceExhausted
from sidecar.memory import Memory, Scope, Tier
from sidecar.store import Store

Partition = tuple[str, Tier]


class Exports:
    """The export streams of one engine (one daemon).

    >>> exports = Exports(store, max_concurrent=2)
    >>> with exports.slot():
    ...     for owner, memory in exports.entries(exports.partitions(scope, (Tier.USER,)), 0, 500):
    ...         ...
    """

    def __init__(self, store: Store, max_concurrent: int) -> None:
        self._store = store
        self._max = max_concurrent
        self._running = 0
        self._lock = threading.Condition()

    @property
    def running(self) -> int:
        """Export streams holding a slot now."""
        return self._running

    @staticmethod
    def partitions(
        scope: Scope, tiers: Sequence[Tier], *, for_user: bool = False
    ) -> list[Partition]:
        """(owner, tier) of what to export: the scope's tiers, or with
        `for_user` the user tier of scope.user_id alone. The user tier is
        keyed by the user, not the agent, so that one partition holds every
        entry any agent stored in the user's profile."""
        if for_user:
            return [(scope.user_id, Tier.USER)]
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
                    reason="EXPORTS_BUSY",
                    metadata={"max": self._max},
                )
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._lock.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until no stream holds a slot, up to `timeout` seconds; whether
        none does. For stopping: a cancelled stream lets go at its next
        response, and the store must not close under its read."""
        with self._lock:
            return self._lock.wait_for(lambda: self._running == 0, timeout)

    def entries(
        self, partitions: Sequence[Partition], after_seq: int, batch: int
    ) -> Generator[tuple[str, Memory]]:
        """(owner, memory) of the partitions with a seq above `after_seq`, in
        insertion order, from one snapshot, read `batch` rows at a time.
        Holds a connection until exhausted or closed (close it on the thread
        that iterated it)."""
        return archive.exported(self._store, partitions, after_seq, batch)
