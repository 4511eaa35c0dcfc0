"""Partitions and their freshness: the one room that loads a tier.

A partition is one tier of one owner: its entries and keyword index as of
one generation, held in full (sidecar.retrieval.partition) or compactly for a large
tier (sidecar.retrieval.compact, loaded through sidecar.domain.index). Partitions are kept
in a bounded LRU shared by every search, view and session. A partition held
in full that reaches compact_tier_entries through a write of this process
is let go, and loaded compactly at its next use.

Freshness: `Generations` holds the newest known generation of each
partition. Generations live in the database (sidecar.storage._backend); this
process learns them from its own writes, after the commit and before the
acknowledgement (`written`), and from the change feed (sidecar.storage.changes) for
writes made by other processes: other replicas, `import`, `import-cagent`.
While the feed is unverified (its listener lost, its poller failing),
callers `verify` the partitions they use against the database first. A
partition held in full is also stale once its first entry expires (by the
store's clock: no write, no query), and loads without it, and once the
clock is set back before the expiry of an entry it was loaded without
(expired, not removed yet: see server.expiry_grace_seconds), and loads with
it again; a compact one never is, since the entries it returns are read
back by the clock.

Locks: a partition stripe (64 of them, by key) is held by a load and by a
write of this process to that partition, so the two never interleave: the
cached partition can be updated by the write's delta instead of being read
back whole. (An add grouped with others, sidecar.storage.group_commit,
holds it only to apply its delta, after its commit: a load before that sees
the partition without it, at the write's previous generation, or with it.)
Stripes are taken in index order; inside them only the dictionary locks of
Generations and the LRU. The expiry sweep holds a stripe through each
batch's transaction; a read meanwhile takes the cached partition from before
the batch (a compact one reads its entries back by the clock; a full one
was loaded without what the batch removes) instead of waiting.

Owns: the partition cache, the generations, the change feed's callback,
the runs of the expiry sweep's batches (which leave views current).
Must not touch: snapshots and sessions (sidecar.domain.snapshots), rendering, or
ranking; the database only through the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

from sidecar.config.settings import Config
from sidecar.core.caches import LRU, Generations
from sidecar.core.memory import Memory, Tier
from sidecar.core.metrics import Metrics
from sidecar.core.tokens import TokenCounter
from sidecar.domain.index import Indexer
from sidecar.retrieval import scanner
from sidecar.retrieval.compact import CompactPartition
from sidecar.retrieval.partition import Partition
from sidecar.storage.changes import ChangeFeed, OnSession
from sidecar.storage.expiry import Swept
from sidecar.storage.store import Store
from sidecar.storage.writes import Written

PartitionKey = tuple[Tier, str]
# A tier's entries and index: in full, or compact (a large tier).
AnyPartition = Partition | CompactPartition
STRIPES = 64
# The erasures handled of partitions not followed, remembered to skip their
# replays (see erased): a bound, not a correctness limit (one forgotten is
# handled again, once).
ERASURES_REMEMBERED = 10_000


@contextlib.contextmanager
def _holding(locks: list[threading.Lock]) -> Iterator[None]:
    """All of `locks`, taken in order (Partitions.writing)."""
    with contextlib.ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        yield


class Partitions:
    """Current partitions, loaded at most once each and kept while used."""

    def __init__(
        self,
        config: Config,
        store: Store,
        metrics: Metrics,
        tokens: TokenCounter,
        *,
        now: Callable[[], float] = time.monotonic,
        changes: bool = False,
        on_generation: Callable[[PartitionKey, int], None] | None = None,
        on_erased: Sequence[Callable[[PartitionKey, int, bool], int]] = (),
        on_session: OnSession | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        # The wall clock expiry is judged by (the store's, injected).
        self.clock = store.clock
        self._metrics = metrics
        self._tokens = tokens
        self._threshold = config.server.compact_tier_entries
        self.indexer = Indexer(store, now=now)
        self.generations = Generations()
        self._cache: LRU[PartitionKey, AnyPartition] = LRU(
            config.server.partition_cache_size,
            max_weight=config.server.partition_cache_bytes,
            weigh=lambda partition: partition.nbytes,
            clock=now,
        )
        self._locks = [threading.Lock() for _ in range(STRIPES)]
        # The generation of the last erasure heard of each followed partition:
        # nothing built from before it is served again (see erased).
        self.erasures = Generations()
        # The newest erasure handled of each partition (followed or not).
        self._handled: LRU[PartitionKey, int] = LRU(ERASURES_REMEMBERED)
        # Told of each erasure heard, in order: (key, generation, followed)
        # -> sessions dropped.
        self.on_erased = tuple(on_erased)
        # Partitions this process is erasing right now, each to the erasures
        # heard of meanwhile (the erasing call's own dictionary): it handles
        # them after its commit, counting what it drops (sidecar.domain.erasure).
        self._erasing: dict[PartitionKey, dict[PartitionKey, int]] = {}
        self._erasing_lock = threading.Lock()
        # Without a feed this process assumes it is the database's only writer.
        self.feed = self._feed(config, on_session, on_resync) if changes else None
        # Told of every generation this process writes or hears of: the one
        # place both arrive (sidecar.domain.watch wakes its streams).
        self.on_generation = on_generation
        # The expiry sweep's runs of batches (sidecar.domain.expiry notes each).
        self.sweeps = SweepRuns()
        # Labelled children looked up once: every write touches one.
        self._remote_writes = metrics.snapshot_invalidations.labels("remote_write")
        self._writes = metrics.snapshot_invalidations.labels("write")
        metrics.partition_cache_bytes.set_function(lambda: self._cache.weight)

    def _feed(
        self, config: Config, on_session: OnSession | None, on_resync: Callable[[], None] | None
    ) -> ChangeFeed:
        """The change feed (not started): writes come here (`heard`); session
        events and resyncs pass through to their listeners
        (sidecar.domain.replication, wired by sidecar.domain.rooms)."""
        feed = self._store.change_feed(
            self.heard,
            poll_seconds=config.server.change_poll_ms / 1000,
            heartbeat_seconds=config.server.change_heartbeat_ms / 1000,
            on_session=on_session,
            on_resync=on_resync,
        )
        self._metrics.watch_feed(feed)
        return feed

    def __len__(self) -> int:
        return len(self._cache)

    def cached(self, key: PartitionKey) -> AnyPartition | None:
        """The cached partition, current or not (None if not cached)."""
        return self._cache.get(key)

    def held_compactly(self, key: PartitionKey) -> bool:
        """Whether the tier is held compactly: its cached partition is
        compact or, not cached, it holds compact_tier_entries or more (one
        read of its state row; nothing is loaded). A partition held in full
        that reaches that size through a write is let go (see _written)."""
        cached = self._cache.get(key)
        if cached is not None:
            return isinstance(cached, CompactPartition)
        return bool(self._threshold) and self._store.tier_state(*key)[0] >= self._threshold

    # --- freshness ------------------------------------------------------------

    def heard(self, owner: str, tier: str, generation: int, erased: int = 0) -> None:
        """The change feed's news: some process wrote (or erased) this partition."""
        key = (Tier(tier), owner)
        if erased and not self._kept_for_erasing(key, erased):
            self.erased(key, erased)
        if self.generations.observe_remote(key, generation):
            self._remote_writes.inc()
        if self.on_generation is not None:
            self.on_generation(key, generation)

    def verify(self, keys: Iterable[PartitionKey], *, force: bool = False) -> None:
        """Without a verified feed (or `force`d), learn the partitions'
        generations (and erasures) from the database."""
        if self.feed is None or (self.feed.verified and not force):
            return
        for key, (generation, erased) in self._store.freshness(keys).items():
            self.generations.track(key)
            if erased:
                self.erased(key, erased)
            self.generations.observe(key, generation)

    # --- erasures ---------------------------------------------------------------

    def erased(self, key: PartitionKey, generation: int) -> int:
        """The partition was erased as of `generation` (heard from the feed,
        read by verify, or this process's own erasure): let go of the cached
        partition if it is older, and tell `on_erased` (sessions and caches
        built from it); how many sessions they dropped.

        Recorded once per erasure, and only for a followed partition (one
        nobody here has loaded has no session showing it); the listeners
        hear of the others too, with `followed` False, to let go of caches
        that outlive sessions: once per erasure too, as long as it is
        remembered (the feed replays erasures: a PostgreSQL listener that
        reconnects reads every state row again, erased ones included)."""
        followed = self.generations.current(key) is not None
        handled = self._handled.get(key) or 0
        if not followed and generation <= handled:
            return 0
        self._handled.put(key, max(handled, generation))
        if followed:
            if generation <= (self.erasures.current(key) or 0):
                return 0
            self.erasures.observe(key, generation)
            self.generations.observe(key, generation)
            cached = self._cache.get(key)
            if cached is not None and cached.generation < generation:
                self._cache.discard(key)
        return sum(listener(key, generation, followed) for listener in self.on_erased)

    @contextlib.contextmanager
    def erasing(self, keys: Collection[PartitionKey]) -> Iterator[dict[PartitionKey, int]]:
        """While this process erases these partitions, the feed's news of
        erasures of them (its own, or another process's) is kept in the
        dictionary yielded (key -> newest generation heard), for the erasure
        to handle once the block ends (it calls `erased` after its commit).
        News heard after the block ends is handled as it comes."""
        heard: dict[PartitionKey, int] = {}
        with self._erasing_lock:
            self._erasing.update(dict.fromkeys(keys, heard))
        try:
            yield heard
        finally:
            with self._erasing_lock:
                for key in keys:
                    self._erasing.pop(key, None)

    def _kept_for_erasing(self, key: PartitionKey, generation: int) -> bool:
        """Keep the news of an erasure for the erasure of `key` running here,
        if one is; whether it was kept."""
        with self._erasing_lock:
            heard = self._erasing.get(key)
            if heard is None:
                return False
            heard[key] = max(heard.get(key, 0), generation)
            return True

    def shows_erased(self, partitions: Iterable[AnyPartition]) -> bool:
        """Whether any of these was loaded before an erasure of its
        partition since heard (a frozen view must not be served then).

        One no longer followed counts as erased: its erasure record went
        with its generation (expire), and an erasure heard of meanwhile was
        not recorded. Not a stand-in (generation 0: it shows nothing)."""
        erased, followed = self.erasures.current, self.generations.current
        for p in partitions:
            key = (p.tier, p.owner)
            if p.generation and followed(key) is None:
                return True
            if p.generation < (erased(key) or 0):
                return True
        return False

    @property
    def verified(self) -> bool:
        """Whether news of other processes' writes can be trusted without asking."""
        return self.feed is None or self.feed.verified

    def is_fresh(self, partition: AnyPartition, owner: str | None = None) -> bool:
        """Whether the partition is current as (tier, owner)'s: its own owner's
        unless given (the shared empty view's stand-ins, see snapshots.View)."""
        # A partition whose generation is no longer followed cannot be
        # trusted (news of other processes' writes to it was not kept).
        key = (partition.tier, partition.owner if owner is None else owner)
        newest = self.generations.current(key)
        if newest is None or partition.generation < newest:
            return False
        now = self.clock().timestamp()
        return partition.hidden <= now < partition.expires

    # --- loading --------------------------------------------------------------

    def get(self, key: PartitionKey, *, force: bool = False) -> AnyPartition:
        """The partition as of its current generation (see _readable), loaded at most once."""
        cached = self._cache.get(key)
        if cached is not None and not force and _readable(self, cached):
            return cached
        with self._stripe(key):
            # Writes of this process to this partition hold the same lock
            # (see writing); the rows and the generation come from one
            # snapshot whoever else writes.
            cached = self._cache.get(key)
            if cached is not None and not force and _readable(self, cached):
                return cached
            # Followed from before the read: news of a write committed after
            # the read is then kept, and marks what is loaded here stale.
            # Pinned until cached, so the janitor cannot forget it in between.
            with self.generations.loading(key):
                partition = self._load(key)
                self.generations.observe(key, partition.generation)
                self._cache.put(key, partition)
            return partition

    def _load(self, key: PartitionKey) -> AnyPartition:
        tier, owner = key
        threshold = self._threshold
        count, logged = self._store.tier_state(tier, owner)
        if threshold and count >= threshold:
            held = self.indexer.load(tier, owner)
            self.indexer.maybe_index(key, held)
            return held
        if logged and threshold:
            self.indexer.held_in_full(tier, owner)
        loaded = self._store.tier_entries(tier, owner)
        hidden = -math.inf if loaded.hidden is None else loaded.hidden / 1_000_000
        return Partition.build(
            tier,
            owner,
            loaded.generation,
            loaded.memories,
            loaded.usage,
            hidden=hidden,
            **self._annotations(),
        )

    def _annotations(self) -> dict[str, Any]:
        return {"scan": scanner.finding, "count_tokens": self._tokens.count}

    # --- writes of this process -------------------------------------------------

    def _stripe(self, key: PartitionKey) -> threading.Lock:
        return self._locks[hash(key) % STRIPES]

    def writing(self, keys: Iterable[PartitionKey]) -> contextlib.AbstractContextManager[Any]:
        """Hold the partition locks of the partitions a write may change.

        A write and a (re)load of the same partition never interleave, so
        the cached partition can be updated by the write's delta instead of
        being read back whole. Stripes are taken in index order.
        """
        stripes = sorted({hash(key) % STRIPES for key in keys})
        # An add's one partition: its lock as it is (cheaper than a generator).
        locks = [self._locks[stripe] for stripe in stripes]
        return locks[0] if len(locks) == 1 else _holding(locks)

    def added(self, key: PartitionKey, written: Written) -> None:
        """An AddMemory committed (under `writing`)."""
        memory, usage = written.memory, written.usage

        def change(partition: AnyPartition, generation: int) -> AnyPartition | None:
            if not written.created:
                # Nothing new was stored (identical content, a replay): the
                # generation advanced only for the expired entries the write
                # removed first (_written takes them out). The existing
                # entry is already held; appending it would show it twice.
                if isinstance(partition, CompactPartition):
                    return partition.removed((), generation, usage)
                return None
            if isinstance(partition, CompactPartition):
                return partition.added(memory, generation, usage)
            return partition.added(memory, generation, usage, **self._annotations())

        self._written(key, written, change)

    def changed(self, key: PartitionKey, written: Written, replacement: Memory | None) -> None:
        """An update (`replacement` is the entry as written) or a delete
        (None) of `written.memory` committed (under `writing`)."""
        target, usage = written.memory, written.usage

        def change(partition: AnyPartition, generation: int) -> AnyPartition | None:
            if isinstance(partition, CompactPartition):
                return partition.changed(target, replacement, generation, usage)
            return partition.changed(
                target.id, replacement, generation, usage, **self._annotations()
            )

        self._written(key, written, change)

    def _written(
        self,
        key: PartitionKey,
        written: Written,
        change: Callable[[AnyPartition, int], AnyPartition | None],
    ) -> None:
        """After the commit and before the acknowledgement (under writing).

        A turn that starts after the client hears back never sees the old
        snapshot as current. A cached partition that was exactly one write
        behind gets the write applied to it; any other is left to reload.
        """
        if written.generation == written.previous:
            return
        cached = self._cache.get(key)
        self.generations.observe(key, written.generation)
        if cached is not None and written.expired:
            # The write first removed expired entries: a compact partition
            # takes them out as the sweep's (a full one reloads without them).
            cached = self._without(key, cached, written.expired, written.previous)
        if self.on_generation is not None:
            self.on_generation(key, written.generation)
        if cached is not None and cached.generation == written.previous:
            # StopIteration or None: the entry was not in the cached
            # partition, or it was not the newest of its storage; it reloads.
            with contextlib.suppress(StopIteration):
                changed = change(cached, written.generation)
                if changed is not None and self._outgrown(changed):
                    # Loaded afresh at its next use, compactly, as a
                    # process that had not held it would load it.
                    self._cache.discard(key)
                elif changed is not None:
                    self._cache.put(key, changed)
                    self.indexer.maybe_index(key, changed)
        self._writes.inc()

    def swept(self, key: PartitionKey, swept: Swept) -> None:
        """The expiry sweep removed some of the partition's entries (under
        `writing`): a cached compact partition takes them out, as deletes
        (a million entries are not read again for one expiry); a full one
        loaded without them (as expired) moves on as it is, any other
        reloads at its next use. Views stay current (see swept_only)."""
        if swept.generation == swept.previous:
            return
        cached = self._cache.get(key)
        self.sweeps.add(key, swept)
        self.generations.observe(key, swept.generation)
        if self.on_generation is not None:
            self.on_generation(key, swept.generation)
        if cached is None or cached.generation != swept.previous:
            return
        if isinstance(cached, CompactPartition):
            changed = cached.removed([r.seq for r in swept.removed], swept.generation, swept.usage)
            if changed is not None:
                self._cache.put(key, changed)
                self.indexer.maybe_index(key, changed)
        elif _holds_none(cached, swept.cutoff, self.clock().timestamp()):
            # Entries and usage (of the rows it read) as a load would read.
            self._cache.put(key, dataclasses.replace(cached, generation=swept.generation))

    def swept_only(self, partition: AnyPartition, shown_expires: float) -> bool:
        """Whether only this process's sweep advanced the partition since
        `partition`, removing entries expired before all it holds and
        `shown_expires` (a view's first, POSIX): hidden already, so the
        view's frozen block stays current; turns read the current one."""
        key = (partition.tier, partition.owner)
        cutoff = self.sweeps.cutoff(key, partition.generation, self.generations.current(key))
        now = self.clock().timestamp()
        return cutoff is not None and _holds_none(partition, cutoff, now, shown_expires)

    def _without(
        self, key: PartitionKey, cached: AnyPartition, seqs: tuple[int, ...], previous: int
    ) -> AnyPartition | None:
        """The cached partition without these expired entries, as of the
        write's previous generation (so the write applies on top), or None."""
        if not isinstance(cached, CompactPartition) or cached.generation != previous:
            return None
        # Tombstones at `previous`: this partition and the write's own see
        # them gone; no older partition is handed out any more.
        return cached.removed(seqs, previous, cached.usage)

    def _outgrown(self, partition: AnyPartition) -> bool:
        """Whether a partition held in full has reached compact_tier_entries."""
        return (
            isinstance(partition, Partition)
            and bool(self._threshold)
            and partition.count >= self._threshold
        )

    # --- letting go -------------------------------------------------------------

    def expire(self, unused_since: float, held: Collection[PartitionKey]) -> None:
        """Let go of cached partitions nobody has used since `unused_since`
        and nothing holds, then stop following what is neither held nor cached."""
        self._cache.expire(unused_since, keep=held)
        followed = set(held).union(self._cache.keys())
        self.generations.retain(followed)
        self.erasures.retain(followed)
        self.sweeps.retain(followed)


