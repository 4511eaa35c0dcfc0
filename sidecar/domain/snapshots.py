"""Snapshots: a scope's frozen block, built once and shared while current.

A `View` is a scope's snapshot: the rendered frozen block (both tiers,
sidecar.retrieval.blocks) and the partitions it came from. One view serves every
session of that scope and generation, and is kept only while some session
holds it (a weak dictionary). Scopes with nothing ever written share one
view per settings, so a new agent's session costs a session, not a snapshot.

A view is current while each of its partitions is (sidecar.domain.partition);
building one reads the partitions through sidecar.domain.partition, never the
database. A large tier's block reads only the entries it shows.

Locks: a view stripe (64, by scope) is held while a view is built, outside
any partition stripe, which loading a partition takes inside it.

Owns: views, their rendering and the shared empty view. Must not touch:
sessions (the engine attaches views to them), the turn block, the store.
"""

from __future__ import annotations

import hashlib
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from sidecar.config.settings import AgentSettings
from sidecar.core.memory import SEPARATOR, Memory, Scope, Tier, Usage
from sidecar.core.tokens import TokenCounter
from sidecar.domain.partition import STRIPES, AnyPartition, Partitions
from sidecar.retrieval import blocks, scanner
from sidecar.retrieval.compact import CompactPartition
from sidecar.retrieval.partition import Partition


