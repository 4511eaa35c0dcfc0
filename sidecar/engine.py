"""The engine: writes that advance generations, ranked search, InjectForTurn.

Caches, from the bottom up:

- `Generations`: the newest known generation of each partition (one tier of
  one owner). Generations live in the database (sidecar._backend); this
  process learns them from its own writes, after the commit and before the
  acknowledgement, and from the change feed (sidecar.changes) for writes
  made by other processes: other replicas, `import`, `import-cagent`.
- Partitions: a partition's entries and keyword index as of one generation,
  kept in a bounded LRU and shared by every search, view and session.
- Views: a scope's snapshot (the rendered frozen block and the partitions it
  came from), shared by every session of that scope and generation, and kept
  only while some session holds it. Scopes with nothing ever written share
  one view (see View): a new agent's session costs a session, not a snapshot.
- Sessions (sidecar.sessions): which view each runtime session is using.

A cached turn reads only these, so it runs no database query at all (a
compact partition, sidecar.compact, reads the entries it returns). While
the change feed is unverified (its listener lost, its poller failing), every
call first reads the generations of the partitions it uses from the database.

Locks, outermost first: a view stripe, then a partition stripe, then the
short-lived dictionary locks inside Generations, _LRU and SessionTable.
Nothing is ever taken in the other order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar import blocks, compact_index, scanner
from sidecar._caches import LRU, Generations
from sidecar.changes import ChangeFeed
from sidecar.compact import CompactPartition
from sidecar.config import AgentSettings, Config
from sidecar.embedding import Encoder
from sidecar.errors import BudgetExceeded, InvalidArgument, SidecarError
from sidecar.keywords import keywords
from sidecar.llm import KeywordModel, KeywordModelError, Pause
from sidecar.memory import SEPARATOR, Memory, Scope, Tier, Usage
from sidecar.metrics import Metrics
from sidecar.partition import Partition
from sidecar.ranking import SemanticScores, Weights, rank
from sidecar.semantic import Floats, Semantic
from sidecar.sessions import Limits, SessionId, SessionTable
from sidecar.store import Store, Vector, Wanted, Written
from sidecar.tokens import TokenCounter

log = logging.getLogger(__name__)
PartitionKey = tuple[Tier, str]
# A tier's entries and index: in full, or compact (a large tier).
AnyPartition = Partition | CompactPartition
_STRIPES = 64
# A compact partition's index is persisted again once it lacks this many
# writes, or 1% of its entries if more: each load replays what it lacks.
INDEX_EVERY = 1000
INDEX_RETRY_SECONDS = 60.0


@dataclass(frozen=True, slots=True, weakref_slot=True, eq=False)
class View:
    """A scope's snapshot: the frozen block and where it came from.

    Scopes with nothing ever written to any tier share one view per settings
    (`scope` None, see MemoryEngine._empty_view): a flood of new agents then
    costs no snapshot each. Its partitions are empty stand-ins for every such
    scope's; whether it is still current is judged by the generations of the
    session's own scope (see MemoryEngine._fresh).
    """

    scope: Scope | None
    partitions: tuple[AnyPartition, ...]
    generation: int
    system_block: str
    sha256: str
    shown_ids: tuple[str, ...]
    # The same entries' seqs: ranking leaves them out before reading any.
    shown_seqs: frozenset[int]
    system_tokens: int

    @property
    def content_key(self) -> tuple[object, ...]:
        """Equal for views that answer with the same frozen block."""
        return (self.sha256, self.generation, self.system_tokens, self.shown_ids)


@dataclass(frozen=True, slots=True)
class Injection:
    """What InjectForTurn answers."""

    system_block: str
    turn_context: str
    generation: int
    sha256: str
    cache_hit: bool
    system_memory_ids: tuple[str, ...]
    turn_memory_ids: tuple[str, ...]
    system_tokens: int
    turn_tokens: int
    token_counter: str
    usage: dict[Tier, Usage]
    # The snapshot the frozen block came from: the same object on every
    # cached turn, so callers may cache what they derive from it.
    snapshot: View


@dataclass(frozen=True, slots=True)
class Stats:
    """What the engine holds in memory."""

    sessions: int
    # Per-scope views (the one shared by scopes with nothing written is not counted).
    views: int
    partitions: int
    # Agents with sessions, and partitions whose generations are followed:
    # both fall to zero when every session and cached partition is gone.
    agents: int = 0
    followed: int = 0


def _finding(memory: Memory) -> str | None:
    """The content scanner's finding in a stored entry, if any (cached per entry)."""
    found = scanner.scan(memory.content) or scanner.scan(memory.category)
    return found.pattern if found else None


