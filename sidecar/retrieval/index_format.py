"""The compact index's persisted form: a CompactPartition's index as bytes
to keep beside its rows (to_bytes), and a partition restored from them and
the writes made since (restore).

The bytes hold the entries in seq order and a fresh base segment, as of one
generation (numpy's npz, FORMAT). A trigger logs every change made after
that (sidecar.storage._backend), and restore() replays them: the index plus the log
is the tier as of now. An index comes from the database, so it is checked
like input: one of another format, made by another tokeniser (tokenizer())
or inconsistent is refused, and the engine indexes the rows instead
(from_rows): a damaged one with ValueError, one another version of the
sidecar wrote (another format or tokeniser) with ForeignIndex, which is
left in place for that version (sidecar.domain.index). Before anything is read
out of it, each member's declared size is checked against what the
partition can hold (_members): a member that declares 400M integers in a
few compressed bytes is refused, never allocated. persist() saves one
through the store.

Owns: FORMAT and the members' layout, the tokeniser's fingerprint
(tokenizer()), the checks an index passes before it is read (_members,
_check), ForeignIndex, replaying the logged writes onto a restored index,
and cutting the bytes into parts (PART_BYTES). Must not touch: the
database but through the Store or the IndexSource it is handed, when to
persist or restore (its callers decide: sidecar.domain.index, and the
operator's index command), the compact layout's own rules
(sidecar.retrieval.compact), or ranking.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import zipfile
import zlib
from typing import IO, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from sidecar.core.memory import Tier
from sidecar.retrieval.compact import (
    ALIVE,
    CompactPartition,
    Fetch,
    Held,
    Storage,
    Vocabulary,
    held_postings,
    make_segment,
    term_counts,
)
from sidecar.retrieval.keywords import terms
from sidecar.storage.index import IndexSource
from sidecar.storage.store import Store

# The persisted index's layout; another is not read (the tier is indexed again).
FORMAT = 1


class ForeignIndex(ValueError):
    """The index is of another format or tokeniser: another version of the
    sidecar wrote it, and may still use it (a rollout), so it is not dropped
    as damaged."""


def restore(tier: Tier, owner: str, source: IndexSource, fetch_rows: Fetch) -> CompactPartition:
    """A partition from its persisted index, and the writes made since."""
    storage = Storage()
    saved = _members(source)
    _check(saved)
    seq = saved["seq"]
    size = len(seq)
    storage.grow(size + 1)
    storage.seq[:size] = seq
    storage.confidence[:size] = saved["confidence"]
    storage.recency[:size] = saved["recency"]
    storage.category[:size] = saved["category"]
    storage.removed_at[:size] = ALIVE
    names = json.loads(saved["categories"].tobytes().decode())
    storage.categories = {name: i for i, name in enumerate(names)}
    storage.vocabulary = Vocabulary(saved["hashes"], saved["bounds"], saved["text"].tobytes())
    storage.offsets = saved["offsets"]
    storage.positions = saved["positions"]
    storage.counts = saved["counts"]
    del saved
    storage.size = size
    storage.npostings = len(storage.positions)
    storage.indexed = source.indexed
    count = size
    # The writes since the index: an entry changed or removed is taken
    # out (saved entries are in seq order), a changed one put back.
    for seq_of in [*source.removed, *(r.seq for r in source.changed)]:
        at = int(np.searchsorted(seq, seq_of))
        if at < len(seq) and seq[at] == seq_of and storage.removed_at[at] == ALIVE:
            storage.removed_at[at] = source.generation
            storage.removals += 1
            count -= 1
    for record in source.changed:
        storage.grow(storage.size + 1)
        storage.put(storage.size, record)
        storage.append_postings(storage.size, term_counts(record.content, record.created_at))
        storage.size += 1
        count += 1
    storage.generation = source.generation
    ops = source.logged
    return CompactPartition(
        tier,
        owner,
        source.generation,
        source.usage,
        storage.size,
        count,
        storage,
        fetch_rows,
        ops=ops,
    )


class _Snapshot(NamedTuple):
    """What to_bytes reads of a partition's shared storage, taken at once
    under the storage's lock (writers change `appended`, the categories and
    the tombstones under it, from request threads): the dict and list are
    copied, the arrays only referenced. Positions below the partition's
    size are never written again, a word's appended buffers only past each
    `filled` (its tuples never), and the base segment is never replaced in
    a storage in use, so the heavy work reads them after the lock is let go."""

    seq: npt.NDArray[np.int64]
    confidence: npt.NDArray[np.float64]
    recency: npt.NDArray[np.float64]
    category: npt.NDArray[np.int32]
    # Which positions the partition holds (None: all of them).
    alive: npt.NDArray[np.bool_] | None
    names: list[str]
    appended: dict[str, Held]
    base: Storage
    # Nothing written since the base segment was built.
    untouched: bool


def _snapshot(partition: CompactPartition) -> _Snapshot:
    storage, size = partition.storage, partition.size
    base = Storage()
    with storage.lock:
        base.vocabulary, base.offsets = storage.vocabulary, storage.offsets
        base.positions, base.counts = storage.positions, storage.counts
        return _Snapshot(
            storage.seq[:size],
            storage.confidence[:size],
            storage.recency[:size],
            storage.category[:size],
            partition.alive(),
            sorted(storage.categories, key=storage.categories.__getitem__),
            # A dict's copy, not its items one by one: the lock is held briefly.
            storage.appended.copy(),
            base,
            not storage.removals and not storage.appended and size == storage.size,
        )


def to_bytes(partition: CompactPartition) -> bytes:
    """A partition's index, to persist: the entries it holds in seq order, their
    words in a fresh base segment (what was appended folded in). Safe while
    the tier is written: it reads one snapshot of the storage (_snapshot)."""
    size = partition.size
    snapshot = _snapshot(partition)
    base = snapshot.base
    if snapshot.untouched:
        # Nothing written since it was built (the first index after a
        # load, in seq order): the base segment is the index as it is.
        return _saved_as(snapshot, np.arange(size), base)
    kept = np.arange(size) if snapshot.alive is None else np.flatnonzero(snapshot.alive)
    kept = kept[np.argsort(snapshot.seq[kept], kind="stable")]
    moved = np.full(size, -1, dtype=np.int32)
    moved[kept] = np.arange(len(kept), dtype=np.int32)
    words = base.vocabulary.words()
    known: dict[str, int] = {}
    base_ids = np.repeat(
        np.arange(len(words), dtype=np.int32), np.diff(base.offsets).astype(np.int64)
    )
    id_parts, position_parts, count_parts = [base_ids], [base.positions], [base.counts]
    for word, held in snapshot.appended.items():
        term_id = base.vocabulary.get(word)
        if term_id is None:
            term_id = known.get(word)
            if term_id is None:
                term_id = known[word] = len(words)
                words.append(word)
        positions, tally = held_postings(held, size)
        id_parts.append(np.full(len(positions), term_id, dtype=np.int32))
        position_parts.append(positions)
        count_parts.append(tally)
    remapped = moved[np.concatenate(position_parts)]
    keep = remapped >= 0
    ids = np.concatenate(id_parts)[keep]
    counts = np.concatenate(count_parts)[keep]
    positions = remapped[keep]
    del remapped, keep, id_parts, position_parts, count_parts
    # Positions ascending, so that each word's stay ascending in make_segment.
    order = np.argsort(positions, kind="stable")
    out = Storage()
    make_segment(out, words, ids[order], positions[order], counts[order])
    del words, ids, counts, positions, order
    return _saved_as(snapshot, kept, out)


def _saved_as(snapshot: _Snapshot, kept: npt.NDArray[np.integer[Any]], segment: Storage) -> bytes:
    """The entries at positions `kept` (in seq order) with `segment`'s
    words, serialised."""
    buffer = io.BytesIO()
    np.savez(
        buffer,
        version=np.array([FORMAT]),
        tokenizer=np.frombuffer(tokenizer().encode(), dtype=np.uint8),
        seq=snapshot.seq[kept],
        confidence=snapshot.confidence[kept],
        recency=snapshot.recency[kept],
        category=snapshot.category[kept],
        categories=np.frombuffer(json.dumps(snapshot.names).encode(), dtype=np.uint8),
        hashes=segment.vocabulary.hashes,
        bounds=segment.vocabulary.bounds,
        text=np.frombuffer(segment.vocabulary.text, dtype=np.uint8),
        offsets=segment.offsets,
        positions=segment.positions,
        counts=segment.counts,
    )
    return buffer.getvalue()


# Text whose terms change whenever tokenising does (stemmer, stopwords,
# Unicode tables, dates, short words, identifiers): an index made by another
# tokeniser is not used. An index made before short words and identifiers
# were terms would find nothing for "uv" or "svc-7": its fingerprint differs.
_PROBE = (
    "Deployments deployed: the user's résumé, naïve ÉCOLE straße, 東京 notes; "
    "uses uv and kubectl in July 2023, 7 May 2023, on-call 42 times; bought, ate and left; "
    "Dec 4, 2023 and 2023-12-04 in the ER; gh, jq, S3, C, the US, us, ok, don't; "
    "svc-7 on pg-staging-2, OPS-1142, pyproject.toml, --no-cache, Python 3.11, e.g."
)


@functools.cache
def tokenizer() -> str:
    """A fingerprint of how entries are tokenised into index terms."""
    return hashlib.sha256("\n".join(terms(_PROBE)).encode()).hexdigest()


_LAYOUT = {
    "version": np.int64,
    "tokenizer": np.uint8,
    "seq": np.int64,
    "confidence": np.float64,
    "recency": np.float64,
    "category": np.int32,
    "categories": np.uint8,
    "hashes": np.int64,
    "bounds": np.int64,
    "text": np.uint8,
    "offsets": np.int64,
    "positions": np.int32,
    "counts": np.uint16,
}


# Members with one element per entry: the partition's rows bound them.
_PER_ENTRY = ("seq", "confidence", "recency", "category")
# What a member may hold besides its array: numpy's header (padded to 64
# bytes; 10,000 is numpy's own limit on reading one).
_HEADER_BYTES = 10_000
_READ_BYTES = 1 << 20


def _members(source: IndexSource) -> dict[str, npt.NDArray[Any]]:
    """The persisted index's arrays, each read only once what it declares
    is known to fit: the entries the partition can have held when it was
    indexed (those it has now, and one per change logged since) for the
    per-entry members, and for every member together the index's own
    bytes (np.savez, which wrote it, stores members uncompressed). So a
    member that declares more than the partition allows (a compressed
    run of zeros that claims 400M integers) is refused before anything
    is allocated or inflated; ValueError, like any damage."""
    rows = source.usage.entry_count + source.logged
    budget = len(source.data)
    try:
        archive = zipfile.ZipFile(io.BytesIO(source.data))
        with archive:
            infos = archive.infolist()
            declared = sum(info.file_size for info in infos)
            if declared > budget:
                raise ValueError(f"its members declare {declared} bytes in {budget}")
            # The format first: another version's index may have other members.
            version = next((i for i in infos if i.filename == "version.npy"), None)
            if version is not None:
                _check_format(_read(archive, version, budget))
            names = sorted(info.filename.removesuffix(".npy") for info in infos)
            if names != sorted(_LAYOUT) or any(not i.filename.endswith(".npy") for i in infos):
                raise ValueError(f"unexpected members {names}")
            out = {}
            for info in infos:
                name = info.filename.removesuffix(".npy")
                out[name] = _read(archive, info, rows if name in _PER_ENTRY else budget)
            return out
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError) as exc:
        raise ValueError(f"not an index archive: {exc}") from None


def _read(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> npt.NDArray[Any]:
    """One member's array, of at most `limit` elements."""
    name = info.filename.removesuffix(".npy")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise ValueError(f"{name} is compressed with method {info.compress_type}")
    with archive.open(info) as member:
        return _array(name, member, info.file_size, limit)


