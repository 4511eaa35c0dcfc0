"""The rooms behind the engine: built and wired once, and their threads
started and stopped in the order the daemon's start and stop need.

`Rooms` builds every room of the domain over one store and hands each the
listeners it tells (passed in at construction, never attached later):

- Partitions tells of every generation to Watches (which wakes its streams)
  and of every erasure to Exports, then to Forgetting (which lets go of what
  showed it and tells the `on_erasure` listeners, the edge's caches of
  rendered answers). Watches and Forgetting need the partitions, so the
  partitions reach them through `Rooms`, built after.
- The change feed (made by the store inside Partitions) tells Partitions of
  writes, and Replication of session events and resyncs: Replication needs
  the feed, so the feed reaches it through `Rooms`, as above.

MemoryEngine (sidecar.domain.engine) is these rooms plus the orchestration
of each request over them: the rooms stay private to the domain, and the
edges call the engine's methods, those below among them. `inside()` hands
the rooms to white-box tests.

The threads, started by sidecar.api.server in this order: the change feed
(`start_feed`, before anything is served), then the event log's retention
and the semantic backfill (`start_background`). Stopped: the watches first
(`end_watches`, before the API drains: they never end on their own); once
it has drained, the retention (`stop_retention`), the exports' reads
(`drain_exports`), then the feed, the backfill and the index saves
(`stop`). When start-up failed, all at once instead (`abort`).

Owns: building and wiring the rooms, the labelled counters a turn touches,
and the start and stop of the rooms' threads. Must not touch: what a request
does (sidecar.domain.engine), gRPC, Peewee (sidecar.storage.store).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sidecar.config.settings import AgentSettings, Config
from sidecar.core.metrics import Metrics
from sidecar.core.tokens import TokenCounter
from sidecar.domain.erasure import Forgetting
from sidecar.domain.expiry import Expiry
from sidecar.domain.export import Exports
from sidecar.domain.partition import PartitionKey, Partitions
from sidecar.domain.queries import Queries
from sidecar.domain.replication import Replication
from sidecar.domain.sessions import Limits, SessionTable
from sidecar.domain.snapshots import Snapshots, View
from sidecar.domain.turns import Turns
from sidecar.domain.watch import Watches
from sidecar.retrieval.embedding import Encoder
from sidecar.retrieval.semantic import Semantic
from sidecar.storage.changes import ChangeFeed
from sidecar.storage.store import Store


def _session_limits(settings: AgentSettings) -> Limits:
    return Limits(settings.session_idle_ttl_seconds, settings.max_sessions)


def _semantic(
    config: Config,
    store: Store,
    metrics: Metrics,
    encoder: Encoder | None,
    now: Callable[[], float],
) -> Semantic | None:
    if encoder is None:
        return None
    return Semantic(
        encoder,
        store,
        metrics,
        cache_bytes=config.server.semantic_cache_bytes,
        compact_from=config.server.compact_tier_entries,
        query_prefix=config.server.semantic_query_prefix,
        document_prefix=config.server.semantic_document_prefix,
        clock=now,
    )


def _sessions(config: Config, metrics: Metrics) -> SessionTable[View]:
    """The session table, its caps per agent and in all."""
    # Limits per configured agent, computed once; every other agent id
    # shares the defaults' (nothing is kept per agent id seen).
    default_limits = _session_limits(config.defaults)
    limits = {agent: _session_limits(s) for agent, s in config.agents.items()}
    return SessionTable(
        lambda agent_id: limits.get(agent_id, default_limits),
        config.server.max_sessions_total,
        on_evict=metrics.snapshot_invalidations.labels("evicted").inc,
    )


@dataclass(frozen=True, slots=True)
class Inside:
    """An engine's rooms, for white-box tests (Rooms.inside)."""

    partitions: Partitions
    feed: ChangeFeed | None
    semantic: Semantic | None
    expiry: Expiry
    watches: Watches
    exports: Exports
    forgetting: Forgetting


