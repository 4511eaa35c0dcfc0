"""The rule each setting's value must follow, by key: what sidecar.config.settings
checks every value against, from a file, the environment or a flag.

Owns: the per-key checks (CHECKS) and the small rule builders. Must not touch:
where values come from or the settings classes (sidecar.config.settings), any I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be at least {low:g}"


def _between(low: float, high: float) -> Callable[[Any], str | None]:
    return lambda v: None if low <= v <= high else f"must be between {low:g} and {high:g}"


def _address(value: str) -> str | None:
    if value == "":
        return None
    if value.startswith("unix:"):
        return None if len(value) > len("unix:") else "a unix: address needs a path"
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return "must be HOST:PORT (port 0-65535) or unix:/path"
    return None


def _http_address(value: str) -> str | None:
    if value.startswith("unix:"):
        return "serves HTTP: must be HOST:PORT, not a unix: address"
    return _address(value) and "must be HOST:PORT (port 0-65535)"


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "memory_char_limit": _at_least(0),
    "user_char_limit": _at_least(0),
    "inject_memories_strategy": _one_of("local", "llm"),
    "max_inject_memories": _at_least(0),
    "max_injection_tokens": _at_least(0),
    "similarity_weight": _between(0, 1),
    "confidence_weight": _between(0, 1),
    "snapshot_refresh": _one_of("on_write", "on_compaction"),
    "session_idle_ttl_seconds": _at_least(1),
    "max_sessions": _at_least(1),
    "listen": lambda v: "must not be empty" if not v else _address(v),
    "health_listen": _address,
    "metrics_listen": _address,
    "mcp_listen": _http_address,
    # Below the SDK's own table (10,000), which answers every token alike.
    "mcp_max_sessions": _between(1, 10_000),
    "mcp_max_sessions_per_token": _at_least(1),
    "mcp_max_sessions_per_tenant": _at_least(1),
    # A week at most; fractions for tests and short-lived clients.
    "mcp_session_idle_minutes": _between(0.01, 10_080),
    "http_request_timeout_seconds": _between(0.1, 3600),
    "http_max_connections": _at_least(0),
    "grace_seconds": _at_least(0),
    "startup_timeout_seconds": _between(0, 86_400),
    "durability": _one_of("normal", "full"),
    "busy_timeout_ms": _at_least(0),
    "max_workers": _at_least(1),
    "max_concurrent_exports": _at_least(1),
    "max_watches": _at_least(0),
    "watch_buffer_events": _at_least(1),
    "watch_bookmark_seconds": _at_least(0.1),
    "min_generation_wait_seconds": _between(0, 3600),
    "event_retention_seconds": _at_least(0),
    "partition_cache_size": _at_least(1),
    "partition_cache_bytes": _at_least(0),
    "compact_tier_entries": _at_least(0),
    "max_sessions_total": _at_least(1),
    "content_scanning": _one_of("strict", "warn", "off"),
    "semantic_weight": _between(0, 1),
    "semantic_min_similarity": _between(-1, 1),
    "similar_writes": _one_of("allow", "report", "refuse"),
    "similar_threshold": _between(0, 1),
    # 100 years at most, as expiry.MAX_TTL_SECONDS.
    "memory_ttl_seconds": _between(0, 3_153_600_000),
    "user_ttl_seconds": _between(0, 3_153_600_000),
    "expiry_sweep_seconds": lambda v: (
        None if v == 0 or 0.05 <= v <= 86_400 else "must be 0 (off) or between 0.05 and 86400"
    ),
    "expiry_sweep_batch": _between(1, 100_000),
    # A month at most: a clock wrong for longer is an outage, not a step.
    "expiry_grace_seconds": lambda v: (
        None if 0 <= v <= 2_678_400 else "must be between 0 and 2678400 (31 days)"
    ),
    "auth_reload_seconds": _between(0.05, 3600),
    "semantic_encoder": _one_of("off", "local", "endpoint"),
    "semantic_runtime": _one_of("auto", "int8", "numpy"),
    "semantic_batch_wait_ms": _between(0, 100),
    "semantic_base_url": lambda v: (
        None if not v or v.startswith(("http://", "https://")) else "must be an http(s) URL"
    ),
    "semantic_timeout_seconds": _between(0.05, 120),
    "semantic_max_dimensions": _between(1, 65_536),
    "semantic_query_prefix": lambda v: None if len(v) <= 256 else "at most 256 characters",
    "semantic_document_prefix": lambda v: None if len(v) <= 256 else "at most 256 characters",
    "semantic_cache_bytes": _at_least(0),
    "max_content_chars": _at_least(1),
    "max_category_chars": _at_least(1),
    "max_id_chars": _at_least(1),
    "max_query_chars": _at_least(1),
    "max_message_chars": _at_least(1),
    "max_recent_messages": _at_least(0),
    "max_keywords": _at_least(0),
    "max_request_bytes": _at_least(1024),
    "max_response_bytes": _at_least(64 * 1024),
    "keyword_llm_timeout_seconds": _between(0.05, 120),
    "keyword_llm_base_url": lambda v: (
        None if not v or v.startswith(("http://", "https://")) else "must be an http(s) URL"
    ),
    "log_level": _one_of("debug", "info", "warning", "error"),
    "tracing": _one_of("off", "otlp"),
    "db": lambda v: None if v else "must not be empty",
    "change_poll_ms": _between(1, 10_000),
    "change_heartbeat_ms": _between(50, 60_000),
    "db_pool_size": lambda v: (
        None if v == 0 or 2 <= v <= 10_000 else "must be 0 (one per worker, and 4) or 2-10000"
    ),
    "db_pool_idle_seconds": _between(0.1, 86_400),
}


def mcp_session_caps(per_tenant: int, per_token: int, total: int) -> tuple[str, str] | None:
    """The key and the problem when the MCP session caps do not nest (a
    tenant within its token, a token within the whole listener)."""
    if per_tenant > per_token:
        return (
            "server.mcp_max_sessions_per_tenant",
            f"{per_tenant} is more than mcp_max_sessions_per_token ({per_token})",
        )
    if per_token > total:
        return (
            "server.mcp_max_sessions_per_token",
            f"{per_token} is more than mcp_max_sessions ({total})",
        )
    return None
