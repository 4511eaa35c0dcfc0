"""Prometheus metrics: every one defined here, on an injected registry.

Label values are bounded enumerations: never an agent, user, session or
memory id.

Owns: every metric's name, help, labels and buckets, and the change feed's
collector. Must not touch: what it measures (callers count; it reads only the
feed given to watch_feed, when scraped), ids as label values, or the network
(sidecar.api.server serves the registry). Of the package it imports only __version__
and sidecar.core.statements (the statements' per-thread tally).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from sidecar import __version__
from sidecar.core.statements import StatementTally

# Statement kinds worth telling apart; anything else is "other".
_OPERATIONS = frozenset(
    {"select", "insert", "update", "delete", "create", "alter", "drop", "pragma"}
)


# Seconds, from 100 microseconds (a cached turn) up; SQL statements stop at
# 2.5 s, calls go on to 10 s.
_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class _FeedCollector(Collector):
    """The change feed's own counters, read when scraped."""

    def __init__(self) -> None:
        self.feed: Any = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        feed = self.feed
        yield CounterMetricFamily(
            "memory_change_feed_connects",
            "Times the change feed (re)connected to the database.",
            value=feed.connects if feed is not None else 0,
        )
        yield CounterMetricFamily(
            "memory_change_feed_failures",
            "Change feed cycles that failed (a lost listener, a failed poll).",
            value=feed.failures if feed is not None else 0,
        )


def _define_process(r: CollectorRegistry) -> None:
    """The process's and the interpreter's own metrics, and the build's version."""
    ProcessCollector(registry=r)
    PlatformCollector(registry=r)
    Info("memory_sidecar_build", "The running memory-sidecar's version.", registry=r).info(
        {"version": __version__}
    )


