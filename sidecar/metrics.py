"""Prometheus metrics: defined here, registered on an injected registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Info, PlatformCollector, ProcessCollector

from sidecar import __version__


class Metrics:
    """Every metric the sidecar exports, on one registry.

    Tests pass a fresh CollectorRegistry so values never leak between them.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.build_info = Info(
            "memory_sidecar_build",
            "The running memory-sidecar's version.",
            registry=self.registry,
        )
        self.build_info.info({"version": __version__})
