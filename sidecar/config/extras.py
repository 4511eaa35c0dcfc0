"""The optional extras: whether one is installed, how to install it, and
what the tracing and semantic extras need of the settings.

Owns: looking a module up without importing it, the install hint the mcp
extra's errors give, and the checks of the tracing and semantic settings
(the extra, the OTLP protocol; the model, the runtime, the cache folder,
the endpoint's URL, model and key). Must not touch: the settings classes
(sidecar.config.settings asks, and applies what these return), os.environ
(the mapping is passed in), importing an extra (sidecar.retrieval's
embedding and quantized modules are imported inside a function, only when
semantic_encoder is local).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from typing import Any, Protocol

from sidecar.core.errors import ConfigError


class SemanticSettings(Protocol):
    """What the semantic checks read of the server's settings."""

    @property
    def semantic_encoder(self) -> str: ...
    @property
    def semantic_model_dir(self) -> str: ...
    @property
    def semantic_runtime(self) -> str: ...
    @property
    def semantic_cache_dir(self) -> str: ...
    @property
    def semantic_base_url(self) -> str: ...
    @property
    def semantic_model(self) -> str: ...
    @property
    def semantic_api_key_env(self) -> str: ...


def mcp_extra_hint() -> str:
    """How to install the mcp extra into this interpreter. The package is on
    no index: from the checkout, as `make run` does."""
    return (
        "the mcp extra, which `make run` installs; into this interpreter, from the "
        f"checkout: {sys.executable} -m pip install -e '.[mcp]'"
    )


def installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


# The tracing extra's exporter speaks OTLP over gRPC only.
_OTLP_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def check_tracing(tracing: str, environ: Mapping[str, str]) -> None:
    """Tracing needs its extra, and an OTLP protocol the extra speaks.

    Looks for the extra without importing it: with tracing off, nothing
    of OpenTelemetry is ever loaded.
    """
    if tracing == "off":
        return
    if not all(
        installed(m) for m in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc")
    ):
        raise ConfigError(
            "server.tracing",
            "tracing needs the tracing extra: pip install 'memory-sidecar[tracing]'",
        )
    for variable in _OTLP_PROTOCOLS:
        protocol = environ.get(variable, "")
        if protocol:
            if protocol != "grpc":
                raise ConfigError(
                    variable, f"memory-sidecar exports traces over OTLP/gRPC only, got {protocol!r}"
                )
            break


def semantic_changes(server: SemanticSettings, environ: Mapping[str, str]) -> dict[str, Any]:
    """The encoder's needs: the extra and model for `local`, a URL and a
    model name (and the key, from its variable) for `endpoint`. Returns the
    settings to fill in: the cache folder's default, the API key."""
    changes: dict[str, Any] = {}
    if server.semantic_encoder == "local":
        from sidecar.retrieval.embedding import encoder_missing
        from sidecar.retrieval.quantized import runtime_missing

        problem = encoder_missing(server.semantic_model_dir)
        if problem:
            raise ConfigError("server.semantic_encoder", problem)
        if server.semantic_runtime == "int8" and (problem := runtime_missing()):
            raise ConfigError("server.semantic_runtime", problem)
        if not server.semantic_cache_dir:
            cache = environ.get("XDG_CACHE_HOME") or (
                f"{environ['HOME']}/.cache" if environ.get("HOME") else ""
            )
            if cache:
                changes["semantic_cache_dir"] = f"{cache}/memory-sidecar"
    elif server.semantic_encoder == "endpoint":
        for key in ("semantic_base_url", "semantic_model"):
            if not getattr(server, key):
                raise ConfigError(f"server.{key}", "required with semantic_encoder: endpoint")
    variable = server.semantic_api_key_env
    if variable:
        if variable not in environ:
            raise ConfigError(
                "server.semantic_api_key_env", f"environment variable {variable} is not set"
            )
        changes["semantic_api_key"] = environ[variable]
    return changes
