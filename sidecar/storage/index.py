"""The compact index's persistence: a large partition's index kept beside
its rows, and the log of the partition's changes since, which completes it.

Reached as `store.indexes`. It stores bytes and reads rows; building an
index from them is sidecar.retrieval.compact's, which this module never imports (nor
the engine, service, server or ranking). One of the storage modules, the
only code that touches Peewee (see sidecar.storage.store).

Like the store's, every method opens a pooled connection for its own
duration. Every write locks the partition's state row (see sidecar.storage._backend).

Owns: IndexStore (a partition's persisted index bytes, the switch that
starts and stops logging its changes, the changes read since a save) and
IndexSource. Must not touch: the index's format or building it
(sidecar.retrieval.compact, sidecar.retrieval.index_format), when to save
one (sidecar.domain.index), the entries' rows beyond reading them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from sidecar.core.memory import Tier, Usage, rendered_chars
from sidecar.storage._statements import KEEP_EXPIRED, Record
from sidecar.storage._tables import Tables, usage_of


class IndexSource(NamedTuple):
    """A partition's persisted compact index (`data`, as of generation
    `indexed`), the rows written since (`changed`, and the seqs `removed`),
    and the partition's usage and generation now."""

    data: bytes
    indexed: int
    changed: list[Record]
    removed: list[int]
    usage: Usage
    generation: int
    # Changes logged since the index (one seq may have changed many times).
    logged: int


class IndexStore:
    """The compact indexes of one store's partitions, and their change logs."""

    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self._backend = tables.backend
        self._db = tables.db
        self._guard = tables.backend.guard

    def scan(
        self, tier: Tier, owner: str, consume: Callable[[list[Record]], None], *, batch: int = 5000
    ) -> tuple[Usage, int]:
        """Hand one partition's entries to `consume`, `batch` rows at a time
        in insertion order, and return its usage and generation: all as of
        one snapshot, without holding every row (or a Memory per row) at once."""
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            state = self._backend.states([(owner, tier.value)]).get((owner, tier.value))
            # Expired rows not yet removed too: they are in the state row's
            # entry_count, which a restored index must match (Indexer.load),
            # and the entries a compact partition returns are read back,
            # expired ones left out (Store.memories_by_seq).
            params = self._tables.sql.partition.params(
                owner=owner, tier=tier.value, now=KEEP_EXPIRED
            )
            chars = count = 0
            for rows in self._backend.batches(self._tables.sql.partition.sql, params, batch):
                records = [Record(*row) for row in rows]
                chars += sum(r.content_chars for r in records)
                count += len(records)
                consume(records)
        # Counted from the rows read, as the state row counts them.
        return Usage(rendered_chars(chars, count), count), state.generation if state else 0

    def source(self, tier: Tier, owner: str) -> IndexSource:
        """What loading a partition from its persisted compact index needs,
        as of one snapshot (no index: `data` is empty)."""
        with self._guard(), self._db.connection_context(), self._backend.read_transaction():
            state = self._backend.states([(owner, tier.value)]).get((owner, tier.value))
            if state is None or state.indexed <= 0:
                return IndexSource(b"", 0, [], [], Usage(), state.generation if state else 0, 0)
            data = self._backend.read_index(owner, tier.value, state.indexed)
            seqs, logged = self._backend.changes_since(owner, tier.value, state.indexed)
            # An entry expired since is kept, as scan keeps it (the state
            # row counts it until it is removed).
            changed = self._tables.records_by_seq(owner, tier, seqs, KEEP_EXPIRED)
        present = {r.seq for r in changed}
        removed = [s for s in seqs if s not in present]
        usage = usage_of(state)
        return IndexSource(data, state.indexed, changed, removed, usage, state.generation, logged)

    def start_logging(self, tier: Tier, owner: str) -> None:
        """Log the partition's changes from now on, unless they already are:
        an index built from what is read after this can be completed."""
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            state = self._backend.lock_partition(owner, tier.value)
            if not state.indexed:
                self._backend.start_logging(owner, tier.value, state.generation)

    def discard(self, tier: Tier, owner: str, indexed: int) -> None:
        """Drop the partition's index as of `indexed`, found unusable, and
        log its changes from now on: an index of the rows read after this
        replaces it, even if the tier is never written again (save() keeps
        only a newer index, and the unusable one would otherwise stay
        current, read and refused at every load). Nothing changes when
        another process has saved another index meanwhile."""
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            state = self._backend.lock_partition(owner, tier.value)
            if state.indexed == indexed:
                self._backend.drop_index(owner, tier.value)
                self._backend.start_logging(owner, tier.value, state.generation)

    def stop_logging(self, tier: Tier, owner: str) -> None:
        """Drop the partition's index and stop logging its changes (it is
        held in full: nothing would ever read or trim the log)."""
        with self._guard(), self._db.connection_context(), self._backend.write_transaction():
            if self._backend.lock_partition(owner, tier.value).indexed:
                self._backend.drop_index(owner, tier.value)

    def save(self, tier: Tier, owner: str, generation: int, parts: Sequence[bytes]) -> bool:
        """Persist a partition's compact index as of `generation`, if that is
        newer than the one kept and every change since it is logged.

        The parts are written first under `generation`, each in a
        transaction of its own and without the partition's lock (writers
        wait for neither: on SQLite a million-entry index took 1.3 s to
        write); the switch to them changes only the state row and the
        change log, under the lock. The indexes it replaces are dropped
        after it, a part per transaction: deleting a part overwrites it
        (SQLite's secure_delete), which held the write lock for about 0.2 s
        per 13.5 MB.
        """
        key = (owner, tier.value)
        with self._guard(), self._db.connection_context():
            for number, part in enumerate(parts):
                with self._backend.write_transaction():
                    staged = self._backend.stage_index_part(*key, generation, number, part)
                if not staged:
                    # That generation's index is in use or another attempt's
                    # (one that got to a part first got to every part first).
                    self._drop_parts(key, [(generation, n) for n in range(number)])
                    return False
            with self._backend.write_transaction():
                state = self._backend.lock_partition(*key)
                if state.indexed > 0:
                    complete = state.indexed < generation
                else:  # logging since generation -(indexed + 1), or not at all
                    complete = state.indexed < 0 and generation >= -(state.indexed + 1)
                if complete:
                    self._backend.save_index(*key, generation)
            if not complete:
                if state.indexed != generation:
                    self._drop_parts(key, [(generation, n) for n in range(len(parts))])
                return False
            # Replaced, or left behind (an older version staged under negative keys).
            self._drop_parts(key, self._backend.index_parts_before(*key, generation))
            return True

    def _drop_parts(self, key: tuple[str, str], parts: Sequence[tuple[int, int]]) -> None:
        """Delete these (generation, part) rows of the partition's index
        table, each in a transaction of its own. Inside a connection."""
        for generation, number in parts:
            with self._backend.write_transaction():
                self._backend.drop_index_part(*key, generation, number)
