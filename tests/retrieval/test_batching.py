"""Concurrent encode calls sharing forward passes: each caller gets its own
rows, a lone caller runs at once, and a failed pass fails every caller.

No timing claims: a pass is held on an event, and what is asserted is which
texts each pass held (the wrapped encoder records them)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from sidecar.retrieval.batching import BatchingEncoder
from sidecar.retrieval.embedding import EncoderError, Vectors
from tests.waits import WAIT_SECONDS

# Longer than any test: a batch that waited for it would hang the test.
FOREVER = 3600.0


class Recording:
    """An encoder whose vector is a function of the text alone; records each
    pass's texts, and holds the first pass until `release` is set."""

    name = "recording"

    def __init__(self, *, hold_first: bool = False, fail_after: int | None = None) -> None:
        self.passes: list[list[str]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self._fail_after = fail_after
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> Vectors:
        with self._lock:
            self.passes.append(list(texts))
            first = len(self.passes) == 1
            count = len(self.passes)
        if first:
            self.started.set()
            assert self.release.wait(WAIT_SECONDS)
        if self._fail_after is not None and count > self._fail_after:
            raise EncoderError("unavailable", "broken")
        return np.stack([vector(text) for text in texts])


def vector(text: str) -> Vectors:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    row = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return row / np.linalg.norm(row)


def wait_for(test: Callable[[], bool]) -> None:
    """Polls: joining a batch notifies no one."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not test():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_a_lone_caller_runs_at_once_whatever_the_window() -> None:
    inner = Recording()
    encoder = BatchingEncoder(inner, max_wait_seconds=FOREVER)
    for text in ("one", "two", "three"):
        np.testing.assert_array_equal(encoder.encode([text])[0], vector(text))
    assert inner.passes == [["one"], ["two"], ["three"]]
    assert encoder.waited == 0
    assert encoder.name == "recording"


def test_callers_arriving_during_a_pass_share_the_next_and_get_their_own_rows() -> None:
    inner = Recording(hold_first=True)
    # One slot and a window longer than the test: only the first pass
    # ending lets the batch run.
    encoder = BatchingEncoder(inner, max_wait_seconds=FOREVER, slots=1)
    results: dict[str, Vectors] = {}

    def ask(texts: list[str]) -> None:
        got = encoder.encode(texts)
        for text, row in zip(texts, got, strict=True):
            results[text] = row

    first = threading.Thread(target=ask, args=(["first"],))
    first.start()
    assert inner.started.wait(WAIT_SECONDS)
    asks = [[f"q{i}"] for i in range(6)] + [["pair a", "pair b"]]
    threads = [threading.Thread(target=ask, args=(texts,)) for texts in asks]
    for thread in threads:
        thread.start()
    wait_for(lambda: encoder.waited == len(asks))
    inner.release.set()
    for thread in [first, *threads]:
        thread.join(WAIT_SECONDS)
    assert inner.passes[0] == ["first"]
    assert len(inner.passes) == 2
    assert sorted(inner.passes[1]) == sorted(t for texts in asks for t in texts)
    # Each caller got the rows of its own texts, as one at a time would.
    for text, row in results.items():
        np.testing.assert_array_equal(row, vector(text))
    assert (encoder.passes, encoder.batched) == (2, 1 + 8)


def test_a_full_batch_runs_without_waiting_for_a_slot() -> None:
    inner = Recording(hold_first=True)
    encoder = BatchingEncoder(inner, max_wait_seconds=FOREVER, slots=1, max_batch=4)
    first = threading.Thread(target=encoder.encode, args=(["first"],))
    first.start()
    assert inner.started.wait(WAIT_SECONDS)
    threads = [threading.Thread(target=encoder.encode, args=([f"q{i}"],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_SECONDS)
        assert not thread.is_alive()
    # Ran while the first pass was still held.
    assert len(inner.passes) == 2
    assert sorted(inner.passes[1]) == ["q0", "q1", "q2", "q3"]
    inner.release.set()
    first.join(WAIT_SECONDS)


def test_a_failed_pass_fails_every_caller_in_it() -> None:
    inner = Recording(hold_first=True, fail_after=1)
    encoder = BatchingEncoder(inner, max_wait_seconds=FOREVER, slots=1)
    first = threading.Thread(target=encoder.encode, args=(["first"],))
    first.start()
    assert inner.started.wait(WAIT_SECONDS)
    errors: list[BaseException] = []

    def ask(text: str) -> None:
        try:
            encoder.encode([text])
        except EncoderError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(f"q{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: encoder.waited == 3)
    inner.release.set()
    for thread in [first, *threads]:
        thread.join(WAIT_SECONDS)
    assert len(errors) == 3
    assert all(isinstance(e, EncoderError) and e.reason == "unavailable" for e in errors)
    # The slot is free again: the next caller runs at once.
    with pytest.raises(EncoderError):
        encoder.encode(["later"])
    assert encoder._running == 0


def test_a_large_call_goes_straight_through() -> None:
    inner = Recording()
    encoder = BatchingEncoder(inner, max_batch=8)
    texts = [f"entry {i}" for i in range(5)]
    assert encoder.encode(texts).shape == (5, 8)
    assert inner.passes == [texts]
    assert encoder.passes == 0