def _injectable(settings: AgentSettings, memory: Memory, finding: str | None) -> Memory:
    """The memory as it may enter a prompt: a stored entry that fails the
    content scan (written before scanning was on, or under `warn`) is replaced
    by a placeholder naming the pattern, never shown verbatim. With scanning
    off it is shown, but a line that would fake the block's layout (a rule,
    a separator, a tier header) is put in brackets: no entry can add one.
    (An entry without a finding holds no such line: the scan looks for them.)"""
    if finding is None:
        return memory
    if settings.content_scanning == "off":
        content = scanner.neutralise_layout(memory.content)
        return memory if content == memory.content else dataclasses.replace(memory, content=content)
    placeholder = scanner.PLACEHOLDER.format(pattern=finding)
    return dataclasses.replace(memory, content=placeholder, category="")


# Shared by the views of every scope with nothing shown (agents without
# memories): one empty set, one digest of the empty block.
_NO_SEQS: frozenset[int] = frozenset()


_EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()

# The partitions of the shared empty view (see View): one empty partition per
# tier standing in for every never-written one. Their owner means nothing, so
# they are never cached, written to or ranked under a key.
_STAND_INS: tuple[Partition, ...] = tuple(Partition.build(t, "", 0, (), Usage()) for t in Tier)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest() if text else _EMPTY_DIGEST


def _session_key(scope: Scope, session_id: str) -> SessionId:
    """A session's id within its agent: sessions of different users of one
    agent are apart. Without a user_id (the usual case) the bare session id:
    a str never equals a tuple, and it saves a tuple per session."""
    return (scope.user_id, session_id) if scope.user_id else session_id


def _session_scope(agent_id: str, key: SessionId) -> Scope:
    """The scope of the session with this id (see _session_key)."""
    return Scope(agent_id, key[0]) if isinstance(key, tuple) else Scope(agent_id)


def _session_limits(settings: AgentSettings) -> Limits:
    return Limits(settings.session_idle_ttl_seconds, settings.max_sessions)


def _weights(settings: AgentSettings) -> Weights:
    return Weights(settings.similarity_weight, settings.confidence_weight)