class Metrics:
    """Every metric the sidecar exports, on one registry.

    Tests pass a fresh CollectorRegistry so values never leak between them.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # Defined in this order, which is the order a scrape lists them in.
        _define_process(r)
        self._define_sessions(r)
        self._define_retrieval(r)
        self._define_database(r)
        self._define_grpc(r)
        self._define_content(r)
        self._define_freshness(r)

    def _define_sessions(self, r: CollectorRegistry) -> None:
        """Snapshots, sessions, watches, replicas and the partition cache."""
        self.snapshot_lookups = Counter(
            "memory_snapshot_lookups",
            "InjectForTurn snapshot lookups by outcome.",
            ["result"],
            registry=r,
        )
        self.snapshot_invalidations = Counter(
            "memory_snapshot_invalidations",
            "Session snapshots invalidated or dropped, by cause.",
            ["reason"],
            registry=r,
        )
        self.replica_behind = Counter(
            "memory_replica_behind",
            "Reads refused (REPLICA_BEHIND) because this replica had not applied "
            "their min_generation within the deadline.",
            registry=r,
        )
        self.sessions_active = Gauge(
            "memory_sessions_active", "Sessions holding a snapshot.", registry=r
        )
        self.watches_open = Gauge(
            "memory_watches_open", "WatchMemories streams open (server.max_watches).", registry=r
        )
        self.partition_cache_bytes = Gauge(
            "memory_partition_cache_bytes",
            "Estimated bytes of the tiers kept indexed in memory (server.partition_cache_bytes).",
            registry=r,
        )
        # Both outcomes exist from start-up, so hit / (hit + miss) is defined.
        for result in ("hit", "miss"):
            self.snapshot_lookups.labels(result)
        for reason in (
            "write",
            "remote_write",
            "compaction",
            "session_end",
            "evicted",
            "expiry",
            "erasure",
        ):
            self.snapshot_invalidations.labels(reason)

    def _define_retrieval(self, r: CollectorRegistry) -> None:
        """The keyword strategy's and the encoder's fallbacks, and encoding time."""
        self.keyword_fallbacks = Counter(
            "memory_keyword_fallbacks",
            "Turns where the llm keyword strategy failed and local keywords were used.",
            ["reason"],
            registry=r,
        )
        self.semantic_fallbacks = Counter(
            "memory_semantic_fallbacks",
            "Embeddings the encoder could not give (server.semantic_encoder): queries "
            "then ranked lexically, writes stored without a vector and embedded later "
            "(reason: timeout, unreachable, http_error, bad_reply, unavailable, or paused: "
            "skipped after a failure).",
            ["operation", "reason"],
            registry=r,
        )
        self.semantic_seconds = Histogram(
            "memory_semantic_encode_duration_seconds",
            "Time to embed a query, a written entry, or a backfill batch.",
            ["operation"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _define_database(self, r: CollectorRegistry) -> None:
        """The store's SQL statements (db_query observes them) and commits."""
        # Tallied per thread and summed when scraped (sidecar.core.statements):
        # every statement of every write comes through db_query.
        self._statements = StatementTally(
            ("memory_db_queries", "SQL statements run by the store."),
            ("memory_db_query_duration_seconds", "Time to run one SQL statement."),
            kinds=_OPERATIONS,
            bounds=_LATENCY_BUCKETS[:-2],
        )
        r.register(self._statements)
        self.db_write_group_size = Histogram(
            "memory_db_write_group_size",
            "Adds committed in one write transaction (server.group_commit).",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )

    def _define_grpc(self, r: CollectorRegistry) -> None:
        """RPCs, under the names and labels of go-grpc-prometheus."""
        grpc_labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.grpc_started = Counter(
            "grpc_server_started", "RPCs started on the server.", grpc_labels, registry=r
        )
        self.grpc_handled = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, whatever their status.",
            [*grpc_labels, "grpc_code"],
            registry=r,
        )
        self.grpc_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from the start of an RPC to its completion on the server.",
            grpc_labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _define_content(self, r: CollectorRegistry) -> None:
        """What was injected, refused, flagged, and the MCP tools' calls."""
        self.injected_tokens = Counter(
            "memory_injected_tokens",
            "Tokens handed to the runtime by InjectForTurn, by block.",
            ["block"],
            registry=r,
        )
        self.budget_rejections = Counter(
            "memory_budget_rejections",
            "Writes refused because a tier's budget was full.",
            ["tier"],
            registry=r,
        )
        self.scan_findings = Counter(
            "memory_scan_findings",
            "Writes whose text the content scan flagged, by pattern and what was done "
            "(refused, warned: stored and withheld, quoted: stored and shown quoted).",
            ["pattern", "action"],
            registry=r,
        )
        self.mcp_tool_calls = Counter(
            "memory_mcp_tool_calls",
            "MCP tool calls on server.mcp_listen, by tool (unknown: a name that is none) and "
            "outcome (ok; error: a result the model reads as an error, such as a full tier; "
            "failed: refused with an MCP error, such as a token's grant).",
            ["tool", "outcome"],
            registry=r,
        )
        self.http_refused = Counter(
            "memory_http_connections_refused",
            "Connections an HTTP listener (mcp, metrics) closed: full (at its "
            "http_max_connections cap, closed as accepted) or slow (a request that did not "
            "arrive within http_request_timeout_seconds).",
            ["listener", "reason"],
            registry=r,
        )
        self.mcp_sessions_refused = Counter(
            "memory_mcp_sessions_refused",
            "MCP sessions not opened (429, MCP_SESSIONS_EXHAUSTED), by the cap that was full: "
            "tenant (server.mcp_max_sessions_per_tenant: a token and scope), token "
            "(mcp_max_sessions_per_token) or total (mcp_max_sessions).",
            ["limit"],
            registry=r,
        )
        self.mcp_sessions_open = Gauge(
            "memory_mcp_sessions_open", "MCP sessions open on server.mcp_listen.", registry=r
        )
        for limit in ("tenant", "token", "total"):
            self.mcp_sessions_refused.labels(limit)
        for listener in ("mcp", "metrics"):
            for reason in ("full", "slow"):
                self.http_refused.labels(listener, reason)
        for block in ("system", "turn"):
            self.injected_tokens.labels(block)
        for tier in ("memory", "user"):
            self.budget_rejections.labels(tier)

    def _define_freshness(self, r: CollectorRegistry) -> None:
        """Whether caches and tokens are current: the change feed, the auth files."""
        self.feed_verified = Gauge(
            "memory_change_feed_verified",
            "1 while the feed of other processes' writes is known to be live; "
            "0 while calls check the database instead of trusting caches.",
            registry=r,
        )
        self.auth_file_problems = Gauge(
            "memory_auth_file_problems",
            "Problems the last reload of auth_token_file, auth_tokens_file and the token files "
            "it names found (0: every token in use). A broken file keeps its last good tokens; "
            "a token file missing, empty or shared with another entry refuses its token.",
            registry=r,
        )
        self._feed = _FeedCollector()
        r.register(self._feed)

    def watch_feed(self, feed: Any) -> None:
        """Export a change feed's state (sidecar.storage.changes.ChangeFeed)."""
        self.feed_verified.set_function(lambda: 1.0 if feed.verified else 0.0)
        self._feed.feed = feed

    def db_query(self, sql: str, seconds: float) -> None:
        """One SQL statement the store ran, which took `seconds`."""
        self._statements.observe(sql, seconds)
