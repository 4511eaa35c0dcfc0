"""Semantic retrieval: entries' embeddings beside the keyword index.

With `server.semantic_encoder` on, every write embeds its content (before
the write transaction, which stores the vector with the entry), every
search and ranked turn embeds the query, and ranking blends the cosine of
each entry's vector with the query's into BM25 (sidecar.retrieval.ranking.rank):

    similarity = (1 - semantic_weight) * bm25 / best + semantic_weight * max(cosine, 0)

An entry that matches no keyword is a match when its cosine reaches
`semantic_min_similarity`. A blend, not rank fusion: in our measurement on
a long-conversation QA set a 50/50 blend found more than fusing the two
rankings did.

Nothing here can fail a call. A query the encoder cannot embed in time
(an endpoint down or slow: its overall deadline) is ranked lexically; a
write it cannot embed is stored without a vector, and the backfill embeds
it later, as it does entries written before semantic retrieval was on or
with another encoder (or with another model behind the same name: vectors
of another dimension than the encoder's now are ignored until replaced).
Each failure is counted by reason. After a failure, calls skip the
encoder for a pause (1 s, doubling to 60 s: reason "paused") instead of
each waiting out the deadline of an endpoint that hangs; the backfill,
in the background, finds out when it answers again.

Vectors are kept in memory per partition (float32, the stored float16
widened), within `server.semantic_cache_bytes`, for partitions held in
full; a compact partition (a tier of `compact_tier_entries` or more) is
ranked lexically: 1.5 KB per entry would dwarf its ~150 bytes. Its entries
are not embedded either: not by the backfill, nor when written while it is
held compactly.

Owns: vectors' stored form, the per-partition vector cache, recent query
vectors, the encoder's pause, and the backfill thread. Must not touch: SQL (it
uses the store's vector methods), the partition cache or generations (it is told
of writes and handed partitions), sessions, gRPC. Unlike the rest of retrieval it
has state and a thread, and a query may wait for the encoder up to its deadline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sidecar.core.caches import LRU
from sidecar.core.errors import SidecarError
from sidecar.core.memory import Tier
from sidecar.core.metrics import Metrics
from sidecar.retrieval.embedding import Encoder, EncoderError
from sidecar.retrieval.llm import Pause
from sidecar.retrieval.partition import Partition
from sidecar.storage.store import Store
from sidecar.storage.vectors import Vector
from sidecar.storage.writes import Written

log = logging.getLogger("sidecar.semantic")

PartitionKey = tuple[Tier, str]
Floats = npt.NDArray[np.float32]
# Entries embedded per encoder call by the backfill.
BACKFILL_BATCH = 32
# How often the backfill looks for entries without a vector when nothing
# asked it to (another replica's encoder may have failed).
BACKFILL_EVERY_SECONDS = 600.0
# A partition's vectors loaded while some of its entries had none are read
# again at most this often (the backfill may have filled them since).
INCOMPLETE_RELOAD_SECONDS = 10.0
_QUERIES_KEPT = 256


def to_stored(vector: Floats) -> bytes:
    """A unit vector as stored: float16, little-endian (half the bytes;
    cosines change by under 1e-3)."""
    return np.asarray(vector, dtype="<f2").tobytes()


def from_stored(data: Sequence[bytes]) -> Floats:
    """Stored vectors as one float32 matrix (rows of equal length)."""
    if not data:
        return np.zeros((0, 0), dtype=np.float32)
    joined = np.frombuffer(b"".join(data), dtype="<f2")
    return joined.reshape(len(data), -1).astype(np.float32)


def stored_bytes(dimension: int) -> int:
    """The stored size of a vector of that dimension (to_stored)."""
    return 2 * dimension


@dataclass(frozen=True, slots=True)
class VectorSet:
    """A partition's vectors as of one generation: seqs ascending, one row
    each. `complete`: every entry had one when it was read."""

    generation: int
    seqs: npt.NDArray[np.int64]
    matrix: Floats
    complete: bool
    loaded_at: float

    @property
    def nbytes(self) -> int:
        return int(self.seqs.nbytes + self.matrix.nbytes) + 200

    def cosines(self, query: Floats, seqs: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
        """The cosine with the query of the entry at each position (given
        by its seq); NaN where an entry has no vector."""
        out = np.full(len(seqs), np.nan, dtype=np.float64)
        if not len(self.seqs) or not len(seqs) or self.matrix.shape[1] != len(query):
            return out
        at = np.minimum(np.searchsorted(self.seqs, seqs), len(self.seqs) - 1)
        found = self.seqs[at] == seqs
        out[found] = (self.matrix[at[found]] @ query).astype(np.float64)
        return out

    def with_row(self, generation: int, seq: int, vector: Floats | None) -> VectorSet:
        """This set after a write to entry `seq`: its row replaced by
        `vector`, or removed (None)."""
        at = int(np.searchsorted(self.seqs, seq))
        present = at < len(self.seqs) and int(self.seqs[at]) == seq
        seqs, matrix = self.seqs, self.matrix
        if present:
            seqs = np.delete(seqs, at)
            matrix = np.delete(matrix, at, axis=0)
        if vector is not None:
            if matrix.shape[0] and matrix.shape[1] != len(vector):
                # Another encoder's vectors: read them again.
                return dataclasses.replace(
                    self, generation=generation, complete=False, loaded_at=float("-inf")
                )
            row = np.asarray(vector, dtype=np.float32).reshape(1, -1)
            seqs = np.insert(seqs, at, seq)
            matrix = np.insert(matrix.reshape(-1, row.shape[1]), at, row, axis=0)
        return VectorSet(generation, seqs, matrix, self.complete, self.loaded_at)


class Semantic:
    """The engine's embeddings: encodes, keeps partitions' vectors, backfills."""

    def __init__(
        self,
        encoder: Encoder,
        store: Store,
        metrics: Metrics,
        *,
        cache_bytes: int,
        compact_from: int = 0,
        query_prefix: str = "",
        document_prefix: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.encoder = encoder
        # Tiers this large (server.compact_tier_entries; 0: none) are ranked
        # lexically: the backfill leaves their entries alone.
        self._compact_from = compact_from or None
        # What goes before a text, by operation.
        self._prefixes = {
            "query": query_prefix,
            "write": document_prefix,
            "backfill": document_prefix,
        }
        # Vectors are stored under this name: made with other prefixes they
        # are another model's, and embedded again.
        self.model = encoder.name
        if query_prefix or document_prefix:
            both = f"{query_prefix}\0{document_prefix}".encode()
            self.model += f"+prefixes:{hashlib.sha256(both).hexdigest()[:12]}"
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._vectors: LRU[PartitionKey, VectorSet] = LRU(
            1 << 20, max_weight=cache_bytes, weigh=lambda v: v.nbytes, clock=clock
        )
        # The dimension of the encoder's vectors, as of its last answer
        # (None until then): stored vectors of another (the model behind
        # one name swapped) are stale, ignored and embedded again.
        self.dimension: int | None = None
        self._queries: dict[str, Floats] = {}
        self._queries_lock = threading.Lock()
        self._due = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.backfilled = 0
        # When the backfill last stored vectors (a set held incomplete
        # before then is read again).
        self._filled_at = float("-inf")
        # After the encoder fails, writes and queries skip it for a while;
        # the backfill tries again when the pause ends.
        self._pause = Pause(clock)

    # --- encoding -----------------------------------------------------------

    def _encode(self, texts: Sequence[str], operation: str) -> Floats | None:
        if operation != "backfill" and self._pause.remaining():
            self._metrics.semantic_fallbacks.labels(operation, "paused").inc()
            return None
        prefix = self._prefixes[operation]
        if prefix:
            texts = [prefix + text for text in texts]
        started = time.perf_counter()
        try:
            vectors = self.encoder.encode(texts)
        except EncoderError as exc:
            self._metrics.semantic_fallbacks.labels(operation, exc.reason).inc()
            pause = self._pause.failed()
            log.warning("could not embed (%s): %s; lexical only for %.0f s", operation, exc, pause)
            return None
        self._metrics.semantic_seconds.labels(operation).observe(time.perf_counter() - started)
        if len(vectors) and vectors.shape[1] != self.dimension:
            if self.dimension is not None:
                log.warning(
                    "the encoder answers in %d dimensions, no longer %d: the vectors"
                    " stored in %d are ignored until embedded again",
                    vectors.shape[1],
                    self.dimension,
                    self.dimension,
                )
                with self._queries_lock:
                    self._queries.clear()
            self.dimension = int(vectors.shape[1])
            # Also when first learnt: a backfill pass that began without it
            # looked only for entries without any vector, so those of
            # another dimension before its cursor are left; the next pass,
            # now, replaces them.
            self._due.set()
        if self._pause.succeeded():
            log.info("embedding again")
        return vectors

    def for_write(self, content: str) -> tuple[Vector | None, Floats | None]:
        """The content's vector as stored and as held, or (None, None) when
        the encoder failed: the entry is stored without one and backfilled."""
        vectors = self._encode([content], "write")
        if vectors is None:
            self._due.set()
            return None, None
        return Vector(self.model, to_stored(vectors[0])), from_stored([to_stored(vectors[0])])[0]

    def query(self, text: str) -> Floats | None:
        """The query's vector (None: rank lexically). Recent queries are
        kept: the pages of one search ask for the same."""
        if not text.strip():
            return None
        with self._queries_lock:
            known = self._queries.get(text)
        if known is not None:
            return known
        vectors = self._encode([text], "query")
        if vectors is None:
            return None
        vector = np.ascontiguousarray(vectors[0], dtype=np.float32)
        with self._queries_lock:
            if len(self._queries) >= _QUERIES_KEPT:
                self._queries.pop(next(iter(self._queries)))
            self._queries[text] = vector
        return vector

    # --- partitions' vectors --------------------------------------------------

    def similarities(self, partitions: Sequence[Any], query: Floats) -> npt.NDArray[np.float64]:
        """Per position of the partitions end to end (as rank() lays them
        out), the cosine of that entry with the query; NaN for entries
        without a vector and for every entry of a compact partition."""
        parts = []
        for partition in partitions:
            if not isinstance(partition, Partition):
                parts.append(np.full(partition.size, np.nan, dtype=np.float64))
                continue
            vectors = self._held(partition, len(query))
            parts.append(vectors.cosines(query, partition.seq))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)

    def _held(self, partition: Partition, dimension: int) -> VectorSet:
        """The partition's vectors of this dimension (the query's)."""
        key = (partition.tier, partition.owner)
        vectors = self._vectors.get(key)
        now = self._clock()
        if (
            vectors is not None
            and vectors.generation == partition.generation
            and (
                vectors.complete
                or (
                    now - vectors.loaded_at < INCOMPLETE_RELOAD_SECONDS
                    and vectors.loaded_at > self._filled_at
                )
            )
            and (not len(vectors.seqs) or vectors.matrix.shape[1] == dimension)
        ):
            return vectors
        seqs, data = self._store.vectors.of(partition.tier, partition.owner, self.model)
        size = stored_bytes(dimension)
        if any(len(vector) != size for vector in data):
            # Made by the model this name stood for before: left out (as
            # an entry without a vector) until the backfill replaces them.
            current = [k for k, vector in enumerate(data) if len(vector) == size]
            seqs, data = [seqs[k] for k in current], [data[k] for k in current]
        matrix = from_stored(data)
        complete = len(seqs) >= partition.count
        if not complete:
            self._due.set()
        vectors = VectorSet(
            partition.generation, np.array(seqs, dtype=np.int64), matrix, complete, now
        )
        self._vectors.put(key, vectors)
        return vectors

    def written(
        self, key: PartitionKey, written: Written, vector: Floats | None, *, content_changed: bool
    ) -> None:
        """After a write of this process (under the partition's lock): the
        held vectors follow it if they were exactly one write behind; others
        are read again when next used."""
        previous, generation, seq = written.previous, written.generation, written.memory.seq
        vectors = self._vectors.get(key)
        if vectors is None or vectors.generation != previous or generation == previous:
            return
        if not content_changed:
            self._vectors.put(key, dataclasses.replace(vectors, generation=generation))
            return
        changed = vectors.with_row(generation, seq, vector)
        if vector is None:
            # Written without a vector (the encoder failed): backfilled later.
            changed = dataclasses.replace(changed, complete=False)
        self._vectors.put(key, changed)

    def removed(self, key: PartitionKey, written: Written) -> None:
        """After a delete of this process."""
        previous, generation, seq = written.previous, written.generation, written.memory.seq
        vectors = self._vectors.get(key)
        if vectors is None or vectors.generation != previous or generation == previous:
            return
        self._vectors.put(key, vectors.with_row(generation, seq, None))

    def forget(self, key: PartitionKey) -> None:
        """The partition was erased: drop its vectors held here."""
        self._vectors.discard(key)

    @property
    def cache_bytes(self) -> int:
        return self._vectors.weight

    def expire(self, unused_since: float) -> None:
        self._vectors.expire(unused_since)

    # --- backfill -------------------------------------------------------------

    def backfill(self) -> int:
        """Embed every entry without a current vector of this encoder (of its
        dimension, once it is known); how many were stored. Stops at the
        first encoder failure (tried again later)."""
        stored, after = 0, 0
        while not self._stopping.is_set():
            size = None if self.dimension is None else stored_bytes(self.dimension)
            rows = self._store.vectors.unembedded(
                self.model, after, BACKFILL_BATCH, below=self._compact_from, size=size
            )
            if not rows:
                break
            vectors = self._encode([content for _, content, _ in rows], "backfill")
            if vectors is None:
                break
            self._store.vectors.put(
                self.model,
                [
                    (seq, digest, to_stored(vector))
                    for (seq, _, digest), vector in zip(rows, vectors, strict=True)
                ],
            )
            stored += len(rows)
            after = rows[-1][0]
            # Partitions held without these are read again when next used.
            self._filled_at = self._clock()
        if stored:
            self.backfilled += stored
            log.info("embedded %d entries that had no vector", stored)
        return stored

    def start(self) -> None:
        """Backfill in the background now, when a write could not be
        embedded, and every BACKFILL_EVERY_SECONDS."""
        self._due.set()
        self._thread = threading.Thread(target=self._run, name="memory-embedder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._due.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._due.wait(BACKFILL_EVERY_SECONDS)
            if self._stopping.is_set():
                return
            # After a failure, try again when the pause ends: each write
            # skipped meanwhile asks for a backfill, and must not make one.
            paused = self._pause.remaining()
            if paused and self._stopping.wait(paused):
                return
            self._due.clear()
            try:
                self.backfill()
            except SidecarError as exc:  # the database refused: next time
                log.warning(
                    "embedding entries without a vector failed: %s (%s); trying again later",
                    exc,
                    exc.reason,
                )
            except Exception:
                log.exception("embedding entries without a vector")