class SweepRuns:
    """Per partition, the last run of generations this process's expiry
    sweep alone advanced it through, and the latest expiry it removed."""

    def __init__(self) -> None:
        # key -> (first, last, cutoff): every entry removed expired by
        # cutoff (microseconds).
        self._of: dict[PartitionKey, tuple[int, int, int]] = {}

    def add(self, key: PartitionKey, swept: Swept) -> None:
        """A batch of the sweep committed (under the partition's stripe)."""
        run = self._of.get(key)
        if run is not None and run[0] <= swept.previous < swept.generation <= run[1]:
            return  # noted before its commit already
        if run is not None and run[1] == swept.previous:
            # The batch locked the state row at the run's last generation:
            # no other write came in between, so the run goes on.
            self._of[key] = (run[0], swept.generation, max(run[2], swept.cutoff))
        else:
            self._of[key] = (swept.previous, swept.generation, swept.cutoff)

    def cutoff(self, key: PartitionKey, generation: int, newest: int | None) -> int | None:
        """The latest expiry the sweep removed since `generation`, if its
        run alone took the partition from there to `newest` (not yet at the
        run's end: the last batch is noted before it commits); else None."""
        run = self._of.get(key)
        if run is None or newest is None or not run[0] <= generation <= newest <= run[1]:
            return None
        return run[2]

    def forget(self, key: PartitionKey) -> None:
        """A batch failed: its views rebuild, as after a write."""
        self._of.pop(key, None)

    def retain(self, keys: Collection[PartitionKey]) -> None:
        """Forget the runs of partitions not in `keys` (no longer followed)."""
        for key in list(self._of):
            if key not in keys:
                self._of.pop(key, None)


def _readable(partitions: Partitions, cached: AnyPartition) -> bool:
    """Whether a read may take the cached partition: it is current, or only
    this process's expiry sweep moved past it (swept_only). What the sweep
    removed was hidden already, so it reads as the current one does, and a
    read never waits for a batch, which holds the stripe from its
    transaction until the caches take it in."""
    return partitions.is_fresh(cached) or partitions.swept_only(cached, math.inf)


def _holds_none(
    partition: AnyPartition, cutoff: int, now: float, shown_expires: float = math.inf
) -> bool:
    """Whether the partition is current by the clock (`now`) and neither it
    nor a view showing entries expiring at `shown_expires` (POSIX) or later
    holds an entry expired by `cutoff` (microseconds): a full partition was
    loaded without them; a compact one holds every row but reads each back
    by the clock (its expires is inf)."""
    first = min(partition.expires, shown_expires)
    # One microsecond over: no float rounding lets an entry that expired
    # at the cutoff itself pass for a later one.
    return partition.hidden <= now < partition.expires and first * 1_000_000 > cutoff + 1
