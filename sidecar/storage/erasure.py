"""Erasure: whole partitions and everything derived from them, removed in
one write transaction (ForgetUser, DeleteScope), and the audit log.

Reached as `store.erasure`. One partition is one tier of one owner: the
user tier of a user_id (shared by every agent) or the memory tier of an
agent_id. Erasing it removes, in one transaction:

- its entries (`memories`) and their vectors (deleted explicitly, to be
  counted, before the rows whose ON DELETE CASCADE would also remove them);
- its idempotency keys (they hold the content's digest);
- its persisted compact index and change log (`tier_index`, `tier_changes`:
  the index holds the content's terms);
- its event rows (`memory_events`, but earlier erase events, which hold no
  entry);

then empties its state row, advances its generation and sets
`tier_state.erased` to it (the change feed carries that to every replica),
appends one `erase` event for watchers, and appends a row to the audit log:
when, the token's name, the action, the target ids and the counts, never
content. A crash leaves all of it or none of it; a retry finishes the job.
A partition with nothing left to erase is not touched (its generation stays),
so a repeated call answers zeros; it is still audited, and says which
partitions were erased before (`earlier`). A partition never written is
not touched at all (it gets no state row).

ForgetUser also finds the agent notes written for the user (rows of any
agent's memory tier whose `written_for_user_id` is the user, schema 10;
NULL, an unknown writer, is nobody's) and reports their ids; asked to
(`Notes.erase`), it erases them in the same transaction: their rows,
vectors, keys and events, the persisted index and change log of each agent
partition holding one (they hold the entries' terms), whose state row is
then set to what is left, with a new generation as `erased`, and a
`delete` event per note.

Owns: the erasure transaction, the Erased counts, the agent notes written
for a user, and the audit log's rows.
Must not touch: caches, sessions or snapshots (sidecar.domain.erasure drops
them), the engine, gRPC, who may erase (sidecar.api.access).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.core.clock import Clock, to_micros
from sidecar.core.memory import Tier
from sidecar.storage._backend import (
    AUDIT_TABLE,
    CHANGES_TABLE,
    EVENTS_TABLE,
    INDEX_TABLE,
    STATE_TABLE,
    VECTORS_TABLE,
    PartitionState,
)
from sidecar.storage._tables import Tables

PartitionKey = tuple[Tier, str]
# Values per IN list of a row-level erasure.
_IN_CHUNK = 500


@dataclass(frozen=True, slots=True)
class Notes:
    """ForgetUser's agent notes written for `user_id` (schema 10): found
    and reported, and erased only when `erase` is asked for."""

    user_id: str
    erase: bool = False
    # Raises unless the caller may erase that agent's notes: called under
    # the locks for each agent holding one, before anything is erased.
    authorize: Callable[[str], None] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Erased:
    """What an erasure removed (all zeros for a repeat), the largest
    generation it wrote (0 when nothing was there), the partitions it
    erased with the generation of each, and its audit row's id."""

    memories: int = 0
    vectors: int = 0
    idempotency_keys: int = 0
    # Change-log (tier_changes) and event (memory_events) rows.
    change_rows: int = 0
    # Parts of persisted compact indexes.
    index_parts: int = 0
    generation: int = 0
    audit_id: int = 0
    partitions: tuple[tuple[PartitionKey, int], ...] = field(default=())
    # The partitions found erased before (by any process: a retry, a repeat,
    # another replica's erasure) with the generation of that erasure. A
    # process that missed it must still let go of what it built before it.
    earlier: tuple[tuple[PartitionKey, int], ...] = field(default=())
    # ForgetUser: the ids of the agent notes written for the user (schema
    # 10), oldest first, and whether they were erased (counted in the totals
    # above then) or only reported.
    notes: tuple[str, ...] = field(default=())
    notes_erased: bool = False

    def counts(self) -> dict[str, int]:
        """The counts as the audit log records them."""
        kept = ("memories", "vectors", "idempotency_keys", "change_rows", "index_parts")
        counts = {name: getattr(self, name) for name in kept}
        return {**counts, "partitions": len(self.partitions), "agent_notes": len(self.notes)}


@dataclass(frozen=True, slots=True)
class AuditRow:
    id: int
    at: int  # microseconds since the epoch
    actor: str
    action: str
    target: dict[str, Any]
    counts: dict[str, Any]
    generation: int


