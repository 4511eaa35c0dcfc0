"""Small thread-safe caches: generations and an LRU, for sidecar.domain.partition,
sidecar.retrieval.semantic and sidecar.api.service.

Owns: Generations (the newest generation of each key) and LRU (bounded by count
and weight), each behind one short lock. Must not touch: what they hold (keys and
values are opaque), the store, metrics, other sidecar modules. Used today by
sidecar.domain.partition, sidecar.retrieval.semantic (retrieval) and sidecar.api.service (edge).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Generations:
    """The newest generation known of each partition this process uses.

    Generations come from the database: one sequence for all partitions, so a
    newer write always has a larger number. A cached partition is current
    while its generation is at least the newest known. This process learns
    of new generations from its own writes and loads (`observe`) and from
    the change feed (`observe_remote`), which only updates partitions already
    tracked: one nobody here has loaded has nothing cached to invalidate.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: dict[object, int] = {}
        # Partitions being read from the database right now: never forgotten.
        self._loading: dict[object, int] = {}

    def __len__(self) -> int:
        return len(self._of)

    def current(self, key: object) -> int | None:
        """The newest generation known, or None for a partition not followed."""
        return self._of.get(key)

    def track(self, key: object) -> None:
        """Start following a partition (before reading it from the database)."""
        with self._lock:
            self._of.setdefault(key, 0)

    @contextlib.contextmanager
    def loading(self, key: object) -> Iterator[None]:
        """Follow a partition while it is read: news heard meanwhile is kept,
        and marks what was read stale."""
        with self._lock:
            self._of.setdefault(key, 0)
            self._loading[key] = self._loading.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._loading[key] - 1
                if left:
                    self._loading[key] = left
                else:
                    del self._loading[key]

    def retain(self, keys: Collection[object]) -> int:
        """Stop following every partition not in `keys` (nothing of it is
        cached any more) and not being loaded; how many were dropped."""
        with self._lock:
            gone = [k for k in self._of if k not in keys and k not in self._loading]
            for key in gone:
                del self._of[key]
        return len(gone)

    def observe(self, key: object, generation: int) -> None:
        with self._lock:
            if generation > self._of.get(key, 0):
                self._of[key] = generation

    def observe_remote(self, key: object, generation: int) -> bool:
        """Note a generation heard from the feed; whether it made news."""
        with self._lock:
            known = self._of.get(key)
            if known is None or generation <= known:
                return False
            self._of[key] = generation
            return True


class LRU(Generic[K, V]):
    """A bounded mapping that forgets its least recently used entries first.

    Bounded by count and, with `weigh`, by total weight (bytes): the newest
    entry always stays, however heavy, and so does the latest entry heavier
    than the whole budget (see put).
    """

    def __init__(
        self,
        size: int,
        *,
        max_weight: int = 0,
        weigh: Callable[[V], int] = lambda item: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._size = size
        self._max_weight = max_weight
        self._weigh = weigh
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (item, weight, last used)
        self._items: OrderedDict[K, tuple[V, int, float]] = OrderedDict()
        self.weight = 0
        # The latest entry heavier than the whole budget, kept outside it.
        self._giant: K | None = None

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._items)

    def get(self, key: K) -> V | None:
        now = self._clock()
        with self._lock:
            entry = self._items.pop(key, None)
            if entry is None:
                return None
            self._items[key] = (entry[0], entry[1], now)
            return entry[0]

    def put(self, key: K, item: V) -> None:
        weight = self._weigh(item)
        now = self._clock()
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.weight -= old[1]
            self._items[key] = (item, weight, now)
            self.weight += weight
            if self._max_weight and weight > self._max_weight:
                self._giant = key
            elif key == self._giant:
                self._giant = None  # it shrank back into the budget
            while len(self._items) > 1 and (len(self._items) > self._size or self._over_budget()):
                # Least recently used first, but never the entry just put nor
                # the giant: evicting an entry heavier than the whole budget
                # would only reload it at its next use, every use.
                victim = next((k for k in self._items if k not in (key, self._giant)), None)
                if victim is None:
                    break
                self.weight -= self._items.pop(victim)[1]

    def discard(self, key: K) -> None:
        """Forget an entry, if held."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.weight -= old[1]
            if key == self._giant:
                self._giant = None

    def _over_budget(self) -> bool:
        """Whether the entries besides the giant pass the budget: the cache
        holds at most the budget plus one giant."""
        if not self._max_weight:
            return False
        giant = self._items.get(self._giant) if self._giant is not None else None
        return self.weight - (giant[1] if giant else 0) > self._max_weight

    def expire(self, unused_since: float, keep: Collection[K] = ()) -> int:
        """Forget entries last used before `unused_since` (except `keep`)."""
        with self._lock:
            gone = [
                key
                for key, (_, _, used) in self._items.items()
                if used < unused_since and key not in keep
            ]
            for key in gone:
                self.weight -= self._items.pop(key)[1]
        return len(gone)
