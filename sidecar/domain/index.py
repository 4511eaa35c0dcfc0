"""The compact index's life: how a large tier is loaded, and when and on
which thread its index is persisted.

A tier of `server.compact_tier_entries` or more is held compactly
(sidecar.retrieval.compact). Loading one restores its persisted index and replays the
writes logged since (sidecar.retrieval.index_format), or indexes its rows when there
is no usable index. The index is saved again in the background, one thread
per partition, when it is missing or lacks many writes, and never sooner
after the last than INDEX_PACE times as long as that one took; a refused or
failed save backs off for INDEX_RETRY_SECONDS. stop() waits for saves under way, so
the store never closes under one.

Owns: the indexing threads and the back-off. Must not touch: the partition
cache or generations (sidecar.domain.partition decides what is current and caches
what this loads), rendering, ranking, or Peewee (the store's index methods
do the database side).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sidecar.core.errors import SidecarError
from sidecar.core.memory import Tier
from sidecar.retrieval import index_format
from sidecar.retrieval.compact import CompactPartition
from sidecar.storage.index import IndexSource
from sidecar.storage.store import Store

log = logging.getLogger("sidecar.indexer")
PartitionKey = tuple[Tier, str]
# A compact partition's index is persisted again once it lacks this many
# writes, or 1% of its entries if more: each load replays what it lacks.
INDEX_EVERY = 1000
INDEX_RETRY_SECONDS = 60.0
# A save costs in proportion to the tier (100,000 entries: about a second of
# CPU, much of it holding the GIL the requests need), and a tier written
# without pause is due again (1% of it) within seconds: saved back to back,
# it held up every write (AddMemory into 100,000 entries paid about a
# millisecond for it). So the next save of a partition waits INDEX_PACE
# times as long as its last took: saving takes at most 1/(INDEX_PACE + 1)
# of a core, and a load replays at most the writes of that rest more.
INDEX_PACE = 10.0


class Indexer:
    """Loads large tiers and keeps their persisted indexes current."""

    def __init__(
        self,
        store: Store,
        *,
        now: Callable[[], float] = time.monotonic,
        every: int = INDEX_EVERY,
        pace: float = INDEX_PACE,
    ) -> None:
        self._store = store
        self._now = now
        self._every, self._pace = every, pace
        # When each partition's next save may start (INDEX_PACE).
        self._rested: dict[PartitionKey, float] = {}
        # Partitions whose compact index is being persisted (one at a time
        # each), by the thread doing it; none start once stopping.
        self._threads: dict[PartitionKey, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopped = False

    def load(self, tier: Tier, owner: str) -> CompactPartition:
        """A large partition: from its persisted index and the writes logged
        since, or, without a usable one, from its rows. A damaged index is
        dropped, so that the index saved next replaces it; one that is only
        not this version's (another tokeniser or format: a rollout runs two
        versions on one database), or not read for a reason that says
        nothing about it (memory, the database), is left in place: dropping
        it, each version would drop the other's at every load."""
        source = self._store.indexes.source(tier, owner)
        if source.data:
            try:
                restored = index_format.restore(tier, owner, source, self._store.memories_by_seq)
            except index_format.ForeignIndex as exc:
                return self._beside(source, tier, owner, f"is not this version's ({exc})")
            except ValueError as exc:  # damaged: index the rows instead
                log.warning("the compact index of %s/%s is unusable (%s)", owner, tier.value, exc)
            except Exception as exc:  # nothing known against the index
                return self._beside(source, tier, owner, f"could not be read ({exc!r})")
            else:
                if restored.count == source.usage.entry_count:
                    return restored
                log.warning(
                    "the compact index of %s/%s holds %d entries where the tier has %d",
                    owner,
                    tier.value,
                    restored.count,
                    source.usage.entry_count,
                )
            log.warning("indexing %s/%s from its rows", owner, tier.value)
            # Dropped, so the index of the rows replaces it (start_logging
            # below then has nothing to do).
            self._bookkeeping(
                lambda t, o: self._store.indexes.discard(t, o, source.indexed), tier, owner
            )
        # Changes are logged from before the rows are read: an index of what
        # is read can then be completed, however the tier is written meanwhile.
        self._bookkeeping(self._store.indexes.start_logging, tier, owner)
        return index_format.from_rows(self._store, tier, owner)

    def _beside(self, source: IndexSource, tier: Tier, owner: str, why: str) -> CompactPartition:
        """The partition from its rows, its persisted index kept. Its changes
        are logged already (the index is current), and the store takes an
        index of this generation only once it is newer than that one: the
        storage counts as indexed as of it, so that the index of the rows is
        saved once it lacks as many writes as a restored one would."""
        log.warning("the compact index of %s/%s %s: indexing the rows", owner, tier.value, why)
        partition = index_format.from_rows(self._store, tier, owner)
        storage = partition.storage
        with storage.lock:
            if not storage.indexed:
                storage.indexed, storage.indexed_ops = source.indexed, partition.ops
        return partition

    def held_in_full(self, tier: Tier, owner: str) -> None:
        """The tier is held in full now (it shrank, or the threshold rose):
        nothing would read or trim its log any more, so it stops."""
        self._bookkeeping(self._store.indexes.stop_logging, tier, owner)

    @staticmethod
    def _bookkeeping(write: Callable[[Tier, str], None], tier: Tier, owner: str) -> None:
        """A write a read makes for the index's sake: if the database refuses
        it (read-only, full, busy), the read goes on without it."""
        try:
            write(tier, owner)
        except SidecarError as exc:
            log.warning("the compact index of %s/%s: %s", owner, tier.value, exc)

    def maybe_index(self, key: PartitionKey, partition: object) -> None:
        """Persist a compact partition's index in the background when it has
        none, or when it holds many writes its index lacks (every load
        replays those). Anything else is left alone."""
        if not isinstance(partition, CompactPartition):
            return
        storage = partition.storage
        due = max(self._every, partition.count // 100)
        if storage.indexed and partition.unindexed < due:
            return
        now = self._now()
        if now - storage.refused_at < INDEX_RETRY_SECONDS:
            return
        with self._lock:
            if self._stopped or key in self._threads or now < self._rested.get(key, now):
                return
            thread = threading.Thread(
                target=self._index, args=(key, partition), name="memory-indexer", daemon=True
            )
            self._threads[key] = thread
            thread.start()

    def _index(self, key: PartitionKey, partition: CompactPartition) -> None:
        started = self._now()
        try:
            if not index_format.persist(self._store, partition):
                # Another process saved a newer one, or the log was dropped
                # (a bulk write) after this was read: not at every write.
                partition.storage.refused_at = self._now()
        except SidecarError as exc:  # a database fault: its reason says it all
            partition.storage.refused_at = self._now()
            log.warning(
                "could not persist the compact index of %s/%s: %s (%s); trying again in %.0f s",
                key[1],
                key[0].value,
                exc,
                exc.reason,
                INDEX_RETRY_SECONDS,
            )
        except Exception:  # tried again after INDEX_RETRY_SECONDS
            partition.storage.refused_at = self._now()
            log.exception("could not persist the compact index of %s/%s", key[1], key[0].value)
        finally:
            ended = self._now()
            with self._lock:
                self._rested[key] = ended + self._pace * max(0.0, ended - started)
                self._threads.pop(key, None)

    def busy(self) -> bool:
        """Whether a compact index is being persisted (tests and the bench wait)."""
        with self._lock:
            return bool(self._threads)

    def stop(self, timeout: float) -> bool:
        """Start no more index saves and wait up to `timeout` seconds for
        those under way; whether none is left. The store must not close
        under one: SQLite's connection closed by another thread in the
        middle of a commit crashes the process."""
        with self._lock:
            self._stopped = True
            threads = list(self._threads.values())
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not self.busy()
