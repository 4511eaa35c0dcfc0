"""Whole-store copies and bulk writes: backup, dump, restore, importing
another store's entries (cagent's memory.db), and the JSON-lines export
format (one line per entry) with the streamed reads ExportMemories makes.

Module functions taking a Store, not a class the store builds: they write
through the store's handle, so this module sits above the store and the
store never imports it (no cycle). They
use the store's shared handle (`store.tables`) as the store's own methods
do. One of the storage modules, the only code that touches Peewee (see
sidecar.storage.store); it never imports the engine, service, server, ranking or
compact.

Like the store's methods, each opens a pooled connection for its own
duration. restore and import_entries lock each partition they write and
advance its state row in their one transaction; restore applies no budget
(it puts back what a store held), import_entries checks the budget and
duplicates as every write does. Both log an `add` event per inserted
entry under the partition's new generation (WatchMemories). `exported`
holds one read transaction (one snapshot) for as long as its caller
iterates.

Owns: backup, dump, restore and import steps, the export line format
(export_line, parse_line) and the export's keyset read. Must not touch: the
engine, service or server, ranking, compact, grpc.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sidecar.core.clock import to_micros
from sidecar.core.errors import InvalidArgument, Reason, SidecarError
from sidecar.core.limits import caller_json
from sidecar.core.memory import SEPARATOR_CHARS, Memory, Scope, Tier, check_confidence
from sidecar.storage import schema
from sidecar.storage._backend import ROWS_PER_INSERT, PartitionState
from sidecar.storage._statements import Record, record_of, unexpired
from sidecar.storage._tables import Tables, to_memory, usage_of
from sidecar.storage.expiry import Purged, advance
from sidecar.storage.store import Store
from sidecar.storage.writes import TierPolicy


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


# --- the export format --------------------------------------------------------


def iso_time(moment: datetime) -> str:
    # As strftime("%Y-%m-%dT%H:%M:%S.%fZ"), at a third of the cost: an
    # export formats two per line.
    return moment.astimezone(UTC).isoformat(timespec="microseconds")[:-6] + "Z"


def export_line(owner: str, memory: Memory) -> str:
    """One entry as the JSON line `memory-sidecar import` reads (no newline)."""
    return json.dumps(
        {
            "id": memory.id,
            "tier": memory.tier.value,
            "owner": owner,
            "content": memory.content,
            "category": memory.category,
            "confidence": memory.confidence,
            "created_at": iso_time(memory.created_at),
            "updated_at": iso_time(memory.updated_at),
            # Only on entries that expire: older readers see the lines they knew.
            **({"expires_at": iso_time(memory.expires_at)} if memory.expires_at else {}),
            # Only on an agent note a for_user export includes as written
            # for its user (import reads it as an agent note like any other).
            **({"written_for_user_id": memory.written_for} if memory.written_for else {}),
        },
        ensure_ascii=False,
    )


def parse_line(number: int, line: str) -> tuple[str, Memory]:
    """One exported line back into (owner, memory); errors name the line."""
    try:
        item = caller_json("line", line)
        if not isinstance(item, dict):
            raise ValueError("not a JSON object")
        stamps = [
            datetime.fromisoformat(item[k].replace("Z", "+00:00"))
            for k in ("created_at", "updated_at")
        ]
        memory = Memory(
            id=str(item["id"]),
            tier=Tier(item["tier"]),
            content=str(item["content"]),
            category=str(item.get("category", "")),
            confidence=check_confidence(float(item.get("confidence", 1.0))),
            created_at=stamps[0],
            updated_at=stamps[1],
            expires_at=(
                datetime.fromisoformat(item["expires_at"].replace("Z", "+00:00"))
                if item.get("expires_at")
                else None
            ),
        )
        if not memory.id or not memory.content.strip():
            raise ValueError("empty id or content")
        return str(item["owner"]), memory
    except (ValueError, KeyError, TypeError, AttributeError, SidecarError) as exc:
        problem = exc.message if isinstance(exc, SidecarError) else str(exc)
        raise InvalidArgument(
            f"line {number}: {problem}", reason=Reason.IMPORT_LINE_INVALID
        ) from None


# --- reading everything, or some partitions, in one snapshot -------------------

# The owner of the partition an export reads the agent notes written for a
# user as (see `written_for`): no id holds a control character.
WRITTEN_FOR = "\x00written-for:"


def _after(
    store: Store, after: int, limit: int, partition: tuple[str, Tier] | None, live: bool = False
) -> list[Record]:
    """The next `limit` rows after seq `after`, in seq order: of one
    partition (owner, tier), or of the whole store. The one query the dump
    and the export read through, so a filter every export needs (expired
    entries, say) goes here."""
    Row = store.tables.rows
    # Tuples rather than model instances: building those took most of an
    # export's time.
    columns = [getattr(Row, name) for name in Record._fields]
    query = Row.select(*columns).where(Row.seq > after)
    if partition is not None and partition[0].startswith(WRITTEN_FOR):
        # idx_memories_written_for (written_for_user_id, tier, seq).
        user_id = partition[0].removeprefix(WRITTEN_FOR)
        query = query.where((Row.written_for_user_id == user_id) & (Row.tier == partition[1].value))
    elif partition is not None:
        owner, tier = partition
        # idx_memories_scope (owner, tier, seq): a range scan, whatever the
        # partition's size or the position.
        query = query.where((Row.owner == owner) & (Row.tier == tier.value))
    if live:
        # An export is a read like a list: expired entries the sweep has not
        # removed yet are left out. (The offline dump keeps them: a restore
        # of it is what the store held.)
        query = query.where(unexpired(Row, store.tables.now()))
    rows: Any = query.order_by(Row.seq).limit(limit).tuples()
    return [Record(*row) for row in rows]


def _walk(
    store: Store, after: int, batch: int, partition: tuple[str, Tier] | None, live: bool = False
) -> Iterator[Record]:
    """Rows after seq `after`, read `batch` at a time by keyset (seq >
    last): never more than one batch in memory, and no batch costs more
    than the one before (an OFFSET would)."""
    while True:
        rows = _after(store, after, batch, partition, live)
        yield from rows
        if len(rows) < batch:
            return
        after = rows[-1].seq


def dump(store: Store, batch: int = 1000) -> Iterator[tuple[str, Memory]]:
    """Every entry as (owner, memory), in insertion order, read in one
    snapshot, `batch` rows at a time (a driver may hold a whole result
    in memory: a million-entry store would)."""
    backend = store.tables.backend
    with backend.guard(), backend.db.connection_context(), backend.read_transaction():
        for row in _walk(store, 0, batch, None):
            yield row.owner, to_memory(row)


def exported(
    store: Store, partitions: Sequence[tuple[str, Tier]], after: Sequence[int], batch: int
) -> Generator[tuple[str, Memory]]:
    """The partitions' entries (owner, tier), each with a seq above its
    partition's in `after`, as (owner, memory) in insertion order (seq)
    across them, all from one read transaction: one snapshot however long
    the caller takes.

    Each partition is walked by keyset on its own index and the walks are
    merged by seq, so a batch is a range scan whatever the position, and at
    most `batch` rows per partition are held. The connection and the
    transaction are held until the iterator is exhausted or closed: close it
    (on the thread that iterated it) when the caller stops early.
    """
    backend = store.tables.backend
    with backend.guard(), backend.db.connection_context(), backend.read_transaction():
        walks = [
            _marked(_walk(store, seq, batch, partition, True), partition)
            for partition, seq in zip(partitions, after, strict=True)
        ]
        for row, written_for in heapq.merge(*walks, key=lambda marked: marked[0].seq):
            memory = to_memory(row)
            if written_for is not None:
                memory = dataclasses.replace(memory, written_for=written_for)
            yield row.owner, memory


def written_for(user_id: str) -> tuple[str, Tier]:
    """What an export reads as a partition: the agent notes written for
    the user (in a scope with this user_id, by any agent; schema 10)."""
    return WRITTEN_FOR + user_id, Tier.MEMORY


def _marked(
    rows: Iterator[Record], partition: tuple[str, Tier]
) -> Iterator[tuple[Record, str | None]]:
    """Each row with the user it was read as written for (None: a partition's own)."""
    owner = partition[0]
    user_id = owner.removeprefix(WRITTEN_FOR) if owner.startswith(WRITTEN_FOR) else None
    for row in rows:
        yield row, user_id


def restore(store: Store, entries: Iterable[tuple[str, Memory]]) -> tuple[int, list[str]]:
    """Insert entries exactly as given, in one transaction.

    Returns how many were inserted and the ids left out because an entry
    with that id already exists (or came earlier in `entries`). Budgets are
    not applied: this restores what a store held, it does not write on an
    agent's behalf. Entries go in batches (one lookup and one multi-row
    INSERT each), not a statement per entry.
    """
    tables = store.tables
    backend = tables.backend
    inserted, present = 0, []
    states: dict[tuple[str, Tier], PartitionState] = {}
    # Each partition's inserted ids: their `add` events, for WatchMemories.
    added: dict[tuple[str, Tier], list[str]] = {}
    seen: set[str] = set()
    with backend.guard(), backend.db.connection_context(), backend.write_transaction():
        for batch in _batches(entries, ROWS_PER_INSERT):
            taken = tables.taken_of([memory.id for _, memory in batch])
            rows: list[Record] = []
            for owner, memory in batch:
                if memory.id in taken or memory.id in seen:
                    present.append(memory.id)
                    continue
                seen.add(memory.id)
                key = (owner, memory.tier)
                if key not in states:
                    states[key] = backend.lock_partition(owner, memory.tier.value)
                state = states[key]
                states[key] = state._replace(
                    content_chars=state.content_chars + len(memory.content),
                    entry_count=state.entry_count + 1,
                )
                rows.append(record_of(memory, owner))
                added.setdefault(key, []).append(memory.id)
            tables.insert_many(rows)
            inserted += len(rows)
        now = to_micros(store.clock())
        for (owner, tier), state in states.items():
            generation = tables.advance(owner, tier, state)
            tables.logged_many(owner, tier, generation, "add", added.get((owner, tier), []), now)
    if inserted:
        schema.analyze(backend)
    return inserted, present


def _batches(
    entries: Iterable[tuple[str, Memory]], size: int
) -> Iterator[list[tuple[str, Memory]]]:
    """`size` entries at a time (itertools.batched is Python 3.12's)."""
    iterator = iter(entries)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


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
    backend = tables.backend
    with backend.guard(), backend.db.connection_context(), backend.write_transaction():
        locked = backend.lock_partition(owner, tier.value)
        # As every write: the tier's expired rows go first (at most a
        # batch), and those left weigh nothing and match nothing.
        now = tables.now()
        purged = store.expiry.purge(owner, tier, locked, now)
        state = purged.state
        weighed = usage_of(purged.weighed(state))
        used, count = weighed.used_chars, weighed.entry_count
        chars, rows = state.content_chars, state.entry_count
        for entry in entries:
            added = len(entry.content) + (SEPARATOR_CHARS if count else 0)
            reason = _left_out(tables, owner, tier, entry, now, policy, used, added)
            if reason:
                report.skipped.append((entry, reason))
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
            rows += 1
            report.imported.append(entry)
        after = state._replace(content_chars=chars, entry_count=rows)
        _advance_imported(tables, owner, tier, after, purged, report.imported, now)
    if report.imported:
        schema.analyze(backend)
    return report


def _left_out(
    tables: Tables,
    owner: str,
    tier: Tier,
    entry: LegacyEntry,
    now: int,
    policy: TierPolicy,
    used: int,
    added: int,
) -> str:
    """Why an entry is not imported ("": it is), the tier using `used`
    chars and the entry adding `added`."""
    if not entry.content:
        return "empty content"
    if tables.taken(entry.id):
        return "id already present"
    if tables.identical(owner, tier, entry.content, now) is not None:
        return "identical entry already present"
    if policy.limit_chars and used + added > policy.limit_chars:
        return f"does not fit: needs {added:,} chars, {max(policy.limit_chars - used, 0):,} free"
    return ""


def _advance_imported(
    tables: Tables,
    owner: str,
    tier: Tier,
    after: PartitionState,
    purged: Purged,
    imported: Sequence[LegacyEntry],
    now: int,
) -> None:
    """Advance the partition past an import (and the expired rows it
    removed first), logging an event per entry removed and added."""
    if imported:
        # A bulk write: no seqs, so the tier's compact index is dropped.
        generation = tables.advance(owner, tier, after)
        for gone in purged.removed:
            tables.logged(owner, tier, generation, "expire", gone.memory_id, now)
        # Logged as every write's are: a mirror built from WatchMemories
        # sees imported entries too (imports run while the daemon does).
        for entry in imported:
            tables.logged(owner, tier, generation, "add", entry.id, now)
    elif purged.removed:
        advance(tables, owner, tier, after, purged.removed, None, now)
