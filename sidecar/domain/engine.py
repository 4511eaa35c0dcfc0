"""The engine: the domain's one entry point, a thin orchestrator.

Every RPC the service layer serves is one call here. The engine screens and
writes through the store, searches, and answers turns, by delegating to the
rooms that own each concern, from the bottom up:

- sidecar.domain.partition: partitions (a tier of one owner, as of a generation)
  and their freshness; the one room that loads a tier, large tiers through
  sidecar.domain.index, which also keeps their persisted indexes current.
- sidecar.domain.snapshots: a scope's frozen block (a `View`), shared by every
  session of that scope and generation while one holds it.
- sidecar.domain.sessions: which view each runtime session is using.
- sidecar.domain.queries and sidecar.domain.turns: a turn's terms and semantic scores,
  and its transient block.

A cached turn reads only these, so it runs no database query at all (a
compact partition reads the entries it returns). While the change feed is
unverified, every call first reads the generations of the partitions it
uses from the database.

Locks, outermost first: a view stripe (snapshots), then a partition stripe
(partitions), then the short-lived dictionary locks inside Generations,
the LRU and SessionTable. Nothing is ever taken in the other order.

Must not touch: gRPC (sidecar.api.service renders what this returns) or Peewee
(sidecar.storage.store).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from sidecar.config.settings import AgentSettings, Config
from sidecar.core.errors import BudgetExceeded, InvalidArgument, Reason, SimilarExists
from sidecar.core.memory import Memory, Scope, Tier, Usage
from sidecar.core.metrics import Metrics
from sidecar.core.tokens import TokenCounter
from sidecar.domain.erasure import Forgetting
from sidecar.domain.expiry import AS_BEFORE, AS_CONFIGURED, Expiry, Requested
from sidecar.domain.export import Exports
from sidecar.domain.partition import AnyPartition, PartitionKey, Partitions
from sidecar.domain.queries import Queries, weights
from sidecar.domain.replication import COMPACTION, END, Replication
from sidecar.domain.sessions import Limits, SessionTable, session_key, session_scope
from sidecar.domain.snapshots import Snapshots, View
from sidecar.domain.turns import Injection, Turns, enabled_tiers
from sidecar.domain.watch import Watches
from sidecar.retrieval import scanner
from sidecar.retrieval.compact import CompactPartition
from sidecar.retrieval.embedding import Encoder
from sidecar.retrieval.keywords import keywords
from sidecar.retrieval.ranking import rank
from sidecar.retrieval.semantic import Floats, Semantic
from sidecar.retrieval.similarity import Similar
from sidecar.storage.store import Store
from sidecar.storage.vectors import Vector
from sidecar.storage.writes import Edit, NewEntry, Wanted

log = logging.getLogger("sidecar.engine")


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


def _edited_partitions(scope: Scope, match: str, tier: Tier) -> list[PartitionKey]:
    """The partitions an update or delete may change: by id, either of the
    scope's (the id does not say which tier holds it); by match, the one
    tier named."""
    tiers = [tier] if match else list(Tier)
    return [(t, scope.owner(t)) for t in tiers]


class Added(NamedTuple):
    """What an add did: the entry (the existing one when `created` is
    False), its tier's usage, and the entries the new one nearly repeats
    (sidecar.retrieval.similarity; empty under similar_writes: allow, and when
    nothing new was written)."""

    memory: Memory
    usage: Usage
    created: bool
    similar: tuple[Similar, ...]
    # The generation written (when nothing was, the partition's current one).
    generation: int = 0


def _require_user(settings: AgentSettings, scope: Scope, tier: Tier) -> None:
    """Refuse a user-profile add without a user_id, unless the agent's
    settings mean the profile every caller without one shares."""
    if tier is Tier.USER and not scope.user_id and not settings.shared_user_profile:
        raise InvalidArgument(
            "a user-profile write needs scope.user_id: without one it would land in the "
            "profile shared by every caller that sends none; send the user's id, or set "
            "shared_user_profile: true for this agent if that shared profile is meant",
            reason=Reason.USER_ID_REQUIRED,
            metadata={"field": "scope.user_id", "tier": tier.value},
        )


def _screen(metrics: Metrics, settings: AgentSettings, field: str, text: str) -> None:
    """Refuse (strict) or log (warn) text with a refused finding; count
    text stored to be shown quoted."""
    mode = settings.content_scanning
    if mode == "off":
        return
    finding = scanner.scan(text)
    if finding is None:
        return
    action = "quoted" if not finding.refused else "refused" if mode == "strict" else "warned"
    metrics.scan_findings.labels(finding.pattern, action).inc()
    if action == "quoted":
        return
    if mode == "strict":
        raise InvalidArgument(
            f"{field} was refused by the content scan ({finding.pattern}: "
            f"{finding.excerpt!r}); memories are injected into system prompts",
            reason=Reason.CONTENT_REJECTED,
            metadata={"field": field, "pattern": finding.pattern},
        )
    log.warning(
        "stored a memory that fails the content scan (%s); it is never injected verbatim",
        finding.pattern,
    )


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
        # Semantic retrieval (server.semantic_encoder), when an encoder is given.
        self.semantic = _semantic(config, store, self._metrics, encoder, now)
        self.tokens = tokens or TokenCounter()
        self._now = now
        self.partitions = Partitions(
            config, store, self._metrics, self.tokens, now=now, changes=changes
        )
        # Without a feed this engine assumes it is the database's only writer.
        self.feed = self.partitions.feed
        self.expiry = Expiry(config, store, self.partitions, batch=config.server.expiry_sweep_batch)
        self.watches = Watches(store.events, config.server, self._metrics, self.partitions)
        self.partitions.on_generation = self.watches.wake
        self._snapshots = Snapshots(self.partitions, self.tokens)
        self._queries = Queries(self._metrics, self.semantic)
        self._turns = Turns(self._queries, self.tokens)
        self.exports = Exports(store, config.server.max_concurrent_exports)
        self.partitions.on_erased.append(self.exports.erased)
        # A cached partition nobody has used for this long is let go (and
        # with it everything kept for its owner).
        self._partition_ttl = max(
            s.session_idle_ttl_seconds for s in (config.defaults, *config.agents.values())
        )
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
        # ForgetUser and DeleteScope, and letting go of what showed erased content.
        self.forgetting = Forgetting(
            store, self.partitions, self._sessions, self.semantic, self._metrics
        )
        # min_generation waits, and session events to and from other replicas.
        self.replication = Replication(self.partitions, self._sessions, self._metrics)
        # Labelled children looked up once: a cached turn touches them every time.
        self._hits = self._metrics.snapshot_lookups.labels("hit")
        self._misses = self._metrics.snapshot_lookups.labels("miss")
        self._system_tokens = self._metrics.injected_tokens.labels("system")
        self._turn_tokens = self._metrics.injected_tokens.labels("turn")

    def settings(self, scope: Scope) -> AgentSettings:
        return self._config.for_agent(scope.agent_id)

    # --- writes -------------------------------------------------------------

    @contextlib.contextmanager
    def _counting_rejections(self) -> Iterator[None]:
        try:
            yield
        except BudgetExceeded as exc:
            self._metrics.budget_rejections.labels(exc.tier).inc()
            raise

    def add(
        self,
        entry: NewEntry,
        *,
        expiry: Requested = AS_CONFIGURED,
        still_wanted: Wanted | None = None,
    ) -> Added:
        """Screen and store a new entry (`expiry`: as the caller asked, by
        default the agent's for the tier)."""
        scope, tier, content = entry.scope, entry.tier, entry.content
        # Every add (AddMemory, the model's tools) gets the agent's default TTL here.
        expires = self.expiry.for_add(scope, tier, expiry)
        settings = self.settings(scope)
        _require_user(settings, scope, tier)
        _screen(self._metrics, settings, "content", content)
        _screen(self._metrics, settings, "category", entry.category)
        key = (tier, scope.owner(tier))
        stored, held = self._embedding(content, [key])
        similar = self._queries.near_duplicates(settings, self.partitions, key, content, held)
        if similar and settings.similar_writes == "refuse":
            # Before anything is written, and not a budget rejection.
            nearest = similar[0]
            raise SimilarExists(
                tier=tier.value,
                memory_id=nearest.memory.id,
                content=nearest.memory.content,
                score=nearest.score,
            )
        with self.partitions.writing([key]), self._counting_rejections():
            written = self._store.add(
                entry,
                settings.policy(tier),
                expires=expires,
                still_wanted=still_wanted,
                vector=stored,
            )
            self.partitions.added(key, written)
            if self.semantic is not None:
                self.semantic.written(key, written, held, content_changed=True)
        similar = similar if written.created else ()
        return Added(written.memory, written.usage, written.created, similar, written.generation)

    def update(
        self,
        edit: Edit,
        *,
        expiry: Requested = AS_BEFORE,
        still_wanted: Wanted | None = None,
    ) -> tuple[Memory, Usage, int]:
        """Change the entry `edit` names (`expiry`: as the caller asked, by
        default as it was); the entry, usage, generation written."""
        expires = self.expiry.for_update(expiry)
        scope, content = edit.scope, edit.content
        settings = self.settings(scope)
        if content is not None:
            _screen(self._metrics, settings, "content", content)
        if edit.category is not None:
            _screen(self._metrics, settings, "category", edit.category)
        keys = _edited_partitions(scope, edit.match, edit.tier)
        stored, held = self._embedding(content, keys)
        with self.partitions.writing(keys), self._counting_rejections():
            written = self._store.update(
                edit,
                settings.policies(),
                expires=expires,
                still_wanted=still_wanted,
                vector=stored,
            )
            memory = written.memory
            key = (memory.tier, scope.owner(memory.tier))
            self.partitions.changed(key, written, memory)
            if self.semantic is not None:
                self.semantic.written(key, written, held, content_changed=content is not None)
        return memory, written.usage, written.generation

    def delete(
        self,
        scope: Scope,
        memory_id: str,
        *,
        still_wanted: Wanted | None = None,
        match: str = "",
        tier: Tier = Tier.MEMORY,
    ) -> tuple[Memory, Usage, int]:
        """Remove the entry named by `memory_id`, or by `match` in `tier`, as update."""
        with self.partitions.writing(_edited_partitions(scope, match, tier)):
            written = self._store.delete(
                scope, memory_id, still_wanted=still_wanted, match=match, tier=tier
            )
            memory = written.memory
            key = (memory.tier, scope.owner(memory.tier))
            self.partitions.changed(key, written, None)
            if self.semantic is not None:
                self.semantic.removed(key, written)
        return memory, written.usage, written.generation

    def _embedding(
        self, content: str | None, keys: Sequence[PartitionKey]
    ) -> tuple[Vector | None, Floats | None]:
        """New content's vector, as stored and as held (semantic.for_write),
        computed before any lock is taken: the encoder may take a while.
        None without semantic retrieval, without new content, or for a tier
        held compactly (ranked lexically: the vector would never be used)."""
        if self.semantic is None or content is None:
            return None, None
        if all(isinstance(self.partitions.cached(key), CompactPartition) for key in keys):
            return None, None
        return self.semantic.for_write(content)

    # --- reads --------------------------------------------------------------

    def list_memories(
        self,
        scope: Scope,
        tiers: Sequence[Tier],
        category: str,
        *,
        after_seq: int = 0,
        limit: int | None = None,
        include_expired: bool = False,
    ) -> tuple[list[Memory], dict[Tier, Usage]]:
        return self._store.list_memories(
            scope,
            tiers,
            category,
            after_seq=after_seq,
            limit=limit,
            include_expired=include_expired,
        )

    def usage(self, scope: Scope, tiers: Sequence[Tier]) -> dict[Tier, Usage]:
        """The tiers' usage now, as the scope sees them."""
        return self._store.usage(scope, tiers)

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
        self.partitions.verify(keys)
        partitions = [self.partitions.get(key) for key in keys]
        settings = self.settings(scope)
        terms = keywords([query])
        return rank(
            partitions,
            terms,
            weights(settings),
            match_all=match_all,
            category=category,
            limit=limit,
            semantic=None
            if match_all
            else self._queries.meaning(settings, query, terms, partitions),
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
        """A turn's blocks: check freshness, take the session's snapshot if
        still current or else the scope's current one (built or loaded
        through snapshots and partitions), then compose the turn block."""
        settings = self.settings(scope)
        if not self.partitions.verified:
            self.partitions.verify([(tier, scope.owner(tier)) for tier in Tier])
        view, fresh, hit = self._session_view(scope, session_id, settings)
        (self._hits if hit else self._misses).inc()

        # The turn block always reflects the store as of now (under
        # on_compaction too: only the frozen block waits for compaction).
        current = {
            p.tier: p if ok else self.partitions.get((p.tier, scope.owner(p.tier)))
            for p, ok in zip(view.partitions, fresh, strict=True)
        }
        turn, turn_ids = self._turns.context(
            settings,
            view,
            [current[t] for t in enabled_tiers(settings)],
            user_message=user_message,
            recent_messages=recent_messages,
            given_keywords=given_keywords,
            strategy=strategy,
            max_memories=max_memories,
            max_tokens=max_tokens,
        )
        return self._injection(view, hit, turn, turn_ids, current)

    def _session_view(
        self, scope: Scope, session_id: str, settings: AgentSettings
    ) -> tuple[View, list[bool], bool]:
        """The view the session's turn shows, which of its partitions are
        still current, and whether it is the session's own (a hit): the
        view the session holds while current (or frozen), else the scope's
        current one, now the session's."""
        session = self._sessions.get(session_key(scope, session_id), scope.agent_id, self._now())
        view = session.view
        # Unverified, the feed may miss another replica's compaction: no freezing.
        frozen = settings.snapshot_refresh == "on_compaction" and self.partitions.verified
        # Which of the view's partitions are still current, looked up once.
        fresh = self._snapshots.fresh(view, scope) if view is not None else []
        hit = (
            view is not None
            and (view.scope is None or view.scope == scope)
            # A frozen view is never served past an erasure of what it shows.
            and ((frozen and not self.partitions.shows_erased(view.partitions)) or all(fresh))
            and not self._snapshots.expired(view)
        )
        if not hit:
            epoch, compacted = session.epoch, session.compacted
            view = self._snapshots.get(scope, settings, force=compacted)
            self._sessions.attach(session, view, epoch)
            fresh = [True] * len(view.partitions)
        assert view is not None
        return view, fresh, hit

    def _injection(
        self,
        view: View,
        hit: bool,
        turn: str,
        turn_ids: tuple[str, ...],
        current: Mapping[Tier, AnyPartition],
    ) -> Injection:
        """What the turn answers, its tokens counted."""
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
            turn_memory_ids=turn_ids,
            system_tokens=view.system_tokens,
            turn_tokens=turn_tokens,
            token_counter=self.tokens.name,
            usage={tier: p.usage for tier, p in current.items()},
            snapshot=view,
        )

    def notify_compaction(self, scope: Scope, session_id: str) -> tuple[bool, bool]:
        """(whether this replica held the session, whether the others were told)."""
        invalidated = self._sessions.invalidate(session_key(scope, session_id), scope.agent_id)
        if invalidated:
            self._metrics.snapshot_invalidations.labels("compaction").inc()
        return invalidated, self.replication.publish(COMPACTION, scope, session_id)

    def end_session(self, scope: Scope, session_id: str) -> tuple[bool, bool]:
        """As notify_compaction."""
        dropped = self._sessions.drop(session_key(scope, session_id), scope.agent_id)
        if dropped:
            self._metrics.snapshot_invalidations.labels("session_end").inc()
        return dropped, self.replication.publish(END, scope, session_id)

    # --- housekeeping -------------------------------------------------------

    def indexing(self) -> bool:
        """Whether a compact index is being persisted (tests and the bench wait)."""
        return self.partitions.indexer.busy()

    def stop_indexing(self, timeout: float) -> bool:
        """Start no more index saves and wait up to `timeout` seconds for
        those under way; whether none is left (see Indexer.stop)."""
        return self.partitions.indexer.stop(timeout)

    def stats(self) -> Stats:
        return Stats(
            len(self._sessions),
            len(self._snapshots),
            len(self.partitions),
            self._sessions.agents,
            len(self.partitions.generations),
        )

    def evict_idle(self, now: float | None = None) -> int:
        """Evict idle and surplus sessions, and stop following partitions
        nothing holds any more; the janitor calls this periodically."""
        now = self._now() if now is None else now
        evicted = self._sessions.evict_idle(now)
        # Views still in use: the shared ones, and any a session still holds
        # (a cached turn touches neither the LRU nor its partitions' keys).
        held = {(p.tier, p.owner) for view in self._snapshots.alive() for p in view.partitions}
        for agent_id, key, view in self._sessions.views():
            if view.scope is not None:
                held.update((p.tier, p.owner) for p in view.partitions)
            else:
                # The shared empty view stands for the session's own scope's
                # partitions: news of a write to them must still be heard.
                scope = session_scope(agent_id, key)
                held.update((tier, scope.owner(tier)) for tier in Tier)
        self.partitions.expire(now - self._partition_ttl, held)
        return evicted
