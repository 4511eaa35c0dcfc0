"""Configuration: read once, validated, immutable, passed in.

Sources, lowest precedence first: the YAML file, the environment, the
command line. The file looks like:

    server:
      db: var/memory.db
      listen: 127.0.0.1:50051
    defaults:                  # every agent
      memory_char_limit: 2200
    agents:                    # per agent_id, over the defaults
      coder:
        user_profile_enabled: false

Environment variables are MEMORY_SIDECAR_ plus a key in upper case, for the
`server` keys and the `defaults` keys alike (MEMORY_SIDECAR_LISTEN,
MEMORY_SIDECAR_MEMORY_CHAR_LIMIT). An environment or flag value overrides the
file's value of the same key; a per-agent entry in the file still overrides
the defaults for that agent. This module is the only one that reads the
environment, and only through the mapping it is given.

Owns: every setting, default and type, the file/environment/flag precedence,
cross-key checks, and the secrets read from the variables or files named (API
keys, the database password). Must not touch: os.environ (sidecar.ops.cli passes it
in), the network, an open database, grpc. What the tracing and semantic extras need is
checked by sidecar.config.extras.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from sidecar.config.extras import check_tracing, mcp_extra_hint, semantic_changes
from sidecar.config.extras import installed as _installed
from sidecar.config.rules import CHECKS, mcp_session_caps
from sidecar.core.errors import ConfigError
from sidecar.core.limits import Limits
from sidecar.core.memory import Tier
from sidecar.storage.writes import TierPolicy

ENV_PREFIX = "MEMORY_SIDECAR_"


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """Per-agent behaviour. Names follow the seeds (cagent, DeerFlow)."""

    memory_enabled: bool = True
    user_profile_enabled: bool = True
    # A user-profile write without a user_id would land in the one profile
    # every caller without a user id shares: refused (USER_ID_REQUIRED)
    # unless the agent's deployment means that shared profile.
    shared_user_profile: bool = False
    memory_char_limit: int = 2200
    user_char_limit: int = 1375
    inject_system_block: bool = True
    inject_memories: bool = True
    inject_memories_strategy: str = "local"
    max_inject_memories: int = 20
    max_injection_tokens: int = 2000
    similarity_weight: float = 0.6
    confidence_weight: float = 0.4
    snapshot_refresh: str = "on_write"
    session_idle_ttl_seconds: float = 3600.0
    max_sessions: int = 10_000
    keyword_llm_base_url: str = ""
    keyword_llm_model: str = ""
    keyword_llm_api_key_env: str = ""
    keyword_llm_timeout_seconds: float = 5.0
    content_scanning: str = "strict"
    # With server.semantic_encoder on: how much of a match's similarity is
    # the cosine of its embedding with the query's (the rest is BM25; both
    # scaled over the search's hits, ranking.spread), and the cosine below
    # which an entry that matches no keyword is no match (a raw cosine: set
    # for all-MiniLM-L6-v2, another model's cosines lie elsewhere).
    semantic_weight: float = 0.5
    semantic_min_similarity: float = 0.35
    # Near-duplicates on AddMemory (sidecar.retrieval.similarity): report the entries
    # of the tier the new one nearly repeats (and write it), refuse the
    # write (ALREADY_EXISTS, SIMILAR_MEMORY), or allow (nothing computed);
    # nearly = a score of similar_threshold or more (0..1; the default was
    # chosen on the tuning half of bench/similarity/pairs.jsonl, section 18
    # of make bench).
    similar_writes: str = "report"
    similar_threshold: float = 0.64
    # How long a new entry of each tier lives unless its AddMemory says
    # (expires_at, ttl_seconds); 0: until deleted (sidecar.domain.expiry).
    memory_ttl_seconds: int = 0
    user_ttl_seconds: int = 0
    # Resolved from the environment variable named by keyword_llm_api_key_env;
    # never read from the file, never printed.
    keyword_llm_api_key: str = field(default="", repr=False)

    def policy(self, tier: Tier) -> TierPolicy:
        if tier is Tier.MEMORY:
            return TierPolicy(self.memory_char_limit, self.memory_enabled)
        return TierPolicy(self.user_char_limit, self.user_profile_enabled)

    def policies(self) -> dict[Tier, TierPolicy]:
        return {tier: self.policy(tier) for tier in Tier}


@dataclass(frozen=True, slots=True)
class ServerSettings:
    # An SQLite file, or a postgresql:// DSN (no password in it: see below).
    db: str = "var/memory.db"
    # A file holding the PostgreSQL password (a mounted Secret). The
    # environment variable MEMORY_SIDECAR_DB_PASSWORD may give it instead.
    db_password_file: str = ""
    # How often the SQLite change poller looks for other processes' writes.
    change_poll_ms: int = 25
    # How often the PostgreSQL listener proves its connection alive; three
    # silent heartbeats and caches are checked against the database.
    change_heartbeat_ms: int = 1000
    # Pooled database connections at most (0: one per RPC worker, as many
    # again with MCP, and 4). On PostgreSQL the change feed's listener takes
    # one more, and idle ones are closed after db_pool_idle_seconds, so a
    # replica gives back the slots (max_connections) it no longer uses.
    db_pool_size: int = 0
    db_pool_idle_seconds: float = 60.0
    listen: str = "127.0.0.1:50051"
    health_listen: str = ""
    metrics_listen: str = ""
    # The MCP server (the mcp extra): streamable HTTP at /mcp on this
    # HOST:PORT; off when empty. Loopback only, unless a token is required,
    # as for listen (sidecar.api.mcp_http).
    mcp_listen: str = ""
    # Its MCP sessions open at once, per token and scope, per token, and in
    # all; one idle this long is closed (sidecar.api.mcp_sessions).
    mcp_max_sessions_per_tenant: int = 64
    mcp_max_sessions_per_token: int = 256
    mcp_max_sessions: int = 2048
    mcp_session_idle_minutes: float = 30.0
    grace_seconds: float = 10.0
    # How long a start waits for a database it cannot reach yet (retrying
    # with back-off, health NOT_SERVING meanwhile) before it exits with
    # DATABASE_UNAVAILABLE; 0 waits forever. 120 s outlasts a PostgreSQL
    # failover or restart, and ends before the shipped startupProbe's 150 s,
    # so the exit says why rather than the kubelet killing a silent daemon.
    startup_timeout_seconds: float = 120.0
    durability: str = "normal"
    # SQLite: adds that arrive while another commits share the next write
    # transaction and its commit, each still checked and answered on its
    # own (sidecar.storage.group_commit); PostgreSQL ignores it.
    group_commit: bool = True
    busy_timeout_ms: int = 5000
    max_workers: int = 16
    # ExportMemories streams at once: each holds a worker and a connection
    # while it runs; one more is refused (RESOURCE_EXHAUSTED, EXPORTS_BUSY).
    max_concurrent_exports: int = 2
    # WatchMemories streams at once, each holding a worker thread: 0 means
    # a quarter of max_workers, at least 1 (see watch_limit).
    max_watches: int = 0
    # A watcher that falls further behind than this many events is ended
    # with WATCH_TOO_SLOW and the generation to resume from.
    watch_buffer_events: int = 1000
    # An idle watch sends a SYNC with where it stands at most this often
    # (when that moved), so a client always holds a recent resume point:
    # the retention horizon follows the whole database's writes.
    watch_bookmark_seconds: float = 60.0
    # The longest a read waits for its min_generation, whatever its deadline
    # (none: for ever otherwise); 0: the change feed's settle time.
    min_generation_wait_seconds: float = 0.0
    # How long the event log keeps events for watchers to resume (7 days:
    # a mirror offline over a long weekend resumes instead of exporting
    # again); 0 keeps them forever.
    event_retention_seconds: int = 7 * 24 * 3600
    log_level: str = "info"
    # OpenTelemetry traces (the tracing extra): off, or otlp to export them
    # where the OTEL_EXPORTER_OTLP_* variables say (sidecar.api.tracing).
    tracing: str = "off"
    partition_cache_size: int = 4096
    # ... and at most about this many bytes of them (partition.Partition.nbytes).
    partition_cache_bytes: int = 128 * 1024 * 1024
    # A tier with at least this many entries is held as a compact index
    # (sidecar.retrieval.compact: ~30 bytes per entry and 6 per indexed word, entries
    # read back by seq) instead of as Memory objects; 0 never does.
    compact_tier_entries: int = 20_000
    # Semantic retrieval (sidecar.retrieval.embedding): off; local (all-MiniLM-L6-v2
    # run in-process: the semantic extra and the model package); or endpoint
    # (an OpenAI-compatible /v1/embeddings: TEI, vLLM, Ollama), which every
    # call waits for at most semantic_timeout_seconds in all, then ranks
    # lexically. Entries' vectors are stored with them and kept in memory
    # for tiers held in full (below compact_tier_entries), within
    # semantic_cache_bytes.
    semantic_encoder: str = "off"
    semantic_model_dir: str = ""
    # local: layers run with int8 weights by onnxruntime, by numpy, or auto
    # (int8 if it loads: sidecar.retrieval.quantized), its graph cached in
    # semantic_cache_dir ("": under $XDG_CACHE_HOME or ~/.cache). A call
    # finding the encoder busy waits this long to share a pass (0: never).
    semantic_runtime: str = "auto"
    semantic_cache_dir: str = ""
    semantic_batch_wait_ms: float = 2.0
    semantic_base_url: str = ""
    semantic_model: str = ""
    semantic_api_key_env: str = ""
    semantic_timeout_seconds: float = 2.0
    # An endpoint's reply of vectors longer than this is refused as it
    # arrives (the call ranks lexically): the largest models give 4096.
    semantic_max_dimensions: int = 8192
    semantic_cache_bytes: int = 64 * 1024 * 1024
    # Put before every query, and before every entry, when embedded: the
    # instructions retrieval models such as e5 ("query: ", "passage: "), bge
    # and nomic-embed were trained with. Vectors are kept per encoder and
    # prefixes, so changing one embeds every entry again.
    semantic_query_prefix: str = ""
    semantic_document_prefix: str = ""
    # How often expired entries are removed (sidecar.domain.expiry; 0: never, then
    # only writes remove their own tier's), at most how many per tier per
    # transaction, and how long after its expiry an entry is kept, hidden, so
    # a wall clock stepped back shows it again. Invisible either way.
    expiry_sweep_seconds: float = 30.0
    expiry_sweep_batch: int = 500
    expiry_grace_seconds: float = 6 * 3600.0
    # Sessions of all agents together; beyond it the least recently used go.
    max_sessions_total: int = 50_000
    # Request limits (characters, except max_request_bytes).
    max_content_chars: int = 8192
    max_category_chars: int = 128
    max_id_chars: int = 256
    max_query_chars: int = 4096
    max_message_chars: int = 65_536
    max_recent_messages: int = 64
    max_keywords: int = 128
    max_request_bytes: int = 4 * 1024 * 1024
    # The largest response sent: gRPC clients refuse bigger ones by default.
    max_response_bytes: int = 4 * 1024 * 1024
    # The HTTP listeners (MCP, metrics): how long a request's headers and body
    # may take to arrive, and connections open at once on each (0: from the
    # descriptor limit, less a reserve: sidecar.api.bounds).
    http_request_timeout_seconds: float = 10.0
    http_max_connections: int = 0
    # Access to the API listener: one token for every scope, and/or a file
    # of tokens each limited to some agents and users (sidecar.api.access).
    auth_token_file: str = ""
    auth_tokens_file: str = ""
    # How often both are re-read (by a thread of their own, sidecar.api.reloading).
    auth_reload_seconds: float = 1.0
    insecure: bool = False
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Resolved from db_password_file or MEMORY_SIDECAR_DB_PASSWORD; never read
    # from the file or flags, never printed.
    db_password: str = field(default="", repr=False)
    # Resolved from the variable semantic_api_key_env names; never printed.
    semantic_api_key: str = field(default="", repr=False)

    @property
    def watch_limit(self) -> int:
        return self.max_watches or max(1, self.max_workers // 4)

    def limits(self) -> Limits:
        return Limits(
            content_chars=self.max_content_chars,
            category_chars=self.max_category_chars,
            id_chars=self.max_id_chars,
            query_chars=self.max_query_chars,
            message_chars=self.max_message_chars,
            recent_messages=self.max_recent_messages,
            keywords=self.max_keywords,
            response_bytes=self.max_response_bytes,
        )


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerSettings = field(default_factory=ServerSettings)
    defaults: AgentSettings = field(default_factory=AgentSettings)
    agents: Mapping[str, AgentSettings] = field(default_factory=lambda: MappingProxyType({}))

    def for_agent(self, agent_id: str) -> AgentSettings:
        return self.agents.get(agent_id, self.defaults)


# --- validation -------------------------------------------------------------


def _coerce(key: str, kind: Any, value: Any, *, from_text: bool) -> Any:
    """Check (YAML) or parse (environment, flags) one value of a known type."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if from_text and str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(key, f"must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(str(value).replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif from_text:
            try:
                number = float(str(value))
            except ValueError:
                raise ConfigError(key, f"must be a number, got {value!r}") from None
        else:
            raise ConfigError(key, f"must be a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(key, f"must be a finite number, got {value!r}")
        return number
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        # YAML 1.1 reads an unquoted `off` (or `on`, `no`, ...) as a boolean.
        return "on" if value else "off"
    if from_text:
        return str(value)
    raise ConfigError(key, f"must be a string, got {value!r}")


def _field_types(cls: type) -> dict[str, Any]:
    kinds = {"bool": bool, "int": int, "float": float, "str": str}
    return {f.name: kinds[str(f.type)] for f in dataclasses.fields(cls)}


_AGENT_KEYS = {k: v for k, v in _field_types(AgentSettings).items() if k != "keyword_llm_api_key"}
_SERVER_KEYS = {
    k: v
    for k, v in _field_types(ServerSettings).items()
    if k not in ("db_password", "semantic_api_key")
}
PASSWORD_ENV = f"{ENV_PREFIX}DB_PASSWORD"


def _check_one(path: str, key: str, kind: Any, value: Any, *, from_text: bool) -> Any:
    value = _coerce(path, kind, value, from_text=from_text)
    check = CHECKS.get(key)
    problem = check(value) if check else None
    if problem:
        raise ConfigError(path, f"{problem}, got {value!r}")
    return value


def _validated(
    prefix: str, kinds: Mapping[str, Any], values: Mapping[str, Any], *, from_text: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in kinds:
            known = ", ".join(sorted(kinds))
            raise ConfigError(path, f"unknown key (known keys: {known})")
        out[key] = _check_one(path, key, kinds[key], value, from_text=from_text)
    return out


def _mapping(key: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping, got {type(value).__name__}")
    return value


def is_loopback(address: str) -> bool:
    """Whether an API address is reachable only from this host (or pod)."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_dsn(db: str) -> bool:
    return db.startswith(("postgresql://", "postgres://"))


def _with_password(server: ServerSettings, environ: Mapping[str, str]) -> ServerSettings:
    """The PostgreSQL password, from its file or the environment (never both)."""
    from_env = environ.get(PASSWORD_ENV, "")
    if not server.db_password_file and not from_env:
        return server
    if not _is_dsn(server.db):
        key = "server.db_password_file" if server.db_password_file else PASSWORD_ENV
        raise ConfigError(key, "a database password needs server.db to be a postgresql:// DSN")
    if server.db_password_file and from_env:
        raise ConfigError(
            "server.db_password_file", f"give the password in the file or in {PASSWORD_ENV}"
        )
    password = from_env
    if server.db_password_file:
        try:
            text = Path(server.db_password_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                "server.db_password_file", f"cannot read {server.db_password_file}: {exc.strerror}"
            ) from None
        # A Secret written with `echo` ends in a newline that is not part of it.
        password = text.rstrip("\r\n")
        if not password:
            raise ConfigError("server.db_password_file", f"{server.db_password_file} is empty")
    return dataclasses.replace(server, db_password=password)


def _finish_server(server: ServerSettings) -> ServerSettings:
    """Cross-key checks on the server section."""
    if bool(server.tls_cert_file) != bool(server.tls_key_file):
        raise ConfigError("server.tls_key_file", "tls_cert_file and tls_key_file go together")
    if server.tls_client_ca_file and not server.tls_cert_file:
        raise ConfigError("server.tls_client_ca_file", "mutual TLS needs tls_cert_file too")
    tokens = server.auth_token_file or server.auth_tokens_file
    # The MCP listener takes the API's tokens, and the same rule.
    for key in ("listen", "mcp_listen"):
        address = getattr(server, key)
        if address and not is_loopback(address) and not tokens and not server.insecure:
            raise ConfigError(
                f"server.{key}",
                f"{address} is reachable from other hosts; set auth_token_file "
                "(--auth-token-file), auth_tokens_file (--auth-tokens-file) or, "
                "knowingly, insecure (--insecure)",
            )
    caps = (server.mcp_max_sessions_per_tenant, server.mcp_max_sessions_per_token)
    if (problem := mcp_session_caps(*caps, server.mcp_max_sessions)) is not None:
        raise ConfigError(*problem)
    if server.mcp_listen and not _installed("mcp.server"):
        raise ConfigError("server.mcp_listen", f"the MCP server needs {mcp_extra_hint()}")
    return server


def _finish(path: str, settings: AgentSettings, environ: Mapping[str, str]) -> AgentSettings:
    """Cross-key checks, and the API key read from the variable it names."""
    if settings.similarity_weight + settings.confidence_weight <= 0:
        raise ConfigError(
            f"{path}similarity_weight", "similarity_weight and confidence_weight are both 0"
        )
    if settings.keyword_llm_base_url and not settings.keyword_llm_model:
        raise ConfigError(f"{path}keyword_llm_model", "required with keyword_llm_base_url")
    variable = settings.keyword_llm_api_key_env
    if variable:
        if variable not in environ:
            raise ConfigError(
                f"{path}keyword_llm_api_key_env", f"environment variable {variable} is not set"
            )
        settings = dataclasses.replace(settings, keyword_llm_api_key=environ[variable])
    return settings


def load(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration from a file, an environment and flags.

    `flags` holds server keys given on the command line (None values are
    ignored). Raises ConfigError naming the key on any invalid value.
    """
    environ = environ or {}
    document = _document(path)
    server = _validated(
        "server.", _SERVER_KEYS, _mapping("server", document.get("server")), from_text=False
    )
    defaults = _validated(
        "defaults.",
        _AGENT_KEYS,
        _mapping("defaults", document.get("defaults")),
        from_text=False,
    )
    _apply_environment(server, defaults, environ)
    _apply_flags(server, flags or {})
    default_settings = _finish("defaults.", AgentSettings(**defaults), environ)
    agents = _agents(document, default_settings, environ)
    return Config(
        server=_server_settings(server, environ),
        defaults=default_settings,
        agents=MappingProxyType(agents),
    )


def _document(path: str | Path | None) -> Mapping[str, Any]:
    """The configuration file's top-level mapping ({} without a file)."""
    document: Mapping[str, Any] = {}
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
        try:
            document = _mapping("config file", yaml.safe_load(text))
        except yaml.YAMLError as exc:
            raise ConfigError("config file", f"{path} is not valid YAML: {exc}") from None
    for key in document:
        if key not in ("server", "defaults", "agents"):
            raise ConfigError(str(key), "unknown top-level key (known: server, defaults, agents)")
    return document


def _apply_environment(
    server: dict[str, Any], defaults: dict[str, Any], environ: Mapping[str, str]
) -> None:
    """MEMORY_SIDECAR_<KEY> over the file's server and defaults values, in place."""
    for section, kinds in ((server, _SERVER_KEYS), (defaults, _AGENT_KEYS)):
        for key, kind in kinds.items():
            env_key = f"{ENV_PREFIX}{key.upper()}"
            if env_key in environ:
                section[key] = _check_one(env_key, key, kind, environ[env_key], from_text=True)


def _apply_flags(server: dict[str, Any], flags: Mapping[str, Any]) -> None:
    """The command line's server keys over the file and the environment, in place."""
    for key, value in flags.items():
        if value is not None:
            flag = f"--{key.replace('_', '-')}"
            if key not in _SERVER_KEYS:
                raise ConfigError(flag, "unknown flag")
            server[key] = _check_one(flag, key, _SERVER_KEYS[key], value, from_text=True)


def _agents(
    document: Mapping[str, Any], defaults: AgentSettings, environ: Mapping[str, str]
) -> dict[str, AgentSettings]:
    """Each agent's settings: its entry in the file over the defaults."""
    agents: dict[str, AgentSettings] = {}
    for agent_id, overrides in _mapping("agents", document.get("agents")).items():
        prefix = f"agents.{agent_id}."
        values = _validated(prefix, _AGENT_KEYS, _mapping(prefix[:-1], overrides), from_text=False)
        agents[str(agent_id)] = _finish(prefix, dataclasses.replace(defaults, **values), environ)
    return agents


def _server_settings(server: Mapping[str, Any], environ: Mapping[str, str]) -> ServerSettings:
    """The server section, its password read, and its cross-key checks passed."""
    settings = _with_password(ServerSettings(**server), environ)
    settings = _finish_server(settings)
    check_tracing(settings.tracing, environ)
    return dataclasses.replace(settings, **semantic_changes(settings, environ))
