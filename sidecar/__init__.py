"""memory-sidecar: a gRPC daemon that owns an AI agent's long-term memory."""

__version__ = "0.1.0"

__all__ = ["__version__"]
