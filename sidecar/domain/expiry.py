"""Expiry: when a new or changed entry expires, and the sweep that removes
expired entries.

An entry's expiry is an absolute time (microseconds, as the store keeps
created_at), given as a time or as seconds from now, or else the agent's
default for the tier (`memory_ttl_seconds`, `user_ttl_seconds`; 0: never).
An expired entry is invisible from the moment it expires, on every replica
and with no write (the store's reads leave it out, a cached partition or
view showing it is stale by the clock: sidecar.domain.partition,
sidecar.domain.snapshots). Removing the rows is this module's sweep, and every
write removes its own partition's first (sidecar.storage.expiry), but only
once their expiry is server.expiry_grace_seconds old: until then a clock
set back shows an entry again (the caches and views that left it out are
stale by the clock then, as they are when an entry they show expires).

The sweep is a steppable loop (`run_once(now)`, started by sidecar.api.server):
each step removes up to `batch` expired rows per partition, one write
transaction per partition (its state row locked, an `expire` event per
entry, the generation advanced so other replicas hear of it through the
change feed), then updates this process's caches as a delete does, except
that views stay current: what a batch removes was hidden already
(sidecar.domain.partition, `swept_only`). The background sweep rests after
each batch (PACE), so a mass expiry leaves turns and writes their share.

Owns: resolving and checking requested expiries (a write's `Expires`, made
here only), the sweep's steps. Must not touch: gRPC or protobuf
(sidecar.api.service converts them), SQL (sidecar.storage.expiry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sidecar.config.settings import Config
from sidecar.core.clock import from_micros, to_micros
from sidecar.core.errors import InvalidArgument, Reason
from sidecar.core.memory import Scope, Tier
from sidecar.domain.partition import Partitions
from sidecar.storage.expiry import Swept
from sidecar.storage.store import Store
from sidecar.storage.writes import Expires

log = logging.getLogger("sidecar.expiry")

# How long the background sweep rests after each batch, as a multiple of
# the time the batch took: a sweep of a mass expiry (a hundred thousand
# rows, hundreds of batches) then takes at most a quarter of the time (its
# thread's CPU, the write lock) while it runs. At 1.0 (half), turns on a
# tier of a million entries ran 1.67x slower at p50 during such a sweep
# (bench section 19, two shared cores); the sweep takes longer instead.
PACE = 3.0

# The furthest an expiry may lie ahead: past this a TTL is a mistake (a
# timestamp passed as seconds), not a plan. 100 years.
MAX_TTL_SECONDS = 100 * 365 * 24 * 3600


@dataclass(frozen=True, slots=True)
class Requested:
    """The expiry fields of a write, as the caller set them."""

    expires_at: datetime | None = None
    ttl_seconds: int = 0
    # UpdateMemory only: the entry never expires.
    clear: bool = False

    @property
    def given(self) -> bool:
        return self.expires_at is not None or self.ttl_seconds != 0 or self.clear


# Nothing asked: on an add, the agent's default for the tier (see
# Expiry.for_add); on an update, the entry's expiry as it was.
AS_CONFIGURED = AS_BEFORE = Requested()


class Expiry:
    """Expiries of new entries, and the sweep, over one store and its caches."""

    def __init__(
        self, config: Config, store: Store, partitions: Partitions, *, batch: int = 500
    ) -> None:
        self._config = config
        self._store = store
        self._partitions = partitions
        self.batch = batch

    def now(self) -> int:
        """The injected clock's time, in microseconds."""
        return to_micros(self._store.clock())

    # --- what a write asks for ------------------------------------------------

    def for_add(self, scope: Scope, tier: Tier, requested: Requested) -> Expires:
        """When a new entry expires: as asked, else the agent's default for
        the tier."""
        if requested.given:
            return Expires.at(self._checked(requested))
        settings = self._config.for_agent(scope.agent_id)
        ttl = settings.memory_ttl_seconds if tier is Tier.MEMORY else settings.user_ttl_seconds
        return Expires.at(self.now() + ttl * 1_000_000) if ttl else Expires.never()

    def for_update(self, requested: Requested) -> Expires:
        """When a changed entry expires: as asked, never (`clear`), or, when
        nothing is asked, as before."""
        if requested.clear and (requested.expires_at is not None or requested.ttl_seconds):
            raise _conflict("clear_expiry")
        if requested.clear:
            return Expires.never()
        return Expires.at(self._checked(requested)) if requested.given else Expires.unchanged()

    def _checked(self, requested: Requested) -> int:
        """The asked expiry in microseconds, refused when out of range."""
        if requested.expires_at is not None and requested.ttl_seconds:
            raise _conflict("ttl_seconds")
        now = self.now()
        if requested.expires_at is None:
            ttl = requested.ttl_seconds
            if not 0 < ttl <= MAX_TTL_SECONDS:
                raise InvalidArgument(
                    f"ttl_seconds must be between 1 and {MAX_TTL_SECONDS:,} (100 years), got {ttl}",
                    reason=Reason.TTL_OUT_OF_RANGE,
                    metadata={"field": "ttl_seconds", "ttl_seconds": ttl},
                )
            return now + ttl * 1_000_000
        at = to_micros(requested.expires_at)
        if at <= now:
            raise InvalidArgument(
                f"expires_at ({requested.expires_at.isoformat()}) is not in the future (now is "
                f"{from_micros(now).isoformat()}); an entry that expires at once would never be "
                "seen",
                reason=Reason.EXPIRES_AT_PAST,
                metadata={"field": "expires_at"},
            )
        if at > now + MAX_TTL_SECONDS * 1_000_000:
            raise InvalidArgument(
                f"expires_at ({requested.expires_at.isoformat()}) is more than 100 years ahead; "
                "leave it unset for an entry that never expires",
                reason=Reason.EXPIRES_AT_TOO_FAR,
                metadata={"field": "expires_at"},
            )
        return at

    # --- the sweep ------------------------------------------------------------

    def run_once(
        self,
        now: datetime | None = None,
        *,
        max_batches: int = 1000,
        stop: Callable[[], bool] = lambda: False,
        rest: Callable[[float], object] | None = None,
    ) -> int:
        """Remove entries expired by `now` (the clock's time by default)
        minus the store's grace, at most `batch` per partition per
        transaction and `max_batches` transactions in all, until `stop` says
        so; return how many were removed. With `rest` (the background
        sweep's: its stop event's wait), rest after each batch that removed
        something, PACE times as long as it took."""
        at = self.now() if now is None else to_micros(now)
        removed = batches = 0
        while batches < max_batches and not stop():
            due = self._store.expiry.due(at, self.batch)
            if not due:
                break
            for tier, owner in due:
                if stop():
                    break
                key = (tier, owner)
                started = time.monotonic()
                # A write of this process to the partition and the update of
                # its cached copy never interleave with this batch.
                with self._partitions.writing([key]):
                    swept = self._sweep(key, at)
                    self._partitions.swept(key, swept)
                removed += len(swept.removed)
                batches += 1
                if rest is not None and swept.removed:
                    rest(PACE * (time.monotonic() - started))
        if removed:
            log.debug("expiry sweep removed %d entries", removed)
        return removed

    def _sweep(self, key: tuple[Tier, str], at: int) -> Swept:
        """One batch of one partition. Its run of removals is noted before
        the commit: the change feed may hear of the new generation before
        this thread gets on, and a turn in between must not take the batch
        for a write. A batch that fails is forgotten (its generation may
        be taken again by a write)."""
        tier, owner = key
        try:
            return self._store.expiry.sweep(
                tier, owner, at, self.batch, lambda swept: self._partitions.sweeps.add(key, swept)
            )
        except BaseException:
            self._partitions.sweeps.forget(key)
            raise


def _conflict(field: str) -> InvalidArgument:
    return InvalidArgument(
        f"set at most one of expires_at, ttl_seconds and clear_expiry (also {field} was set)",
        reason=Reason.EXPIRY_CONFLICT,
        metadata={"field": field},
    )
