"""Small thread-safe caches the engine keeps. Private to sidecar.engine."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Generations:
    """Per-partition write counters, drawn from one global sequence.

    Because every new value is larger than every value before it, a view
    built at generation g (the largest of its partitions') is stale exactly
    when one of its partitions has moved on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counter = 0
        self._of: dict[object, int] = {}

    def current(self, key: object) -> int:
        return self._of.get(key, 0)

    def advance(self, key: object) -> int:
        with self._lock:
            self._counter += 1
            self._of[key] = self._counter
            return self._counter


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