class MemoryEngine:
    """Everything the service does, over one store."""

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
    ) -> None:
        self._config = config
        self._store = store
        self._metrics = metrics or Metrics()
        # Per keyword endpoint: after it fails, turns skip it for a while.
        self._keyword_pauses: dict[str, Pause] = {}
        # Semantic retrieval (server.semantic_encoder), when an encoder is given.
        self.semantic: Semantic | None = None
        if encoder is not None:
            self.semantic = Semantic(
                encoder,
                store,
                self._metrics,
                cache_bytes=config.server.semantic_cache_bytes,
                compact_from=config.server.compact_tier_entries,
                query_prefix=config.server.semantic_query_prefix,
                document_prefix=config.server.semantic_document_prefix,
                clock=now,
            )
        self.tokens = tokens or TokenCounter()
        self._now = now
        self._generations = Generations()
        # Without a feed this engine assumes it is the database's only writer.
        self.feed: ChangeFeed | None = None
        if changes:
            self.feed = store.change_feed(
                self._heard,
                poll_seconds=config.server.change_poll_ms / 1000,
                heartbeat_seconds=config.server.change_heartbeat_ms / 1000,
            )
            self._metrics.watch_feed(self.feed)
        self._partitions: LRU[PartitionKey, AnyPartition] = LRU(
            config.server.partition_cache_size,
            max_weight=config.server.partition_cache_bytes,
            weigh=lambda partition: partition.nbytes,
            clock=now,
        )
        # A cached partition nobody has used for this long is let go (and
        # with it everything kept for its owner).
        self._partition_ttl = max(
            s.session_idle_ttl_seconds for s in (config.defaults, *config.agents.values())
        )
        self._views: weakref.WeakValueDictionary[tuple[str, str], View] = (
            weakref.WeakValueDictionary()
        )
        # The view shared by every scope with nothing written, per settings; see View.
        self._empty_views: dict[AgentSettings, View] = {}
        self._view_locks = [threading.Lock() for _ in range(_STRIPES)]
        # Partitions whose compact index is being persisted (one at a time
        # each), by the thread doing it; none start once stopping.
        self._indexing: dict[PartitionKey, threading.Thread] = {}
        self._indexing_lock = threading.Lock()
        self._indexing_stopped = False
        self._partition_locks = [threading.Lock() for _ in range(_STRIPES)]
        # Limits per configured agent, computed once; every other agent id
        # shares the defaults' (nothing is kept per agent id seen).
        default_limits = _session_limits(config.defaults)
        limits = {agent: _session_limits(s) for agent, s in config.agents.items()}
        self._sessions: SessionTable[View] = SessionTable(
            lambda agent_id: limits.get(agent_id, default_limits),
            config.server.max_sessions_total,
            on_evict=self._metrics.snapshot_invalidations.labels("evicted").inc,
        )
        self._metrics.sessions_active.set_function(lambda: len(self._sessions))
        self._metrics.partition_cache_bytes.set_function(lambda: self._partitions.weight)
        # Labelled children looked up once: a cached turn touches them every time.
        self._remote_writes = self._metrics.snapshot_invalidations.labels("remote_write")
        self._hits = self._metrics.snapshot_lookups.labels("hit")
        self._misses = self._metrics.snapshot_lookups.labels("miss")
        self._system_tokens = self._metrics.injected_tokens.labels("system")
        self._turn_tokens = self._metrics.injected_tokens.labels("turn")

    def settings(self, scope: Scope) -> AgentSettings:
        return self._config.for_agent(scope.agent_id)

    # --- writes -------------------------------------------------------------

    def _stripe(self, key: PartitionKey) -> threading.Lock:
        return self._partition_locks[hash(key) % _STRIPES]

    @contextlib.contextmanager
    def _writing(self, keys: Iterable[PartitionKey]) -> Iterator[None]:
        """Hold the partition locks of the partitions a write may change.

        A write and a (re)load of the same partition never interleave, so
        the cached partition can be updated by the write's delta instead of
        being read back whole. Stripes are taken in index order.
        """
        stripes = sorted({hash(key) % _STRIPES for key in keys})
        with contextlib.ExitStack() as stack:
            for stripe in stripes:
                stack.enter_context(self._partition_locks[stripe])
            yield

    def _written(
        self,
        key: PartitionKey,
        written: Written,
        change: Callable[[AnyPartition, int], AnyPartition | None],
    ) -> None:
        """After the commit and before the acknowledgement (under _writing).

        A turn that starts after the client hears back never sees the old
        snapshot as current. A cached partition that was exactly one write
        behind gets the write applied to it; any other is left to reload.
        """
        if written.generation == written.previous:
            return
        cached = self._partitions.get(key)
        self._generations.observe(key, written.generation)
        if cached is not None and cached.generation == written.previous:
            # StopIteration or None: the entry was not in the cached
            # partition, or it was not the newest of its storage; it reloads.
            with contextlib.suppress(StopIteration):
                changed = change(cached, written.generation)
                if changed is not None:
                    self._partitions.put(key, changed)
                    self._maybe_index(key, changed)
        self._metrics.snapshot_invalidations.labels("write").inc()

    def _heard(self, owner: str, tier: str, generation: int) -> None:
        """The change feed's news: some process wrote this partition."""
        if self._generations.observe_remote((Tier(tier), owner), generation):
            self._remote_writes.inc()

    def _verify(self, keys: Iterable[PartitionKey]) -> None:
        """Without a verified feed, learn the partitions' generations from the database."""
        if self.feed is None or self.feed.verified:
            return
        for key, generation in self._store.generations(keys).items():
            self._generations.track(key)
            self._generations.observe(key, generation)

    def _is_fresh(self, partition: AnyPartition, owner: str | None = None) -> bool:
        """Whether the partition is current as (tier, owner)'s: its own owner's
        unless given (the shared empty view's stand-ins, see View)."""
        # A partition whose generation is no longer followed cannot be
        # trusted (news of other processes' writes to it was not kept).
        key = (partition.tier, partition.owner if owner is None else owner)
        newest = self._generations.current(key)
        return newest is not None and partition.generation >= newest

    def _fresh(self, view: View, scope: Scope) -> list[bool]:
        """Which of the view's partitions are still current for this scope."""
        if view.scope is not None:
            return [self._is_fresh(p) for p in view.partitions]
        # The shared empty view: current while the scope's own partitions are
        # still at generation 0 as far as this process knows (they stay
        # followed while a session holds it, see evict_idle). Stale in part
        # is stale in all: the turn then reads the scope's own partitions, so
        # no stand-in (owned by nobody) reaches ranking.
        fresh = [self._is_fresh(p, scope.owner(p.tier)) for p in view.partitions]
        return fresh if all(fresh) else [False] * len(fresh)

    def _annotations(self) -> dict[str, Any]:
        return {"scan": _finding, "count_tokens": self.tokens.count}

    def _added(
        self, partition: AnyPartition, memory: Memory, generation: int, usage: Usage
    ) -> AnyPartition | None:
        if isinstance(partition, CompactPartition):
            return partition.added(memory, generation, usage)
        return partition.added(memory, generation, usage, **self._annotations())

    def _changed(
        self,
        partition: AnyPartition,
        target: Memory,
        replacement: Memory | None,
        generation: int,
        usage: Usage,
    ) -> AnyPartition | None:
        if isinstance(partition, CompactPartition):
            return partition.changed(target, replacement, generation, usage)
        return partition.changed(target.id, replacement, generation, usage, **self._annotations())

    @contextlib.contextmanager
    def _counting_rejections(self) -> Iterator[None]:
        try:
            yield
        except BudgetExceeded as exc:
            self._metrics.budget_rejections.labels(exc.tier).inc()
            raise

    def _screen(self, settings: AgentSettings, field: str, text: str) -> None:
        """Refuse (strict) or log (warn) text that fails the content scan."""
        mode = settings.content_scanning
        if mode == "off":
            return
        finding = scanner.scan(text)
        if finding is None:
            return
        action = "refused" if mode == "strict" else "warned"
        self._metrics.scan_findings.labels(finding.pattern, action).inc()
        if mode == "strict":
            raise InvalidArgument(
                f"{field} was refused by the content scan ({finding.pattern}: "
                f"{finding.excerpt!r}); memories are injected into system prompts",
                reason="CONTENT_REJECTED",
                metadata={"field": field, "pattern": finding.pattern},
            )
        log.warning(
            "stored a memory that fails the content scan (%s); it is never injected verbatim",
            finding.pattern,
        )

    def add(
        self,
        scope: Scope,
        tier: Tier,
        content: str,
        category: str,
        confidence: float,
        *,
        idempotency_key: str = "",
        still_wanted: Wanted | None = None,
    ) -> tuple[Memory, Usage, bool]:
        settings = self.settings(scope)
        self._screen(settings, "content", content)
        self._screen(settings, "category", category)
        key = (tier, scope.owner(tier))
        stored, held = self._embedding(content, [key])
        with self._writing([key]), self._counting_rejections():
            written = self._store.add(
                scope,
                tier,
                content,
                category,
                confidence,
                settings.policy(tier),
                idempotency_key=idempotency_key,
                still_wanted=still_wanted,
                vector=stored,
            )
            memory, usage = written.memory, written.usage
            self._written(key, written, lambda p, g: self._added(p, memory, g, usage))
            if self.semantic is not None:
                self.semantic.written(key, written, held, content_changed=True)
        return memory, usage, written.created

    def update(
        self,
        scope: Scope,
        memory_id: str,
        *,
        content: str | None,
        category: str | None,
        confidence: float | None,
        still_wanted: Wanted | None = None,
    ) -> tuple[Memory, Usage]:
        settings = self.settings(scope)
        if content is not None:
            self._screen(settings, "content", content)
        if category is not None:
            self._screen(settings, "category", category)
        keys = [(tier, scope.owner(tier)) for tier in Tier]
        stored, held = self._embedding(content, keys)
        with self._writing(keys), self._counting_rejections():
            written = self._store.update(
                scope,
                memory_id,
                settings.policies(),
                content=content,
                category=category,
                confidence=confidence,
                still_wanted=still_wanted,
                vector=stored,
            )
            memory, usage = written.memory, written.usage
            key = (memory.tier, scope.owner(memory.tier))
            self._written(key, written, lambda p, g: self._changed(p, memory, memory, g, usage))
            if self.semantic is not None:
                self.semantic.written(key, written, held, content_changed=content is not None)
        return memory, usage

    def delete(
        self, scope: Scope, memory_id: str, *, still_wanted: Wanted | None = None
    ) -> tuple[Memory, Usage]:
        keys = [(tier, scope.owner(tier)) for tier in Tier]
        with self._writing(keys):
            written = self._store.delete(scope, memory_id, still_wanted=still_wanted)
            memory, usage = written.memory, written.usage
            key = (memory.tier, scope.owner(memory.tier))
            self._written(key, written, lambda p, g: self._changed(p, memory, None, g, usage))
            if self.semantic is not None:
                self.semantic.removed(key, written)
        return memory, usage

    # --- reads --------------------------------------------------------------

    def list_memories(
        self,
        scope: Scope,
        tiers: Sequence[Tier],
        category: str,
        *,
        after_seq: int = 0,
        limit: int | None = None,
    ) -> tuple[list[Memory], dict[Tier, Usage]]:
        return self._store.list_memories(scope, tiers, category, after_seq=after_seq, limit=limit)

    def search(
        self,
        scope: Scope,
        query: str,
        tiers: Sequence[Tier],
        *,
        category: str = "",
        limit: int,
        match_all: bool = False,
    ) -> list[tuple[Memory, float]]:
        keys = [(tier, scope.owner(tier)) for tier in tiers]
        self._verify(keys)
        partitions = [self._partition(key) for key in keys]
        settings = self.settings(scope)
        terms = keywords([query])
        return rank(
            partitions,
            terms,
            _weights(settings),
            match_all=match_all,
            category=category,
            limit=limit,
            semantic=None if match_all else self._meaning(settings, query, terms, partitions),
        )

    def _embedding(
        self, content: str | None, keys: Sequence[PartitionKey]
    ) -> tuple[Vector | None, Floats | None]:
        """New content's vector, as stored and as held (semantic.for_write),
        computed before any lock is taken: the encoder may take a while.
        None without semantic retrieval, without new content, or for a tier
        held compactly (ranked lexically: the vector would never be used)."""
        if self.semantic is None or content is None:
            return None, None
        if all(isinstance(self._partitions.get(key), CompactPartition) for key in keys):
            return None, None
        return self.semantic.for_write(content)

    def _meaning(
        self,
        settings: AgentSettings,
        text: str,
        terms: Sequence[str],
        partitions: Sequence[AnyPartition],
    ) -> SemanticScores | None:
        """The query's cosines with the partitions' entries, for rank(); None
        without semantic retrieval (or with semantic_weight 0: off for this
        agent), for a query without keywords (rank() ranks it by confidence),
        or when the query could not be embedded."""
        if (
            self.semantic is None
            or not settings.semantic_weight
            or not terms
            or not any(p.count for p in partitions)
        ):
            return None
        query: Floats | None = self.semantic.query(text)
        if query is None:
            return None
        return SemanticScores(
            self.semantic.similarities(partitions, query),
            settings.semantic_weight,
            settings.semantic_min_similarity,
        )

    def _partition(self, key: PartitionKey, *, force: bool = False) -> AnyPartition:
        """The partition as of its current generation, loaded at most once."""
        cached = self._partitions.get(key)
        if cached is not None and not force and self._is_fresh(cached):
            return cached
        with self._stripe(key):
            # Writes of this process to this partition hold the same lock
            # (see _writing); the rows and the generation come from one
            # snapshot whoever else writes.
            cached = self._partitions.get(key)
            if cached is not None and not force and self._is_fresh(cached):
                return cached
            # Followed from before the read: news of a write committed after
            # the read is then kept, and marks what is loaded here stale.
            # Pinned until cached, so the janitor cannot forget it in between.
            with self._generations.loading(key):
                partition = self._load(key)
                self._generations.observe(key, partition.generation)
                self._partitions.put(key, partition)
            return partition

    def _load(self, key: PartitionKey) -> AnyPartition:
        tier, owner = key
        threshold = self._config.server.compact_tier_entries
        count, logged = self._store.tier_state(tier, owner)
        if threshold and count >= threshold:
            held = self._compact(tier, owner)
            self._maybe_index(key, held)
            return held
        if logged and threshold:
            # Held in full now (it shrank, or the threshold rose): nothing
            # would read or trim its log any more.
            self._bookkeeping(self._store.stop_logging, tier, owner)
        loaded = self._store.tier_entries(tier, owner)
        return Partition.build(
            tier, owner, loaded.generation, loaded.memories, loaded.usage, **self._annotations()
        )

    def _compact(self, tier: Tier, owner: str) -> CompactPartition:
        """A large partition: from its persisted index and the writes logged
        since, or, without a usable one, from its rows."""
        source = self._store.compact_source(tier, owner)
        if source.data:
            try:
                restored = compact_index.restore(tier, owner, source, self._store.memories_by_seq)
            except Exception as exc:  # anything in the bytes: index the rows instead
                log.warning("the compact index of %s/%s is unusable (%s)", owner, tier.value, exc)
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
        # Changes are logged from before the rows are read: an index of what
        # is read can then be completed, however the tier is written meanwhile.
        self._bookkeeping(self._store.start_logging, tier, owner)
        return compact_index.from_rows(self._store, tier, owner)

    @staticmethod
    def _bookkeeping(write: Callable[[Tier, str], None], tier: Tier, owner: str) -> None:
        """A write a read makes for the index's sake: if the database refuses
        it (read-only, full, busy), the read goes on without it."""
        try:
            write(tier, owner)
        except SidecarError as exc:
            log.warning("the compact index of %s/%s: %s", owner, tier.value, exc)

    def _maybe_index(self, key: PartitionKey, partition: AnyPartition) -> None:
        """Persist a compact partition's index in the background when it has
        none, or when it holds many writes its index lacks (every load
        replays those)."""
        if not isinstance(partition, CompactPartition):
            return
        storage = partition.storage
        due = max(INDEX_EVERY, partition.count // 100)
        if storage.indexed and partition.unindexed < due:
            return
        if self._now() - storage.refused_at < INDEX_RETRY_SECONDS:
            return
        with self._indexing_lock:
            if self._indexing_stopped or key in self._indexing:
                return
            thread = threading.Thread(
                target=self._index, args=(key, partition), name="memory-indexer", daemon=True
            )
            self._indexing[key] = thread
            thread.start()

    def _index(self, key: PartitionKey, partition: CompactPartition) -> None:
        try:
            if not compact_index.persist(self._store, partition):
                # Another process saved a newer one, or the log was dropped
                # (a bulk write) after this was read: not at every write.
                partition.storage.refused_at = self._now()
        except Exception:  # tried again after INDEX_RETRY_SECONDS
            partition.storage.refused_at = self._now()
            log.exception("could not persist the compact index of %s/%s", key[1], key[0].value)
        finally:
            with self._indexing_lock:
                self._indexing.pop(key, None)

    def indexing(self) -> bool:
        """Whether a compact index is being persisted (tests and the bench wait)."""
        with self._indexing_lock:
            return bool(self._indexing)

    def stop_indexing(self, timeout: float) -> bool:
        """Start no more index saves and wait up to `timeout` seconds for
        those under way; whether none is left. The store must not close
        under one: SQLite's connection closed by another thread in the
        middle of a commit crashes the process."""
        with self._indexing_lock:
            self._indexing_stopped = True
            threads = list(self._indexing.values())
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not self.indexing()

    def _is_current(self, view: View) -> bool:
        return all(self._is_fresh(p) for p in view.partitions)

    def _view(self, scope: Scope, settings: AgentSettings, *, force: bool) -> View:
        """The scope's current snapshot; built once however many callers ask."""
        key = (scope.agent_id, scope.user_id)
        view = self._views.get(key)
        if view is not None and not force and self._is_current(view):
            return view
        with self._view_locks[hash(key) % _STRIPES]:
            view = self._views.get(key)
            if view is not None and not force and self._is_current(view):
                return view
            partitions = tuple(
                self._partition((tier, scope.owner(tier)), force=force) for tier in Tier
            )
            if all(p.generation == 0 and not p.count for p in partitions):
                return self._empty_view(settings)
            view = self._build_view(scope, partitions, settings)
            self._views[key] = view
            return view

    def _empty_view(self, settings: AgentSettings) -> View:
        """The view of every scope with nothing ever written (generation 0,
        no rows: a migrated partition may hold rows at generation 0), under
        these settings. Built once; kept for good (one per distinct settings)."""
        view = self._empty_views.get(settings)
        if view is None:
            view = self._build_view(None, _STAND_INS, settings)
            view = self._empty_views.setdefault(settings, view)
        return view

    def _build_view(
        self, scope: Scope | None, partitions: tuple[AnyPartition, ...], settings: AgentSettings
    ) -> View:
        parts: list[blocks.TierBlock | None] = []
        if settings.inject_system_block:
            for partition in partitions:
                policy = settings.policy(partition.tier)
                if not policy.enabled:
                    parts.append(None)
                    continue
                if isinstance(partition, CompactPartition):
                    parts.append(self._compact_block(partition, policy.limit_chars, settings))
                    continue
                shown = [
                    _injectable(settings, memory, finding)
                    for memory, finding in zip(partition.memories, partition.findings, strict=True)
                ]
                costs = [
                    tokens if shown_memory is memory else self.tokens.count(shown_memory.content)
                    for memory, shown_memory, tokens in zip(
                        partition.memories, shown, partition.tokens, strict=True
                    )
                ]
                parts.append(
                    blocks.tier_block(
                        partition.tier,
                        shown,
                        partition.usage,
                        policy.limit_chars,
                        costs=costs,
                        order=partition.by_confidence().tolist() if not policy.limit_chars else [],
                        separator_cost=self.tokens.count(SEPARATOR),
                        max_tokens=settings.max_injection_tokens,
                    )
                )
        text = blocks.system_block(parts)
        generation = max(p.generation for p in partitions)
        sha256 = _digest(text)
        shown_ids = tuple(m.id for part in parts if part for m in part.shown)
        shown_seqs = frozenset(m.seq for part in parts if part for m in part.shown)
        system_tokens = self.tokens.count(text)
        return View(
            scope=scope,
            partitions=partitions,
            generation=generation,
            system_block=text,
            sha256=sha256,
            shown_ids=shown_ids,
            shown_seqs=shown_seqs or _NO_SEQS,
            system_tokens=system_tokens,
        )

    def _compact_block(
        self, partition: CompactPartition, limit_chars: int, settings: AgentSettings
    ) -> blocks.TierBlock | None:
        """A large tier's block, as blocks.tier_block picks it, reading from
        the database only the entries it looks at. Unlimited (the usual
        large tier): by rank, in growing batches. Budgeted: every entry (the
        response limit may then refuse it)."""
        separator = self.tokens.count(SEPARATOR)

        def ranked() -> Iterator[tuple[Memory, int]]:
            if limit_chars:
                # Insertion (seq) order, as a full partition shows them: an
                # updated entry's position is at the end, its seq is not.
                alive = partition.alive()
                live = np.arange(partition.size) if alive is None else np.flatnonzero(alive)
                order = live[np.argsort(partition.seq[live], kind="stable")].tolist()
            start, batch = 0, 64
            while True:
                if not limit_chars:
                    order = partition.by_confidence(start + batch)
                chunk = order[start : start + batch]
                if not chunk:
                    return
                for memory in partition.fetch(chunk):
                    if memory is not None:
                        shown = _injectable(settings, memory, _finding(memory))
                        yield shown, self.tokens.count(shown.content)
                start, batch = start + len(chunk), batch * 2

        budget = settings.max_injection_tokens
        entries = list(ranked()) if limit_chars else blocks.pick(ranked(), separator, budget)
        return blocks.tier_block(
            partition.tier,
            [m for m, _ in entries],
            partition.usage,
            limit_chars,
            costs=[cost for _, cost in entries],
            order=range(len(entries)),
            separator_cost=separator,
            max_tokens=budget,
            count=partition.count,
        )

    # --- turns --------------------------------------------------------------

    def inject(
        self,
        scope: Scope,
        session_id: str,
        *,
        user_message: str = "",
        recent_messages: Sequence[str] = (),
        given_keywords: Sequence[str] = (),
        strategy: str = "",
        max_memories: int = 0,
        max_tokens: int = 0,
    ) -> Injection:
        settings = self.settings(scope)
        if self.feed is not None and not self.feed.verified:
            self._verify([(tier, scope.owner(tier)) for tier in Tier])
        session = self._sessions.get(_session_key(scope, session_id), scope.agent_id, self._now())
        view = session.view
        frozen = settings.snapshot_refresh == "on_compaction"
        # Which of the view's partitions are still current, looked up once.
        fresh = self._fresh(view, scope) if view is not None else []
        hit = (
            view is not None
            and (view.scope is None or view.scope == scope)
            and (frozen or all(fresh))
        )
        if not hit:
            epoch, compacted = session.epoch, session.compacted
            view = self._view(scope, settings, force=compacted)
            self._sessions.attach(session, view, epoch)
            fresh = [True] * len(view.partitions)
        assert view is not None
        (self._hits if hit else self._misses).inc()

        # The turn block always reflects the store as of now (under
        # on_compaction too: only the frozen block waits for compaction).
        current = {
            p.tier: p if ok else self._partition((p.tier, scope.owner(p.tier)))
            for p, ok in zip(view.partitions, fresh, strict=True)
        }
        turn_ids: list[str] = []
        elements: list[str] = []
        enabled = [current[t] for t in self._enabled_tiers(settings)]
        # When the frozen block already shows every memory there is (the usual
        # case with budgeted tiers), nothing is left to rank: skip keyword
        # extraction and ranking altogether.
        left = sum(p.count for p in enabled) - len(view.shown_ids)
        if settings.inject_memories and (left > 0 or not self._covers(view, enabled)):
            terms = self._keywords(
                settings, strategy, user_message, recent_messages, given_keywords
            )
            shown = set(view.shown_ids)
            cap = max_memories or settings.max_inject_memories
            budget = max_tokens or settings.max_injection_tokens
            findings = {k: v for p in enabled for k, v in p.flagged.items()}
            # Entries of a compact tier are scanned when read, not at load.
            rescan = any(isinstance(p, CompactPartition) for p in enabled)
            # Rank only as deep as the turn can use (the cap; what the frozen
            # block shows is left out), deeper only if the budget passed over
            # some, and then over at most MAX_SKIPPED more, as the frozen
            # block does: a compact tier reads every entry ranked.
            depth = cap
            deepest = cap + blocks.MAX_SKIPPED
            meaning = self._meaning(settings, user_message, terms, enabled)
            while True:
                ranked = rank(
                    enabled,
                    terms,
                    _weights(settings),
                    limit=depth,
                    leave_out=view.shown_seqs,
                    semantic=meaning,
                )
                elements.clear()
                turn_ids.clear()
                spent = self.tokens.count(blocks.turn_context([""]))
                for memory, _score in ranked:
                    if len(elements) >= cap:
                        break
                    if memory.id in shown:
                        continue
                    finding = findings.get(memory.id)
                    if finding is None and rescan:
                        finding = _finding(memory)
                    element = blocks.memory_element(_injectable(settings, memory, finding))
                    cost = self.tokens.count(element)
                    if spent + cost > budget:
                        continue
                    elements.append(element)
                    turn_ids.append(memory.id)
                    spent += cost
                if len(elements) >= cap or len(ranked) < depth or depth >= deepest:
                    break
                depth = min(depth * 4, deepest)
        turn = blocks.turn_context(elements)
        turn_tokens = self.tokens.count(turn)
        self._system_tokens.inc(view.system_tokens)
        self._turn_tokens.inc(turn_tokens)
        return Injection(
            system_block=view.system_block,
            turn_context=turn,
            generation=view.generation,
            sha256=view.sha256,
            cache_hit=hit,
            system_memory_ids=view.shown_ids,
            turn_memory_ids=tuple(turn_ids),
            system_tokens=view.system_tokens,
            turn_tokens=turn_tokens,
            token_counter=self.tokens.name,
            usage={tier: p.usage for tier, p in current.items()},
            snapshot=view,
        )

    @staticmethod
    @functools.cache
    def _enabled_tiers(settings: AgentSettings) -> tuple[Tier, ...]:
        return tuple(t for t in Tier if settings.policy(t).enabled)

    @staticmethod
    def _covers(view: View, enabled: list[AnyPartition]) -> bool:
        """Whether the frozen block shows exactly the entries of `enabled`."""
        return all(p in view.partitions for p in enabled)

    def _keywords(
        self,
        settings: AgentSettings,
        strategy: str,
        user_message: str,
        recent: Sequence[str],
        given: Sequence[str],
    ) -> list[str]:
        texts = [t for t in (user_message, *recent) if t.strip()]
        if not texts and not given:
            return []
        if (strategy or settings.inject_memories_strategy) == "llm":
            if given:
                return keywords(given)
            if not settings.keyword_llm_base_url:
                self._metrics.keyword_fallbacks.labels("no_endpoint").inc()
                return keywords(texts)
            model = KeywordModel(
                settings.keyword_llm_base_url,
                settings.keyword_llm_model,
                settings.keyword_llm_api_key,
                settings.keyword_llm_timeout_seconds,
            )
            pause = self._keyword_pauses.setdefault(model.base_url, Pause())
            if pause.remaining():
                self._metrics.keyword_fallbacks.labels("paused").inc()
                return keywords(texts)
            try:
                found = model.keywords("\n".join(texts))
            except KeywordModelError as exc:
                self._metrics.keyword_fallbacks.labels(exc.reason).inc()
                seconds = pause.failed()
                log.warning("keyword endpoint failed: %s; local keywords for %.0f s", exc, seconds)
            else:
                if pause.succeeded():
                    log.info("keyword endpoint answering again")
                return found
        return keywords([*texts, *given])

    def notify_compaction(self, scope: Scope, session_id: str) -> bool:
        invalidated = self._sessions.invalidate(_session_key(scope, session_id), scope.agent_id)
        if invalidated:
            self._metrics.snapshot_invalidations.labels("compaction").inc()
        return invalidated

    def end_session(self, scope: Scope, session_id: str) -> bool:
        dropped = self._sessions.drop(_session_key(scope, session_id), scope.agent_id)
        if dropped:
            self._metrics.snapshot_invalidations.labels("session_end").inc()
        return dropped

    def stats(self) -> Stats:
        return Stats(
            len(self._sessions),
            len(self._views),
            len(self._partitions),
            self._sessions.agents,
            len(self._generations),
        )

    def evict_idle(self, now: float | None = None) -> int:
        """Evict idle and surplus sessions, and stop following partitions
        nothing holds any more; the janitor calls this periodically."""
        now = self._now() if now is None else now
        evicted = self._sessions.evict_idle(now)
        # Views still in use: the shared ones, and any a session still holds
        # (a cached turn touches neither the LRU nor its partitions' keys).
        views = [view for ref in self._views.valuerefs() if (view := ref()) is not None]
        held = {(p.tier, p.owner) for view in views for p in view.partitions}
        for agent_id, key, view in self._sessions.views():
            if view.scope is not None:
                held.update((p.tier, p.owner) for p in view.partitions)
            else:
                # The shared empty view stands for the session's own scope's
                # partitions: news of a write to them must still be heard.
                scope = _session_scope(agent_id, key)
                held.update((tier, scope.owner(tier)) for tier in Tier)
        self._partitions.expire(now - self._partition_ttl, keep=held)
        self._generations.retain(held.union(self._partitions.keys()))
        return evicted
