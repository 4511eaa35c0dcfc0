"""Small thread-safe caches the engine keeps. Private to sidecar.engine."""

from __future__ import annotations

import threading
from collections import OrderedDict
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

    def current(self, key: object) -> int:
        return self._of.get(key, 0)

    def track(self, key: object) -> None:
        """Start following a partition (before reading it from the database)."""
        with self._lock:
            self._of.setdefault(key, 0)

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
    """A bounded mapping that forgets its least recently used entry first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: K, item: V) -> None:
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