class Rooms:
    """The domain's rooms over one store, and their threads."""

    def __init__(
        self,
        config: Config,
        store: Store,
        *,
        metrics: Metrics | None = None,
        tokens: TokenCounter | None = None,
        now: Callable[[], float] = time.monotonic,
        changes: bool = False,
        encoder: Encoder | None = None,
        on_erasure: Sequence[Callable[[], object]] = (),
    ) -> None:
        """`changes`: follow other processes' writes (a change feed);
        `encoder`: semantic retrieval; `on_erasure`: told of every erasure
        this process makes or hears of, once it let go of what showed it."""
        self._config = config
        self._store = store
        self._metrics = metrics or Metrics()
        # Semantic retrieval (server.semantic_encoder), when an encoder is given.
        self._semantic = _semantic(config, store, self._metrics, encoder, now)
        self._tokens = tokens or TokenCounter()
        self._now = now
        self._exports = Exports(store, config.server.max_concurrent_exports)
        self._partitions = self._told_partitions(changes)
        # Without a feed this engine assumes it is the database's only writer.
        self._feed = self._partitions.feed
        self._expiry = Expiry(
            config, store, self._partitions, batch=config.server.expiry_sweep_batch
        )
        self._watches = Watches(store.events, config.server, self._metrics, self._partitions)
        self._snapshots = Snapshots(self._partitions, self._tokens)
        self._queries = Queries(self._metrics, self._semantic)
        self._turns = Turns(self._queries, self._tokens)
        # A cached partition nobody has used for this long is let go (and
        # with it everything kept for its owner).
        self._partition_ttl = max(
            s.session_idle_ttl_seconds for s in (config.defaults, *config.agents.values())
        )
        self._sessions = _sessions(config, self._metrics)
        self._metrics.sessions_active.set_function(lambda: len(self._sessions))
        # ForgetUser and DeleteScope, and letting go of what showed erased content.
        self._forgetting = Forgetting(
            store,
            self._partitions,
            self._sessions,
            self._semantic,
            self._metrics,
            listeners=on_erasure,
        )
        # min_generation waits, and session events to and from other replicas.
        wait = config.server.min_generation_wait_seconds
        self._replication = Replication(self._partitions, self._sessions, self._metrics, wait)
        # Labelled children looked up once: a cached turn touches them every time.
        self._hits = self._metrics.snapshot_lookups.labels("hit")
        self._misses = self._metrics.snapshot_lookups.labels("miss")
        self._system_tokens = self._metrics.injected_tokens.labels("system")
        self._turn_tokens = self._metrics.injected_tokens.labels("turn")

    def _told_partitions(self, changes: bool) -> Partitions:
        """The partitions, and whom they tell of generations and erasures."""
        return Partitions(
            self._config,
            self._store,
            self._metrics,
            self._tokens,
            now=self._now,
            changes=changes,
            on_generation=self._generation_heard,
            on_erased=(self._exports.erased, self._erasure_heard),
            on_session=self._session_heard,
            on_resync=self._resync_heard,
        )

    def _generation_heard(self, key: PartitionKey, generation: int) -> None:
        """Partitions.on_generation: wake the partition's watches."""
        self._watches.wake(key, generation)

    def _session_heard(self, kind: str, agent_id: str, user_id: str, session: str) -> None:
        """The feed's on_session: another replica's compaction or session end."""
        self._replication.heard(kind, agent_id, user_id, session)

    def _resync_heard(self) -> None:
        """The feed's on_resync: session news may have been lost."""
        self._replication.resync()

    def _erasure_heard(self, key: PartitionKey, generation: int, followed: bool) -> int:
        """Partitions.on_erased, after the exports: let go of what showed it."""
        return self._forgetting.let_go(key, generation, followed)

    def inside(self) -> Inside:
        """The rooms themselves, for white-box tests of a room; the edges
        call the engine's methods instead."""
        return Inside(
            partitions=self._partitions,
            feed=self._feed,
            semantic=self._semantic,
            expiry=self._expiry,
            watches=self._watches,
            exports=self._exports,
            forgetting=self._forgetting,
        )

    # --- background ---------------------------------------------------------

    def sweep_expired(
        self,
        now: datetime | None = None,
        *,
        stop: Callable[[], bool] = lambda: False,
        rest: Callable[[float], object] | None = None,
    ) -> int:
        """Remove entries expired by `now` (the store's clock by default)
        until `stop` says so, resting between batches with `rest`; how many
        (Expiry.run_once)."""
        return self._expiry.run_once(now, stop=stop, rest=rest)

    def start_feed(self) -> None:
        """Hear other processes' writes from now on (nothing without a feed)."""
        if self._feed is not None:
            self._feed.start()

    def start_background(self) -> None:
        """Start the event log's retention and the semantic backfill (which
        embeds entries stored without a vector)."""
        self._watches.start()
        if self._semantic is not None:
            self._semantic.start()

    def abort(self) -> None:
        """Stop whatever start_background() and start_feed() started, in
        that order: start-up failed, or stopped before serving."""
        self._watches.stop()
        if self._semantic is not None:
            self._semantic.stop()
        # A feed still starting on an abandoned attempt's thread refuses to
        # run once stopped (sidecar.storage.changes).
        if self._feed is not None:
            self._feed.stop()

    def end_watches(self) -> None:
        """End every watch and refuse new ones now, without waiting for a
        retention pass under way (stop_retention waits)."""
        self._watches.stop(wait=False)

    def stop_retention(self) -> None:
        """Stop the event log's retention, once its pass under way is done."""
        self._watches.retention.stop()

    def drain_exports(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until no export reads the store;
        whether none does (Exports.drain)."""
        return self._exports.drain(timeout)

    def exports_running(self) -> int:
        """Export streams holding a slot now."""
        return self._exports.running

    def stop(self, timeout: float) -> bool:
        """Stop the feed and the semantic backfill, then the index saves
        (stop_indexing); whether none is left. After the exports drained."""
        if self._feed is not None:
            self._feed.stop()
        if self._semantic is not None:
            self._semantic.stop()
        return self.stop_indexing(timeout)

    def indexing(self) -> bool:
        """Whether a compact index is being persisted (tests and the bench wait)."""
        return self._partitions.indexer.busy()

    def stop_indexing(self, timeout: float) -> bool:
        """Start no more index saves and wait up to `timeout` seconds for
        those under way; whether none is left (see Indexer.stop)."""
        return self._partitions.indexer.stop(timeout)
