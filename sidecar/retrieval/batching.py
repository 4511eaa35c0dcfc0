"""Concurrent encoder calls share one forward pass.

A forward pass of a few short texts costs little more than one of a single
text: the layer weights are read once either way. `BatchingEncoder` sits in
front of an encoder: a call that finds a pass slot free runs at once, alone,
never waiting; a call that finds every slot busy joins the one open batch.
That batch's first caller runs it as soon as a slot frees, the batch is
full, or `max_wait_seconds` after it opened, whichever comes first; the
others wait for it and each takes its own rows back.

Owns: the batching of concurrent encode calls and its counters. Must not
touch: the model or its arithmetic (the wrapped encoder's), vectors at rest,
metrics, configuration (settings are arguments). Blocks a joining caller for
at most the wait plus one forward pass of the batch it joined.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sidecar.retrieval.embedding import Encoder, EncoderError, Vectors


@dataclass(eq=False)
class _Batch:
    """Texts of several callers, run by the first of them."""

    opened: float
    texts: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    vectors: Vectors | None = None
    error: EncoderError | None = None


class BatchingEncoder:
    """`inner` behind a batching front, with its name (the vectors are the
    same; rows are computed alone or beside others, identically up to
    float rounding).

    At most `slots` passes run at once before a batch waits (one per core
    is the useful most: each pass runs on one thread). A call of more than
    `max_batch // 2` texts (the backfill's) goes straight through.

    `passes` and `batched` count forward passes run here and the texts
    they held; `waited` counts calls that waited for a slot or a batch.
    """

    def __init__(
        self,
        inner: Encoder,
        *,
        max_wait_seconds: float = 0.002,
        max_batch: int = 32,
        slots: int = 1,
    ) -> None:
        self.inner = inner
        self._max_wait = max(0.0, max_wait_seconds)
        self._max_batch = max(1, max_batch)
        self._slots = max(1, slots)
        self._lock = threading.Condition()
        self._running = 0
        self._open: _Batch | None = None
        self.passes = 0
        self.batched = 0
        self.waited = 0

    @property
    def name(self) -> str:
        return self.inner.name

    def encode(self, texts: Sequence[str]) -> Vectors:
        if len(texts) > self._max_batch // 2:
            return self.inner.encode(texts)
        with self._lock:
            if self._running < self._slots and self._open is None:
                self._running += 1
                alone = True
            else:
                alone = False
                batch, start, leader = self._join(texts)
        if alone:
            return self._run(list(texts))
        if leader:
            return self._lead(batch)[start : start + len(texts)]
        batch.done.wait()
        if batch.error is not None:
            raise EncoderError(batch.error.reason, batch.error.detail)
        assert batch.vectors is not None
        return batch.vectors[start : start + len(texts)]

    def _join(self, texts: Sequence[str]) -> tuple[_Batch, int, bool]:
        """Called holding the lock: the open batch, with `texts` added at
        the returned offset, and whether this caller opened it."""
        self.waited += 1
        batch = self._open
        leader = batch is None
        if batch is None:
            batch = self._open = _Batch(time.monotonic())
        start = len(batch.texts)
        batch.texts.extend(texts)
        if len(batch.texts) >= self._max_batch:
            self._lock.notify_all()  # full: its leader need not wait on
        return batch, start, leader

    def _lead(self, batch: _Batch) -> Vectors:
        """Waits for a free slot, a full batch or the deadline, then runs it."""
        deadline = batch.opened + self._max_wait
        with self._lock:
            while self._running >= self._slots and len(batch.texts) < self._max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            # Closed: later callers open another.
            self._open = None
            self._running += 1
        try:
            batch.vectors = self._run(batch.texts)
        except Exception as exc:
            # The others get an EncoderError of their own (the caller falls
            # back to keywords on one), whatever the encoder raised.
            batch.error = (
                exc
                if isinstance(exc, EncoderError)
                else EncoderError("unavailable", f"the encoder failed: {exc!r}")
            )
            raise
        finally:
            batch.done.set()
        return batch.vectors

    def _run(self, texts: list[str]) -> Vectors:
        try:
            vectors = self.inner.encode(texts)
        finally:
            with self._lock:
                self._running -= 1
                self.passes += 1
                self.batched += len(texts)
                self._lock.notify_all()
        return np.asarray(vectors)