@dataclass(frozen=True, slots=True, weakref_slot=True, eq=False)
class View:
    """A scope's snapshot: the frozen block and where it came from.

    Scopes with nothing ever written to any tier share one view per settings
    (`scope` None, see Snapshots._empty_view): a flood of new agents then
    costs no snapshot each. Its partitions are empty stand-ins for every such
    scope's; whether it is still current is judged by the generations of the
    session's own scope (see Snapshots.fresh).
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
    # When the first entry it shows expires (a POSIX time; inf: none will):
    # it is then stale, even when frozen until compaction (Snapshots.expired).
    expires: float = math.inf
    # A clock set back before this (a POSIX time) may show entries it was
    # built without, as expired but not removed yet: it is stale then too.
    # Its partitions' `hidden`, or when it read a compact tier's entries.
    hidden: float = -math.inf

    @property
    def content_key(self) -> tuple[object, ...]:
        """Equal for views that answer with the same frozen block."""
        return (self.sha256, self.generation, self.system_tokens, self.shown_ids)


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


class Snapshots:
    """The current view of each scope, built at most once however many ask."""

    def __init__(self, partitions: Partitions, tokens: TokenCounter) -> None:
        self._partitions = partitions
        self._tokens = tokens
        self._views: weakref.WeakValueDictionary[tuple[str, str], View] = (
            weakref.WeakValueDictionary()
        )
        # The view shared by every scope with nothing written, per settings; see View.
        self._empty_views: dict[AgentSettings, View] = {}
        self._locks = [threading.Lock() for _ in range(STRIPES)]

    def __len__(self) -> int:
        """Per-scope views (the shared empty ones are not counted)."""
        return len(self._views)

    def alive(self) -> list[View]:
        """The per-scope views still held by someone."""
        return [view for ref in self._views.valuerefs() if (view := ref()) is not None]

    def fresh(self, view: View, scope: Scope) -> list[bool]:
        """Which of the view's partitions are still current for this scope."""
        is_fresh = self._partitions.is_fresh
        if view.scope is not None:
            return [is_fresh(p) for p in view.partitions]
        # The shared empty view: current while the scope's own partitions are
        # still at generation 0 as far as this process knows (they stay
        # followed while a session holds it, see MemoryEngine.evict_idle).
        # Stale in part is stale in all: the turn then reads the scope's own
        # partitions, so no stand-in (owned by nobody) reaches ranking.
        fresh = [is_fresh(p, scope.owner(p.tier)) for p in view.partitions]
        return fresh if all(fresh) else [False] * len(fresh)

    def current(self, view: View, fresh: Sequence[bool]) -> bool:
        """Whether the view's frozen block is current, given which of its
        partitions are fresh (`fresh`): each is, or is behind only by the
        expiry sweep's removal of entries hidden before any the view shows
        (Partitions.swept_only). Not judged by the clock (see expired)."""
        if view.scope is None:
            return all(fresh)
        swept_only = self._partitions.swept_only
        return all(
            ok or swept_only(p, view.expires) for p, ok in zip(view.partitions, fresh, strict=True)
        )

    def expired(self, view: View) -> bool:
        """Whether an entry the view shows has expired, or one it leaves out
        as expired shows again (the clock was set back): by the clock alone,
        so every replica sees it with no write and no query."""
        now = self._partitions.clock().timestamp()
        return not view.hidden <= now < view.expires

    def _is_current(self, view: View) -> bool:
        fresh = [self._partitions.is_fresh(p) for p in view.partitions]
        return not self.expired(view) and self.current(view, fresh)

    def get(self, scope: Scope, settings: AgentSettings, *, force: bool) -> View:
        """The scope's current snapshot; built once however many callers ask."""
        key = (scope.agent_id, scope.user_id)
        view = self._views.get(key)
        if view is not None and not force and self._is_current(view):
            return view
        with self._locks[hash(key) % STRIPES]:
            view = self._views.get(key)
            if view is not None and not force and self._is_current(view):
                return view
            partitions = tuple(
                self._partitions.get((tier, scope.owner(tier)), force=force) for tier in Tier
            )
            if all(p.generation == 0 and not p.count for p in partitions):
                return self._empty_view(settings)
            view = self._build(scope, partitions, settings)
            self._views[key] = view
            return view

    def _empty_view(self, settings: AgentSettings) -> View:
        """The view of every scope with nothing ever written (generation 0,
        no rows: a migrated partition may hold rows at generation 0), under
        these settings. Built once; kept for good (one per distinct settings)."""
        view = self._empty_views.get(settings)
        if view is None:
            view = self._build(None, _STAND_INS, settings)
            view = self._empty_views.setdefault(settings, view)
        return view

    def _build(
        self, scope: Scope | None, partitions: tuple[AnyPartition, ...], settings: AgentSettings
    ) -> View:
        count = self._tokens.count
        mode = settings.content_scanning
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
                    scanner.injectable(mode, memory, finding)
                    for memory, finding in zip(partition.memories, partition.findings, strict=True)
                ]
                costs = [
                    tokens if shown_memory is memory else count(shown_memory.content)
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
                        separator_cost=count(SEPARATOR),
                        max_tokens=settings.max_injection_tokens,
                    )
                )
        text = blocks.system_block(parts)
        shown_seqs = frozenset(m.seq for part in parts if part for m in part.shown)
        expires = [m.expires_at.timestamp() for p in parts if p for m in p.shown if m.expires_at]
        hidden = [p.hidden for p in partitions]
        if any(isinstance(p, CompactPartition) for p in partitions) and parts:
            # Its entries were read back by the clock, after this.
            hidden.append(self._partitions.clock().timestamp())
        return View(
            scope=scope,
            partitions=partitions,
            generation=max(p.generation for p in partitions),
            system_block=text,
            sha256=_digest(text),
            shown_ids=tuple(m.id for part in parts if part for m in part.shown),
            shown_seqs=shown_seqs or _NO_SEQS,
            system_tokens=count(text),
            expires=min(expires, default=math.inf),
            hidden=max(hidden),
        )

    def _compact_block(
        self, partition: CompactPartition, limit_chars: int, settings: AgentSettings
    ) -> blocks.TierBlock | None:
        """A large tier's block, as blocks.tier_block picks it, reading from
        the database only the entries it looks at. Unlimited (the usual
        large tier): by rank, in growing batches. Budgeted: every entry (the
        response limit may then refuse it)."""
        separator = self._tokens.count(SEPARATOR)
        mode = settings.content_scanning

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
                        shown = scanner.shown(mode, memory)
                        yield shown, self._tokens.count(shown.content)
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