class Erasure:
    """Erases partitions of one store and reads its audit log."""

    def __init__(self, tables: Tables, clock: Clock) -> None:
        self._tables = tables
        self._backend = tables.backend
        self._db = tables.db
        self._clock = clock

    def erase(
        self,
        keys: Iterable[PartitionKey],
        *,
        actor: str,
        action: str,
        target: Mapping[str, str],
        notes: Notes | None = None,
    ) -> Erased:
        """Erase these partitions and audit it, all in one transaction;
        with `notes`, report (and if asked, erase) the agent notes written
        for a user too."""
        backend = self._backend
        totals = dict.fromkeys(("memories", "vectors", "keys", "changes", "parts"), 0)
        erased: list[tuple[PartitionKey, int]] = []
        with backend.guard(), self._db.connection_context(), backend.write_transaction():
            found = self.written_for(notes.user_id) if notes else []
            noted = {(owner, Tier.MEMORY.value) for owner, _, _ in found}
            # A fixed order (owner, then tier): two erasures of overlapping
            # partitions lock them in the same order, so neither deadlocks.
            wanted = {(owner, tier.value) for tier, owner in keys}
            ordered = sorted(wanted | (noted if notes and notes.erase else set()))
            # A partition never written has no state row, and gets none:
            # nothing of it is stored, nor cached anywhere.
            locked = {key: backend.lock_existing(*key) for key in ordered}
            states = {key: state for key, state in locked.items() if state is not None}
            earlier = tuple(
                ((Tier(tier), owner), state.erased)
                for (owner, tier), state in states.items()
                if state.erased
            )
            now = to_micros(self._clock())
            if notes:
                # Read again under the locks: what is erased is what is reported.
                found = self.written_for(notes.user_id)
                if notes.erase:
                    for agent_id in sorted({owner for owner, _, _ in found}):
                        if notes.authorize is not None:
                            notes.authorize(agent_id)
                    erased += self._erase_notes(found, totals, now)
            whole = {key: state for key, state in states.items() if key in wanted}
            erased += self._erase_partitions(whole, totals, now)
            result = Erased(
                memories=totals["memories"],
                vectors=totals["vectors"],
                idempotency_keys=totals["keys"],
                change_rows=totals["changes"],
                index_parts=totals["parts"],
                generation=max((g for _, g in erased), default=0),
                partitions=tuple(erased),
                earlier=earlier,
                notes=tuple(memory_id for _, _, memory_id in found),
                notes_erased=bool(notes and notes.erase),
            )
            audit_id = self._audit(now, actor, action, target, result)
        return dataclasses.replace(result, audit_id=audit_id)

    def _erase_partitions(
        self, states: Mapping[tuple[str, str], PartitionState], totals: dict[str, int], now: int
    ) -> list[tuple[PartitionKey, int]]:
        """Erase these whole partitions (locked); add to `totals`."""
        erased: list[tuple[PartitionKey, int]] = []
        for (owner, tier), state in states.items():
            removed = self._remove(owner, tier)
            for name, count in removed.items():
                totals[name] += count
            if any(removed.values()) or state.entry_count or state.content_chars:
                generation = self._backend.erased_state(owner, tier)
                self._tables.logged(owner, Tier(tier), generation, "erase", "", now)
                erased.append(((Tier(tier), owner), generation))
        return erased

    def written_for(self, user_id: str) -> list[tuple[str, int, str]]:
        """(agent_id, seq, id) of the agent notes written for the user
        (expired or not), oldest first. Call inside a connection."""
        p = self._db.param
        rows = self._db.execute_sql(
            f"SELECT owner, seq, id FROM memories WHERE written_for_user_id = {p}"
            f" AND tier = {p} ORDER BY seq",
            (user_id, Tier.MEMORY.value),
        ).fetchall()
        return [(str(owner), int(seq), str(memory_id)) for owner, seq, memory_id in rows]

    def notes_written_for(self, user_id: str) -> list[tuple[str, str]]:
        """(agent_id, id) of the agent notes written for the user, oldest
        first, as of now (ForgetUser locks and reads them again)."""
        with self._backend.guard(), self._db.connection_context():
            return [(owner, memory_id) for owner, _, memory_id in self.written_for(user_id)]

    def _erase_notes(
        self, found: list[tuple[str, int, str]], totals: dict[str, int], now: int
    ) -> list[tuple[PartitionKey, int]]:
        """Delete these notes (their partitions locked) and what derives
        from them, each partition marked erased; add to `totals`."""
        by_owner: dict[str, list[tuple[int, str]]] = {}
        for owner, seq, memory_id in found:
            by_owner.setdefault(owner, []).append((seq, memory_id))
        erased: list[tuple[PartitionKey, int]] = []
        for owner, notes in sorted(by_owner.items()):
            removed = self._remove_rows(owner, [seq for seq, _ in notes], [i for _, i in notes])
            for name, count in removed.items():
                totals[name] += count
            p = self._db.param
            chars, count = self._db.execute_sql(
                f"SELECT COALESCE(SUM(content_chars), 0), COUNT(*) FROM memories"
                f" WHERE owner = {p} AND tier = {p}",
                (owner, Tier.MEMORY.value),
            ).fetchone()
            generation = self._backend.thinned_state(
                owner, Tier.MEMORY.value, int(chars), int(count)
            )
            ids = [memory_id for _, memory_id in notes]
            self._tables.logged_many(owner, Tier.MEMORY, generation, "delete", ids, now)
            erased.append(((Tier.MEMORY, owner), generation))
        return erased

    def _remove_rows(self, owner: str, seqs: list[int], ids: list[str]) -> dict[str, int]:
        """Delete some entries of one agent's notes and what derives from
        them: their vectors, keys and events, and the partition's persisted
        index and change log (the index holds the entries' terms; the tier
        is loaded from its rows until an index is saved again)."""
        p = self._db.param
        where = f"owner = {p} AND tier = {p}"
        params = (owner, Tier.MEMORY.value)
        self._run(f"UPDATE {STATE_TABLE} SET indexed = 0 WHERE {where}", params)
        return {
            "parts": self._run(f"DELETE FROM {INDEX_TABLE} WHERE {where}", params),
            "changes": self._run(f"DELETE FROM {CHANGES_TABLE} WHERE {where}", params)
            + self._run_in(
                f"DELETE FROM {EVENTS_TABLE} WHERE {where} AND kind <> 'erase' AND memory_id",
                params,
                ids,
            ),
            "vectors": self._run_in(f"DELETE FROM {VECTORS_TABLE} WHERE seq", (), seqs),
            "memories": self._run_in(f"DELETE FROM memories WHERE {where} AND seq", params, seqs),
            "keys": self._run_in(
                f"DELETE FROM idempotency_keys WHERE {where} AND memory_id", params, ids
            ),
        }

    def _run_in(self, sql: str, params: tuple[object, ...], values: Sequence[object]) -> int:
        """`sql` ending in a column, run with `IN (values)` after it, in
        chunks well under either backend's limit on parameters."""
        count = 0
        for start in range(0, len(values), _IN_CHUNK):
            chunk = values[start : start + _IN_CHUNK]
            marks = ", ".join([self._db.param] * len(chunk))
            count += self._run(f"{sql} IN ({marks})", (*params, *chunk))
        return count

    def _remove(self, owner: str, tier: str) -> dict[str, int]:
        """Delete one partition's rows and what derives from them; the counts."""
        p = self._db.param
        where = f"owner = {p} AND tier = {p}"
        params = (owner, tier)
        # First: with `indexed` 0 the change-log trigger logs none of the
        # deletes below (a large tier would log a row per entry).
        self._run(f"UPDATE {STATE_TABLE} SET indexed = 0 WHERE {where}", params)
        return {
            "parts": self._run(f"DELETE FROM {INDEX_TABLE} WHERE {where}", params),
            "changes": self._run(f"DELETE FROM {CHANGES_TABLE} WHERE {where}", params)
            + self._run(f"DELETE FROM {EVENTS_TABLE} WHERE {where} AND kind <> 'erase'", params),
            "vectors": self._run(
                f"DELETE FROM {VECTORS_TABLE}"
                f" WHERE seq IN (SELECT seq FROM memories WHERE {where})",
                params,
            ),
            "memories": self._run(f"DELETE FROM memories WHERE {where}", params),
            "keys": self._run(f"DELETE FROM idempotency_keys WHERE {where}", params),
        }

    def _run(self, sql: str, params: tuple[object, ...]) -> int:
        """Run a statement; how many rows it changed."""
        return max(int(self._db.execute_sql(sql, params).rowcount), 0)

    def _audit(
        self, now: int, actor: str, action: str, target: Mapping[str, str], erased: Erased
    ) -> int:
        p = self._db.param
        row = self._db.execute_sql(
            f"INSERT INTO {AUDIT_TABLE} (at, actor, action, target, counts, generation)"
            f" VALUES ({p}, {p}, {p}, {p}, {p}, {p}) RETURNING id",
            (
                now,
                actor,
                action,
                json.dumps(dict(target), sort_keys=True),
                json.dumps(erased.counts(), sort_keys=True),
                erased.generation,
            ),
        ).fetchone()
        return int(row[0])

    def audit_log(self, *, since: int = 0, limit: int | None = None) -> list[AuditRow]:
        """The audit log's rows at or after `since` (microseconds), oldest
        first, at most `limit` (the newest ones) when given."""
        p = self._db.param
        sql = (
            f"SELECT id, at, actor, action, target, counts, generation FROM {AUDIT_TABLE}"
            f" WHERE at >= {p} ORDER BY id DESC"
        )
        params: tuple[object, ...] = (since,)
        if limit is not None:
            sql += f" LIMIT {p}"
            params = (since, limit)
        with self._backend.guard(), self._db.connection_context():
            rows = self._db.execute_sql(sql, params).fetchall()
        return [
            AuditRow(int(i), int(at), actor, action, json.loads(t), json.loads(c), int(g))
            for i, at, actor, action, t, c, g in reversed(rows)
        ]
