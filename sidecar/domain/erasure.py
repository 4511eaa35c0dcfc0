"""Forgetting: ForgetUser and DeleteScope in the domain, and how every
replica lets go of what showed the erased content.

The erasure itself is one transaction of the store (sidecar.storage.erasure). What
this process built from the erased partitions goes right after the commit,
before the call returns: the cached partitions (sidecar.domain.partition), the
sessions whose view showed them (sidecar.domain.sessions), the partitions' vectors
(sidecar.retrieval.semantic) and the edge's caches of rendered answers (`listeners`).
Every other replica does the same when its change feed delivers the
erasure (tier_state.erased), and a replica whose feed is not verified reads
it with the generations before trusting a cache (Partitions.verify). A
session frozen by `snapshot_refresh: on_compaction` never serves a view
built before an erasure of a partition it shows (Partitions.shows_erased,
checked on every cached turn, in memory).

Then the call waits out the feeds of the other replicas (see `settle`),
so that when it returns no replica injects or returns erased content.

Owns: the order of an erasure (lock, commit, let go, wait), the audit
target, and the let-go listener. Must not touch: SQL (sidecar.storage.erasure),
who may erase (sidecar.api.access, at the edge), gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.core.memory import Scope, Tier
from sidecar.core.metrics import Metrics
from sidecar.domain.partition import PartitionKey, Partitions
from sidecar.domain.sessions import SessionTable
from sidecar.domain.snapshots import View
from sidecar.retrieval.semantic import Semantic
from sidecar.storage.erasure import Erased, Notes
from sidecar.storage.store import Store


@dataclass(frozen=True, slots=True)
class Forgotten:
    """An erasure's counts, the sessions this process dropped, and how long
    the call waited for the other replicas' feeds (seconds)."""

    erased: Erased
    sessions: int
    settled_seconds: float


class Forgetting:
    """Erasures of one engine: ForgetUser and DeleteScope."""

    def __init__(
        self,
        store: Store,
        partitions: Partitions,
        sessions: SessionTable[View],
        semantic: Semantic | None,
        metrics: Metrics,
        *,
        sleep: Callable[[float], None] = time.sleep,
        listeners: Sequence[Callable[[], object]] = (),
    ) -> None:
        self._store = store
        self._partitions = partitions
        self._sessions = sessions
        self._semantic = semantic
        self._sleep = sleep
        self._dropped = metrics.snapshot_invalidations.labels("erasure")
        # Caches above the domain built from views (the service's prebuilt
        # answers): emptied on every erasure heard.
        self._listeners = tuple(listeners)

    def forget_user(
        self,
        user_id: str,
        *,
        actor: str,
        erase_notes: bool = False,
        authorize: Callable[[str], None] | None = None,
    ) -> Forgotten:
        """Erase the user's profile: the user tier of `user_id`, which every
        agent shares (the user tier belongs to the user_id alone). The agent
        notes written for the user (in a scope of `user_id`; belonging to
        their agents) are reported, and erased too with `erase_notes`; the
        audit log's target says which was chosen. `authorize(agent_id)`
        raises unless the caller may erase that agent's notes."""
        notes = Notes(user_id, erase_notes, authorize)
        target = {"user_id": user_id, "agent_notes": "erased" if erase_notes else "reported"}
        # Their partitions' stripes too, as a write holds them (the store
        # reads the notes again under its locks).
        held = self.notes_written_for(user_id) if erase_notes else []
        extra = sorted({(Tier.MEMORY, agent_id) for agent_id, _ in held}, key=lambda k: k[1])
        return self._erase([(Tier.USER, user_id)], actor, "ForgetUser", target, notes, extra)

    def notes_written_for(self, user_id: str) -> list[tuple[str, str]]:
        """(agent_id, id) of the agent notes written for the user, oldest first."""
        return self._store.erasure.notes_written_for(user_id)

    def delete_scope(self, scope: Scope, tiers: Sequence[Tier], *, actor: str) -> Forgotten:
        """Erase the scope's tiers: the agent's notes (agent_id) and/or the
        user's profile (user_id)."""
        target = {
            "agent_id": scope.agent_id,
            "user_id": scope.user_id,
            "tiers": ",".join(t.value for t in tiers),
        }
        return self._erase([(t, scope.owner(t)) for t in tiers], actor, "DeleteScope", target)

    def _erase(
        self,
        keys: list[PartitionKey],
        actor: str,
        action: str,
        target: dict[str, str],
        notes: Notes | None = None,
        noted: Sequence[PartitionKey] = (),
    ) -> Forgotten:
        # The partitions' stripes, as a write holds them: no load of them
        # interleaves, so nothing read before the commit is cached after it.
        held = [*keys, *noted]
        with self._partitions.writing(held):
            with self._partitions.erasing(held) as heard:
                erased = self._store.erasure.erase(
                    keys, actor=actor, action=action, target=target, notes=notes
                )
            # Each partition's newest erasure: this one, one found committed
            # (a retry after a crash, another replica's), or one the feed
            # brought meanwhile. Applied here even when nothing was left to
            # erase: this process may not have heard of the earlier one yet.
            newest = dict(erased.earlier)
            for key, generation in (*erased.partitions, *heard.items()):
                newest[key] = max(newest.get(key, 0), generation)
            dropped = sum(self._partitions.erased(key, g) for key, g in newest.items())
        # Other replicas may not have heard of an earlier erasure either.
        return Forgotten(erased, dropped, self.settle() if newest else 0.0)

    def settle(self) -> float:
        """Wait until every replica has delivered the erasure or stopped
        trusting its caches; the seconds waited.

        A replica serves from its caches only while its change feed is
        verified: its last successful cycle began less than `stale_after`
        ago (sidecar.storage.changes), and a successful cycle delivers what was
        committed before it began (the poller reads every state row past its
        watermark; the listener's heartbeat answers after the notifications
        sent before it, which the next cycle hands on). So `stale_after`
        after the commit every replica has either delivered the erasure or,
        its feed unverified, reads the generations and erasures of what a
        call uses from the database first (Partitions.verify): no registry
        of replicas is needed. One more interval covers a notification
        received by a heartbeat and handed on by the cycle after it.
        Replicas must share these settings (change_poll_ms,
        change_heartbeat_ms): one with a longer interval would need a longer
        wait. Without a feed this process is the database's only reader.
        """
        feed = self._partitions.feed
        if feed is None:
            return 0.0
        started = time.monotonic()
        self._sleep(feed.settle_seconds)
        return time.monotonic() - started

    def let_go(self, key: PartitionKey, generation: int, followed: bool) -> int:
        """Drop what this process built from the partition before its
        erasure at `generation`; how many sessions went. A listener of
        Partitions.on_erased (wired by sidecar.domain.rooms)."""
        dropped = 0
        if followed:

            def showed(view: View) -> bool:
                return view.scope is not None and any(
                    (p.tier, p.owner) == key and p.generation < generation for p in view.partitions
                )

            dropped = self._sessions.drop_where(showed)
            if dropped:
                self._dropped.inc(dropped)
        if self._semantic is not None:
            self._semantic.forget(key)
        for listener in self._listeners:
            listener()
        return dropped