def _array(name: str, member: IO[bytes], size: int, limit: int) -> npt.NDArray[Any]:
    """One member's array, read from a stream of `size` declared bytes,
    refused unless it holds at most `limit` elements and exactly the bytes
    its header declares (read a chunk at a time, never past `size`)."""
    try:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(
                member, max_header_size=_HEADER_BYTES
            )
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(
                member, max_header_size=_HEADER_BYTES
            )
        else:
            raise ValueError(f"npy format {version}")
    except (ValueError, SyntaxError, TypeError) as exc:
        raise ValueError(f"{name} has no readable header: {exc}") from None
    count = math.prod(shape)
    header = member.tell()
    if (
        len(shape) != 1
        or fortran
        or dtype.hasobject
        or count > limit
        or header > _HEADER_BYTES
        or header + count * dtype.itemsize != size
    ):
        raise ValueError(f"{name} declares {shape} of {dtype} in {size} bytes (at most {limit})")
    array = np.empty(count, dtype=dtype)
    view = array.view(np.uint8).data
    done = 0
    while done < len(view):
        got = member.readinto(view[done : done + _READ_BYTES])  # type: ignore[attr-defined]
        if not got:
            raise ValueError(f"{name} is cut short")
        done += got
    return array


def _check(saved: dict[str, npt.NDArray[Any]]) -> None:
    """Raise ValueError unless a persisted index is one this code wrote, for
    this tokeniser, and consistent: it comes from the database, so it is
    checked like input (a bad one is set aside and the rows indexed)."""
    if set(saved) != set(_LAYOUT):
        raise ValueError(f"unexpected members {sorted(saved)}")
    a = saved
    for name, dtype in _LAYOUT.items():
        if a[name].dtype != dtype or a[name].ndim != 1:
            raise ValueError(f"{name} is {a[name].dtype}[{a[name].ndim}]")
    _check_format(a["version"])
    if a["tokenizer"].tobytes().decode(errors="replace") != tokenizer():
        raise ForeignIndex("made by a different tokeniser")
    size, words, pairs = len(a["seq"]), len(a["hashes"]), len(a["positions"])
    offsets, bounds = a["offsets"], a["bounds"]
    # Lengths first: the checks below index the arrays (an IndexError would
    # not say the index is damaged).
    if any(len(a[n]) != size for n in ("confidence", "recency", "category")) or any(
        len(x) != n for x, n in ((offsets, words + 1), (bounds, words + 1), (a["counts"], pairs))
    ):
        raise ValueError("inconsistent (lengths)")
    try:
        categories = json.loads(a["categories"].tobytes().decode())
    except RecursionError:
        raise ValueError("inconsistent (categories)") from None
    if not isinstance(categories, list) or not all(isinstance(c, str) for c in categories):
        raise ValueError("inconsistent (categories)")
    names = len(categories)
    problems = [
        bool(np.any(np.diff(a["seq"]) <= 0)) or bool(np.any(np.diff(a["hashes"]) < 0)),
        offsets[0] != 0 or offsets[-1] != pairs or bool(np.any(np.diff(offsets) < 0)),
        bounds[0] != 0 or bounds[-1] != len(a["text"]) or bool(np.any(np.diff(bounds) < 0)),
        bool(pairs) and (int(a["positions"].min()) < 0 or int(a["positions"].max()) >= size),
        bool(pairs) and int(a["counts"].min()) < 1,
        bool(size) and (int(a["category"].min()) < 0 or int(a["category"].max()) >= names),
    ]
    if any(problems):
        raise ValueError(f"inconsistent (check {problems.index(True)})")


