"""The errors every call raises: the gRPC code, the ErrorInfo reason, its
metadata and the message, as Python exceptions.

`SidecarError` is the base; a budget refusal is `BudgetExceeded`, with the
usage as numbers, so a program branches on it without parsing text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import grpc

from memory_sidecar_client._status import error_info

BUDGET_REASONS = frozenset({"TIER_BUDGET_EXCEEDED", "ENTRY_TOO_LARGE"})


class SidecarError(Exception):
    """A failed call: `code` (grpc.StatusCode), `reason` (the ErrorInfo's,
    docs/API.md; "" when the daemon never answered, as on a cut
    connection), `metadata` (the ErrorInfo's strings) and `message`."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str = "",
        metadata: Mapping[str, str] | None = None,
        domain: str = "",
    ) -> None:
        super().__init__(f"{code.name} {reason or '-'}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})
        self.domain = domain


class BudgetExceeded(SidecarError):
    """TIER_BUDGET_EXCEEDED (the write would overflow the tier) or
    ENTRY_TOO_LARGE (the entry alone is longer than the whole budget).
    `requested_chars` is set for the first, `entry_chars` for the second."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str = "",
        metadata: Mapping[str, str] | None = None,
        domain: str = "",
    ) -> None:
        super().__init__(code, message, reason, metadata, domain)
        self.tier = self.metadata.get("tier", "")
        self.used_chars = _number(self.metadata, "used_chars")
        self.limit_chars = _number(self.metadata, "limit_chars")
        self.requested_chars = _number(self.metadata, "requested_chars")
        self.entry_chars = _number(self.metadata, "entry_chars")


class _Failed(Protocol):
    """What grpc.RpcError (sync) and grpc.aio.AioRpcError both offer."""

    def code(self) -> grpc.StatusCode: ...
    def details(self) -> str | None: ...
    def trailing_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...


def from_rpc_error(error: grpc.RpcError) -> SidecarError:
    """The typed error for a failed call."""
    failed: _Failed = error  # type: ignore[assignment]
    try:
        trailers = failed.trailing_metadata()
    except Exception:  # a call object that never got trailers
        trailers = None
    reason, domain, metadata = error_info(trailers)
    kind = BudgetExceeded if reason in BUDGET_REASONS else SidecarError
    return kind(failed.code(), failed.details() or "", reason, metadata, domain)


def _number(metadata: Mapping[str, str], key: str) -> int | None:
    value = metadata.get(key)
    return int(value) if value is not None and value.lstrip("-").isdigit() else None
