"""Writes as one value each: what an add or an update asks the store to
write, when the entry it writes expires, the tier policy it is held to, and
the checks every write makes before it changes a row.

The engine builds the values (sidecar.domain.engine) from what the edges
and the model's tools ask, with the expiry resolved by
sidecar.domain.expiry; the store takes them whole (`Store.add`,
`Store.update`) and runs the checks inside its write transaction. Nothing
in a value is checked when it is made (the edges check fields, the store
the budget and duplicates).

Owns: NewEntry, Edit, Expires, TierPolicy, and the refusals of a write for
a caller gone, a disabled tier, or a full budget. Must not touch: Peewee,
SQL or a connection (sidecar.storage.store writes), the agent's
configuration (sidecar.config.settings makes the policies, the engine
resolves the default expiry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import NamedTuple

from sidecar.core.errors import (
    BudgetExceeded,
    CallerGone,
    EditConflict,
    EntryTooLarge,
    FailedPrecondition,
    Reason,
)
from sidecar.core.memory import Memory, Scope, Tier, Usage

# Whether the caller still waits for the write (False: cancelled, or past its deadline).
Wanted = Callable[[], bool]


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """What the calling agent's configuration says about one tier."""

    limit_chars: int
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class Expires:
    """When a written entry expires: at `micros` (microseconds, as the store
    keeps times), never (`micros` None), or, for an edit, as it did before
    (`kept`). Made by the named constructors."""

    micros: int | None = None
    kept: bool = False

    @classmethod
    def at(cls, micros: int) -> Expires:
        return cls(micros)

    @classmethod
    def never(cls) -> Expires:
        return cls(None)

    @classmethod
    def unchanged(cls) -> Expires:
        """An edit that leaves the entry's expiry as it was."""
        return cls(None, kept=True)

    def applied(self, before: int | None) -> int | None:
        """The expiry of an entry that expired at `before` once written."""
        return before if self.kept else self.micros


@dataclass(frozen=True, slots=True)
class NewEntry:
    """An entry to add to a scope's tier.

    A retry carrying the `idempotency_key` of an earlier add returns the
    entry that add stored (the key is remembered for a day). The row
    records the scope's user_id and `session_id` (a tool call's; "" for
    none) as who it was written for (schema 10)."""

    scope: Scope
    tier: Tier
    content: str
    category: str = ""
    confidence: float = 1.0
    idempotency_key: str = ""
    session_id: str = ""


@dataclass(frozen=True, slots=True)
class Edit:
    """A change to one entry of a scope, named by `memory_id`, or (with
    `match`, and memory_id "") the one entry of `tier` whose content holds
    `match`. A field left None stays as it is."""

    scope: Scope
    memory_id: str = ""
    _: KW_ONLY
    match: str = ""
    tier: Tier = Tier.MEMORY
    content: str | None = None
    category: str | None = None
    confidence: float | None = None
    # The entry's content as the edit was computed from (a substring edit
    # of the model's tools): a row that says anything else is not changed.
    expected: str | None = None


class Written(NamedTuple):
    """What a write did: the entry, the tier's usage after, and the generations
    of its partition before and after (equal when nothing changed)."""

    memory: Memory
    usage: Usage
    created: bool
    previous: int
    generation: int
    # Seqs of the partition's expired entries the write removed first.
    expired: tuple[int, ...] = ()


# The defaults of an add and of an edit (a signature's default is built once).
NEVER = Expires.never()
UNCHANGED = Expires.unchanged()


def require_caller(still_wanted: Wanted | None) -> None:
    """Refuse to write for a caller that has gone.

    Checked after the write lock is taken: a call that waited on the lock
    past its deadline, or was cancelled, changes nothing.
    """
    if still_wanted is not None and not still_wanted():
        raise CallerGone("the caller cancelled or its deadline passed; nothing was written")


def require_expected(edit: Edit, content: str) -> None:
    """Refuse an edit computed from content the entry no longer holds
    (checked with the partition locked: no writer can change it after)."""
    if edit.expected is not None and content != edit.expected:
        raise EditConflict("the entry changed while it was being edited; edit it again")


def require_enabled(tier: Tier, policy: TierPolicy) -> None:
    if not policy.enabled:
        raise FailedPrecondition(
            f"the {tier.label} tier is disabled for this agent; writes to it are refused",
            reason=Reason.TIER_DISABLED,
            metadata={"tier": tier.value},
        )


def check_budget(tier: Tier, policy: TierPolicy, used: int, added: int, entry: int) -> None:
    """Refuse a write that takes the tier (`used` chars) past its budget:
    `added` chars more, for an entry of `entry` chars (the rest of `added`,
    for a new entry, is its separator)."""
    limit = policy.limit_chars
    if not limit or used + added <= limit:
        return
    if entry > limit:
        raise EntryTooLarge(tier=tier.value, label=tier.label, used=used, limit=limit, entry=entry)
    raise BudgetExceeded(
        tier=tier.value,
        label=tier.label,
        used=used,
        limit=limit,
        requested=added,
        separator=max(added - entry, 0),
    )
