"""Whole-store copies and bulk writes: backup, dump, restore, and importing
another store's entries (cagent's memory.db).

Module functions taking a Store, not a class the store builds: importing
applies the calling agent's TierPolicy, which sidecar.store defines, so this
module sits above the store and the store never imports it (no cycle). They
use the store's shared handle (`store.tables`) as the store's own methods
do. One of the storage modules, the only code that touches Peewee (see
sidecar.store); it never imports the engine, service, server, ranking or
compact.

Like the store's methods, each opens a pooled connection for its own
duration. restore and import_entries lock each partition they write and
advance its state row in their one transaction; restore applies no budget
(it puts back what a store held), import_entries checks the budget and
duplicates as every write does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from sidecar import schema
from sidecar._backend import PartitionState
from sidecar._tables import to_memory, usage_of
from sidecar.clock import to_micros
from sidecar.memory import SEPARATOR_CHARS, Memory, Scope, Tier
from sidecar.store import Store, TierPolicy


@dataclass(frozen=True, slots=True)
class LegacyEntry:
    """One entry brought in from another store (cagent's memory.db)."""

    id: str
    content: str
    category: str
    created_at_micros: int


@dataclass(slots=True)
class ImportReport:
    imported: list[LegacyEntry] = field(default_factory=list)
    # (entry, why it was left out)
    skipped: list[tuple[LegacyEntry, str]] = field(default_factory=list)


def backup(store: Store, destination: str, progress: Callable[[int, int], None]) -> None:
    """A consistent copy of the whole database, safe while others write."""
    backend = store.tables.backend
    with backend.guard(), backend.db.connection_context():
        backend.backup(destination, progress)


def dump(store: Store, batch: int = 1000) -> Iterator[tuple[str, Memory]]:
    """Every entry as (owner, memory), in insertion order, read in one
    snapshot, `batch` rows at a time (a driver may hold a whole result
    in memory: a million-entry store would)."""
    backend, Row = store.tables.backend, store.tables.rows
    after = 0
    with backend.guard(), backend.db.connection_context(), backend.read_transaction():
        while True:
            rows = list(Row.select().where(Row.seq > after).order_by(Row.seq).limit(batch))
            for row in rows:
                yield row.owner, to_memory(row)
            if len(rows) < batch:
                return
            after = rows[-1].seq


def restore(store: Store, entries: Iterable[tuple[str, Memory]]) -> tuple[int, list[str]]:
    """Insert entries exactly as given, in one transaction.

    Returns how many were inserted and the ids left out because an entry
    with that id already exists. Budgets are not applied: this restores
    what a store held, it does not write on an agent's behalf.
    """
    tables = store.tables
    backend, Row = tables.backend, tables.rows
    inserted, present = 0, []
    states: dict[tuple[str, Tier], PartitionState] = {}
    with backend.guard(), backend.db.connection_context(), backend.write_transaction():
        for owner, memory in entries:
            if Row.select().where(Row.memory_id == memory.id).exists():
                present.append(memory.id)
                continue
            key = (owner, memory.tier)
            if key not in states:
                states[key] = backend.lock_partition(owner, memory.tier.value)
            state = states[key]
            states[key] = state._replace(
                content_chars=state.content_chars + len(memory.content),
                entry_count=state.entry_count + 1,
            )
            tables.insert(
                memory.id,
                owner,
                memory.tier,
                memory.content,
                memory.category,
                memory.confidence,
                to_micros(memory.created_at),
                updated_at=to_micros(memory.updated_at),
                expires_at=to_micros(memory.expires_at) if memory.expires_at else None,
            )
            inserted += 1
        for (owner, tier), state in states.items():
            tables.advance(owner, tier, state)
    if inserted:
        schema.analyze(backend)
    return inserted, present


def import_entries(
    store: Store, scope: Scope, tier: Tier, entries: Iterable[LegacyEntry], policy: TierPolicy
) -> ImportReport:
    """Adopt entries with their ids and times, all in one transaction.

    Entries are taken in the order given; one that would overflow the tier,
    duplicates an entry already there, or reuses an id already taken is
    left out and reported, and the rest go on.
    """
    owner = scope.owner(tier)
    report = ImportReport()
    tables = store.tables
    backend, Row = tables.backend, tables.rows
    with backend.guard(), backend.db.connection_context(), backend.write_transaction():
        state = backend.lock_partition(owner, tier.value)
        used, count = usage_of(state).used_chars, state.entry_count
        chars = state.content_chars
        for entry in entries:
            if not entry.content:
                report.skipped.append((entry, "empty content"))
                continue
            if Row.select().where(Row.memory_id == entry.id).exists():
                report.skipped.append((entry, "id already present"))
                continue
            if tables.identical(owner, tier, entry.content) is not None:
                report.skipped.append((entry, "identical entry already present"))
                continue
            added = len(entry.content) + (SEPARATOR_CHARS if count else 0)
            if policy.limit_chars and used + added > policy.limit_chars:
                report.skipped.append(
                    (
                        entry,
                        f"does not fit: needs {added:,} chars, "
                        f"{max(policy.limit_chars - used, 0):,} free",
                    )
                )
                continue
            tables.insert(
                entry.id,
                owner,
                tier,
                entry.content,
                entry.category,
                1.0,
                entry.created_at_micros,
            )
            used, count, chars = used + added, count + 1, chars + len(entry.content)
            report.imported.append(entry)
        if report.imported:
            tables.advance(owner, tier, state._replace(content_chars=chars, entry_count=count))
    if report.imported:
        schema.analyze(backend)
    return report