def _check_format(version: npt.NDArray[Any]) -> None:
    """Raise ForeignIndex unless the index's version member is FORMAT."""
    if version.tolist() != [FORMAT]:
        raise ForeignIndex(f"format {version.tolist()}, not {FORMAT}")


# An index is written in parts of at most this many bytes, a row and a
# transaction each (sidecar.storage.index): writers wait behind one part at a
# time, staged or dropped (SQLite overwrites a deleted part: about 15 ms a
# MiB), and PostgreSQL's bytea and SQLite's blobs stay far from their limits.
PART_BYTES = 1024 * 1024


def from_rows(store: Store, tier: Tier, owner: str) -> CompactPartition:
    """A large partition indexed from its rows, read in batches."""
    return CompactPartition.load(
        tier, owner, lambda consume: store.indexes.scan(tier, owner, consume), store.memories_by_seq
    )


def persist(store: Store, partition: CompactPartition) -> bool:
    """Persist the partition's index beside its rows. False when the store
    keeps a newer one, or cannot complete this one from its change log
    (IndexStore.save): nothing is changed then."""
    data = to_bytes(partition)
    parts = [data[at : at + PART_BYTES] for at in range(0, len(data), PART_BYTES)]
    if not store.indexes.save(partition.tier, partition.owner, partition.generation, parts):
        return False
    partition.saved()
    return True
