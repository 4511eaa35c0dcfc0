"""A persisted compact index that is hostile or damaged (sidecar.retrieval.index_format,
sidecar.domain.index): refused without allocating what it declares, and replaced
by the index of the rows, so the next start loads a valid one. One another
version made (its tokeniser or format) is not used, but left in place.

Random damage of many kinds is in tests/retrieval/test_index_format.py; these load
through a real daemon on both backends.
"""

from __future__ import annotations

import io
import logging
import tracemalloc
import zipfile
from collections.abc import Callable

import numpy as np
import pytest

from sidecar.core.memory import Tier
from sidecar.retrieval import index_format
from sidecar.retrieval.compact import CompactPartition
from tests.conftest import MakeSidecar, Running
from tests.retrieval.test_compact import NOTES, SCOPE, _hits, _observed, _state, _wait_indexed

pytestmark = pytest.mark.contract

CONFIG = "defaults: {memory_char_limit: 0}\nserver: {compact_tier_entries: %d}"
KEY = (Tier.MEMORY, "agent")
FORMAT = index_format.FORMAT
# 100M int32 declared: 400 MB if allocated, a few hundred KB compressed.
DECLARED = 100_000_000


def _indexed(make_sidecar: MakeSidecar, name: str) -> tuple[Running, int]:
    """A tier of NOTES held compactly, with its index persisted."""
    first = make_sidecar(CONFIG % 10, name=name)
    for note in NOTES:
        first.add(note, scope=SCOPE)
    _observed(first)
    _wait_indexed(first)
    indexed, logged = _state(first)
    assert indexed > 0
    assert logged == 0
    return first, indexed


def _replace_index(running: Running, data: bytes) -> None:
    """Put `data` in place of the agent's persisted index, as damage would."""
    db, p = running.store._db, running.store._db.param
    with db.connection_context(), db.atomic():
        db.execute_sql(
            f"DELETE FROM tier_index WHERE owner = {p} AND tier = {p} AND part > 0",
            ("agent", "memory"),
        )
        db.execute_sql(
            f"UPDATE tier_index SET data = {p} WHERE owner = {p} AND tier = {p}",
            (data, "agent", "memory"),
        )


