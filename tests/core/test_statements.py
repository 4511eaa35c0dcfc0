"""StatementTally: the same exposition as prometheus_client's own Counter and
Histogram fed the same statements, exact across threads that come and go."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.core.metrics import Metrics
from sidecar.core.statements import StatementTally

KINDS = {"select", "insert", "update", "pragma"}
BOUNDS = (0.0001, 0.001, 0.01)
STATEMENTS = [
    ("SELECT 1", 0.00005),
    ("  insert into t values (1)", 0.0001),  # on a bound: counted in it (le)
    ("UPDATE t SET x = 1", 0.002),
    ("BEGIN IMMEDIATE", 0.5),  # past every bound: +Inf only
    ("", 0.0),
    ("pragma quick_check", 0.01),
    ("SELECT 1", 0.0003),
]


def _samples(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def _tallied(statements: list[tuple[str, float]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    tally = StatementTally(("q", "Statements."), ("q_seconds", "Time."), KINDS, BOUNDS)
    registry.register(tally)
    for sql, seconds in statements:
        tally.observe(sql, seconds)
    return registry


def test_the_exposition_is_prometheus_clients_own() -> None:
    reference = CollectorRegistry()
    counter = Counter("q", "Statements.", ["operation"], registry=reference)
    histogram = Histogram("q_seconds", "Time.", buckets=BOUNDS, registry=reference)
    for sql, seconds in STATEMENTS:
        head = sql.lstrip().split(None, 1)
        kind = head[0].lower() if head else "other"
        counter.labels(kind if kind in KINDS else "other").inc()
        histogram.observe(seconds)
    assert _samples(_tallied(STATEMENTS)) == _samples(reference)
    assert ("q_total", (("operation", "other"),), 2.0) in _samples(reference)


def test_created_samples_are_kept() -> None:
    text = generate_latest(_tallied(STATEMENTS)).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"q_created", "q_seconds_created"} <= names


def test_counts_are_exact_across_threads_that_end() -> None:
    registry = CollectorRegistry()
    tally = StatementTally(("q", "Statements."), ("q_seconds", "Time."), KINDS, BOUNDS)
    registry.register(tally)

    def work() -> None:
        for _ in range(2000):
            tally.observe("SELECT 1", 0.00002)

    for _round in range(3):
        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # A scrape between rounds folds the ended threads' counts in.
        generate_latest(registry)
    assert registry.get_sample_value("q_total", {"operation": "select"}) == 3 * 8 * 2000
    assert registry.get_sample_value("q_seconds_bucket", {"le": "0.0001"}) == 3 * 8 * 2000
    assert len(tally._tallies) == 0  # nothing is kept of ended threads


def test_ended_threads_are_folded_in_without_a_scrape() -> None:
    tally = StatementTally(("q", "Statements."), ("q_seconds", "Time."), KINDS, BOUNDS)
    for _ in range(50):
        thread = threading.Thread(target=tally.observe, args=("SELECT 1", 0.0))
        thread.start()
        thread.join()
    assert len(tally._tallies) == 1  # the last one's, folded when the next thread comes
    registry = CollectorRegistry()
    registry.register(tally)
    assert registry.get_sample_value("q_total", {"operation": "select"}) == 50


def test_metrics_export_the_store_statements_under_their_names() -> None:
    metrics = Metrics()
    metrics.db_query("SELECT seq FROM memories", 0.0002)
    metrics.db_query("COMMIT", 0.001)
    sample = metrics.registry.get_sample_value
    assert sample("memory_db_queries_total", {"operation": "select"}) == 1
    assert sample("memory_db_queries_total", {"operation": "other"}) == 1
    assert sample("memory_db_queries_total", {"operation": "insert"}) is None
    assert sample("memory_db_query_duration_seconds_count", {}) == 2
    assert sample("memory_db_query_duration_seconds_bucket", {"le": "0.00025"}) == 1
