"""The store's SQL statements, tallied per thread and summed when scraped.

Every statement the store runs is counted by kind and its duration put in a
histogram bucket. prometheus_client's Counter and Histogram take a lock on
every observation and search the buckets in Python: measured in a loop of
point SELECTs on the store's connection, the hook took 12 µs of the 28 a
statement cost through Peewee, and an AddMemory runs ten. Here each thread
adds to lists only it writes, without a lock (a thread's own `+=` is not
interleaved with another writer's, as there is none), and a scrape adds
the threads' lists up: the figures are the ones the Counter and Histogram
reported, under the same names, labels and buckets.

Owns: StatementTally (the per-thread lists, the folding of finished
threads' counts into one list, the exported families). Must not touch: the
metrics' names, help and buckets (sidecar.core.metrics gives them) or what
is measured (the store's query hook calls `observe`).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Collection, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# Distinct statement texts whose kind is remembered: the store's statements
# are a few dozen fixed texts; one with its values written in is classified
# again each time rather than remembered without bound.
_REMEMBERED = 1024


class _Tally:
    """One thread's counts (or the finished threads' together)."""

    __slots__ = ("buckets", "counts", "seconds", "thread")

    def __init__(self, kinds: int, buckets: int, thread: threading.Thread | None) -> None:
        self.counts = [0] * kinds
        self.buckets = [0] * buckets
        self.seconds = 0.0
        self.thread = thread

    def fold(self, other: _Tally) -> None:
        for i, count in enumerate(other.counts):
            self.counts[i] += count
        for i, count in enumerate(other.buckets):
            self.buckets[i] += count
        self.seconds += other.seconds


class StatementTally(Collector):
    """Counts statements by kind (the first word, lower-cased, if one of
    `kinds`, else "other") and their durations in buckets bounded by
    `bounds` (each bound inclusive, as a Prometheus histogram's `le`)."""

    def __init__(
        self,
        counter: tuple[str, str],
        histogram: tuple[str, str],
        kinds: Collection[str],
        bounds: Sequence[float],
    ) -> None:
        self._counter, self._histogram = counter, histogram
        self._kinds = (*sorted(kinds), "other")
        self._index = {kind: i for i, kind in enumerate(self._kinds)}
        self._bounds = tuple(bounds)
        # The `le` labels, written as prometheus_client writes them.
        self._les = [floatToGoString(b) for b in (*self._bounds, float("inf"))]  # type: ignore[no-untyped-call]
        self._kind_of: dict[str, int] = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._tallies: list[_Tally] = []
        self._finished = _Tally(len(self._kinds), len(self._bounds) + 1, None)
        # When each kind was first counted, and when the histogram was
        # made: the `_created` samples prometheus_client's metrics carry.
        self._created: dict[int, float] = {}
        self._made = time.time()

    def observe(self, sql: str, seconds: float) -> None:
        """One statement, which took `seconds` (called by the thread that ran it)."""
        try:
            tally: _Tally = self._local.tally
        except AttributeError:
            tally = self._join()
        kind = self._kind_of.get(sql)
        if kind is None:
            kind = self._classify(sql)
        if not tally.counts[kind] and kind not in self._created:
            self._created.setdefault(kind, time.time())
        tally.counts[kind] += 1
        tally.buckets[bisect.bisect_left(self._bounds, seconds)] += 1
        tally.seconds += seconds

    def _join(self) -> _Tally:
        tally = _Tally(len(self._kinds), len(self._bounds) + 1, threading.current_thread())
        with self._lock:
            # Threads that come and go (an index save's) leave nothing behind
            # even when nothing scrapes.
            self._fold_finished()
            self._tallies.append(tally)
        self._local.tally = tally
        return tally

    def _fold_finished(self) -> None:
        """Fold the counts of threads that have ended (they write no more)
        into one list for good. Under the lock."""
        running = []
        for tally in self._tallies:
            if tally.thread is not None and tally.thread.is_alive():
                running.append(tally)
            else:
                self._finished.fold(tally)
        self._tallies = running

    def _classify(self, sql: str) -> int:
        head = sql.lstrip().split(None, 1)
        kind = self._index.get(head[0].lower() if head else "", self._index["other"])
        if len(self._kind_of) < _REMEMBERED:
            self._kind_of[sql] = kind
        return kind

    def _summed(self) -> _Tally:
        """Every thread's counts added up."""
        total = _Tally(len(self._kinds), len(self._bounds) + 1, None)
        with self._lock:
            self._fold_finished()
            total.fold(self._finished)
            for tally in self._tallies:
                total.fold(tally)
        return total

    def collect(self) -> Iterator[Metric]:
        total = self._summed()
        counter = CounterMetricFamily(*self._counter, labels=["operation"])
        for kind, count in enumerate(total.counts):
            if count:
                counter.add_metric([self._kinds[kind]], count, created=self._created.get(kind))
        yield counter
        name, documentation = self._histogram
        histogram = HistogramMetricFamily(name, documentation)
        cumulative, buckets = 0, []
        for le, count in zip(self._les, total.buckets, strict=True):
            cumulative += count
            buckets.append((le, float(cumulative)))
        histogram.add_metric([], buckets, total.seconds)
        histogram.samples.append(Sample(f"{name}_created", {}, self._made))
        yield histogram