def _bomb(index: bytes) -> bytes:
    """The index with its positions member replaced by a compressed one
    that declares DECLARED int32 zeros (written a chunk at a time)."""
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(index)) as original,
        # Level 1: 400 MB of zeros deflate in a third of the CPU, still < 2 MB.
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as bomb,
    ):
        for info in original.infolist():
            if info.filename != "positions.npy":
                bomb.writestr(info.filename, original.read(info))
                continue
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                header, {"descr": "<i4", "fortran_order": False, "shape": (DECLARED,)}
            )
            with bomb.open("positions.npy", "w", force_zip64=True) as member:
                member.write(header.getvalue())
                zeros = bytes(1 << 22)
                for _ in range(DECLARED * 4 // len(zeros)):
                    member.write(zeros)
    return out.getvalue()


def test_an_index_declaring_more_than_the_tier_holds_is_refused_unallocated(
    make_sidecar: MakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    first, _ = _indexed(make_sidecar, "bomb.db")
    index = first.store.indexes.source(*KEY).data
    bomb = _bomb(index)
    assert len(bomb) < 4 * 1024 * 1024
    _replace_index(first, bomb)
    assert first.store.indexes.source(*KEY).data == bomb

    fresh = make_sidecar(CONFIG % 10, name="bomb.db")
    # The tier's first query loads it: refused before anything it declares
    # is allocated (400 MB), the tier indexed from its rows instead.
    caplog.set_level(logging.WARNING, logger="sidecar.indexer")
    tracemalloc.start()
    try:
        hits = _hits(fresh, "helm friday", 7)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 * 1024
    assert isinstance(fresh.sidecar.engine.inside().partitions.cached(KEY), CompactPartition)
    refused = [r.getMessage() for r in caplog.records if "is unusable" in r.getMessage()]
    assert len(refused) == 1
    assert "declare" in refused[0]
    # ... and answers as a daemon holding the tier in full.
    reference = make_sidecar(CONFIG % 0, name="bomb.db")
    expected = _observed(reference)
    assert [(h.memory.id, round(h.score, 12)) for h in hits] == expected[0][1]
    assert _observed(fresh) == expected


def test_an_unusable_index_is_replaced_though_the_tier_is_not_written(
    make_sidecar: MakeSidecar,
) -> None:
    first, indexed = _indexed(make_sidecar, "damaged.db")
    _replace_index(first, b"PK\x03\x04 not an index any more")

    # A start finds it unusable and indexes the rows; nothing is written
    # to the tier, yet the index of the rows replaces the damaged one.
    second = make_sidecar(CONFIG % 10, name="damaged.db")
    expected = _observed(second)
    _wait_indexed(second)
    replaced, logged = _state(second)
    assert replaced == indexed  # as of the same generation: no write since
    assert logged == 0
    assert second.store.indexes.source(*KEY).data != b"PK\x03\x04 not an index any more"

    # The next start loads it, without indexing the rows again.
    third = make_sidecar(CONFIG % 10, name="damaged.db")
    assert _observed(third) == expected
    loaded = third.sidecar.engine.inside().partitions.cached(KEY)
    assert isinstance(loaded, CompactPartition)
    assert loaded.storage.indexed == indexed
    assert not third.sidecar.engine.indexing()


def _altered(index: bytes, change: Callable[[dict[str, np.ndarray]], None]) -> bytes:
    with np.load(io.BytesIO(index), allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    change(arrays)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def _out_of_memory(*_: object) -> CompactPartition:
    raise MemoryError


@pytest.mark.parametrize(
    ("change", "kept"),
    [
        (lambda a: a.update(tokenizer=np.frombuffer(b"another", dtype=np.uint8)), True),
        # A later format, with members this one does not know.
        (lambda a: a.update(version=np.array([FORMAT + 1]), novel=np.zeros(3)), True),
        (None, True),  # reading it ran out of memory: nothing said against it
        (lambda a: a.update(positions=a["positions"] + 1000), False),
        (lambda a: a.update(offsets=np.zeros(0, dtype=np.int64)), False),
    ],
    ids=["tokeniser", "format", "memory", "positions", "offsets"],
)
def test_an_index_another_version_made_is_left_in_place_and_a_damaged_one_dropped(
    make_sidecar: MakeSidecar,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[dict[str, np.ndarray]], None] | None,
    kept: bool,
) -> None:
    """Two versions on one database (a rollout): each indexes the rows
    when the other's index is not one it can use, and leaves it there;
    dropping it, each would drop the other's at every load."""
    first, indexed = _indexed(make_sidecar, "foreign.db")
    expected = _observed(first)
    data = first.store.indexes.source(*KEY).data
    saves: list[int] = []
    persist = index_format.persist

    def counted(store: object, partition: CompactPartition) -> bool:
        saves.append(partition.generation)
        return persist(store, partition)  # type: ignore[arg-type]

    monkeypatch.setattr(index_format, "persist", counted)
    if change is None:
        monkeypatch.setattr(index_format, "restore", _out_of_memory)
    else:
        data = _altered(data, change)
        _replace_index(first, data)

    second = make_sidecar(CONFIG % 10, name="foreign.db")
    assert _observed(second) == expected
    assert isinstance(second.sidecar.engine.inside().partitions.cached(KEY), CompactPartition)
    _wait_indexed(second)
    source = second.store.indexes.source(*KEY)
    assert source.indexed == indexed
    assert (source.data == data) == kept
    # Not saved over either, until the tier is written (a save at the
    # same generation would be refused anyway); a damaged one is replaced.
    assert saves == ([] if kept else [indexed])
    assert _state(second) == (indexed, 0)
