"""The one exception root and its typed leaves.

Domain code raises these; `sidecar.api.interceptors` is the one place that turns
them into gRPC status codes with a `google.rpc.ErrorInfo`. Each leaf carries a
canonical status-code name (not a grpc import: the domain never imports grpc),
a stable machine-readable `reason`, and string metadata.

Owns: the exception tree, each leaf's status-code name and default reason, and
DOMAIN. Must not touch: grpc or protobuf (sidecar.api.interceptors maps the names),
logging, or any other sidecar module: it imports none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

DOMAIN = "memory.v1"


class SidecarError(Exception):
    """Root of every error this package raises on purpose."""

    code: ClassVar[str] = "INTERNAL"
    default_reason: ClassVar[str] = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}


class InvalidArgument(SidecarError):
    code = "INVALID_ARGUMENT"
    default_reason = "INVALID_ARGUMENT"


class NotFound(SidecarError):
    code = "NOT_FOUND"
    default_reason = "MEMORY_NOT_FOUND"


class AlreadyExists(SidecarError):
    code = "ALREADY_EXISTS"
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(SidecarError):
    code = "FAILED_PRECONDITION"
    default_reason = "FAILED_PRECONDITION"


class ResourceExhausted(SidecarError):
    """An answer too large to send (a request too large never reaches us:
    gRPC refuses it first, without details)."""

    code = "RESOURCE_EXHAUSTED"
    default_reason = "RESPONSE_TOO_LARGE"


class DataLoss(SidecarError):
    """The database's storage is damaged: restore from a backup."""

    code = "DATA_LOSS"
    default_reason = "DATABASE_CORRUPT"


class Unimplemented(SidecarError):
    code = "UNIMPLEMENTED"
    default_reason = "NOT_IMPLEMENTED"


class Unavailable(SidecarError):
    code = "UNAVAILABLE"
    default_reason = "UNAVAILABLE"


class DatabaseRefused(Unavailable):
    """The database server answered and refused this daemon: wrong
    credentials, no such role or database, no permission. Callers see
    DATABASE_UNAVAILABLE as for a database out of reach; start-up fails at
    once instead of waiting for it (sidecar.ops.startup), since only a change
    of configuration mends it."""

    default_reason = "DATABASE_UNAVAILABLE"


class Unauthenticated(SidecarError):
    code = "UNAUTHENTICATED"
    default_reason = "TOKEN_INVALID"


class PermissionDenied(SidecarError):
    """The caller's token may not address the request's scope."""

    code = "PERMISSION_DENIED"
    default_reason = "SCOPE_FORBIDDEN"


class Aborted(SidecarError):
    """A stream ended because what it reads changed under it in a way it
    must not hide (an export over a scope erased meanwhile)."""

    code = "ABORTED"
    default_reason = "ABORTED"


class CallerGone(SidecarError):
    """The caller cancelled or its deadline passed before the write began."""

    code = "DEADLINE_EXCEEDED"
    default_reason = "CALLER_GONE"


class BudgetExceeded(FailedPrecondition):
    """A write would push a tier past its character budget."""

    default_reason = "TIER_BUDGET_EXCEEDED"

    def __init__(self, *, tier: str, label: str, used: int, limit: int, requested: int) -> None:
        free = max(limit - used, 0)
        message = (
            f"{label} at {used:,}/{limit:,} chars; this entry needs {requested:,} more "
            f"but only {free:,} are free; replace or remove an entry first"
        )
        super().__init__(
            message,
            metadata={
                "tier": tier,
                "used_chars": used,
                "limit_chars": limit,
                "requested_chars": requested,
            },
        )
        self.tier = tier
        self.used = used
        self.limit = limit
        self.requested = requested


class AmbiguousMatch(FailedPrecondition):
    """An edit by text (`match`) whose text occurs in several entries: the
    caller must quote more of the one it means. `candidates` are (id, the
    start of its content), in insertion order, at most SHOWN of them; `more`
    says whether further entries hold the text too."""

    default_reason = "AMBIGUOUS_MATCH"
    # How much of each candidate's content (and of the match) the message and
    # details quote: the status travels in a trailer, which must stay small.
    PREVIEW_CHARS = 60
    # How many candidates are named; pass one more to say there are more.
    SHOWN = 5

    def __init__(self, *, tier: str, match: str, candidates: list[tuple[str, str]]) -> None:
        previews = [
            (memory_id, content[: self.PREVIEW_CHARS])
            for memory_id, content in candidates[: self.SHOWN]
        ]
        more = len(candidates) > self.SHOWN
        listed = "; ".join(f"{memory_id}: {text!r}" for memory_id, text in previews)
        count = f"more than {self.SHOWN}" if more else str(len(candidates))
        super().__init__(
            f"{match[: self.PREVIEW_CHARS]!r} occurs in {count} entries of the {tier} tier "
            f"({listed}{'; and more' if more else ''}); "
            "give text that occurs in only one of them, or its id",
            metadata={
                "tier": tier,
                "candidates": len(previews),
                "more": str(more).lower(),
                "candidate_ids": ",".join(memory_id for memory_id, _ in previews),
                **{
                    f"candidate_{n}": f"{memory_id} {text}"
                    for n, (memory_id, text) in enumerate(previews, 1)
                },
            },
        )
        self.tier = tier
        self.match = match
        self.candidates = previews
        self.more = more


class SimilarExists(AlreadyExists):
    """A new entry nearly repeats an existing one and the agent's
    similar_writes policy is refuse: replace the existing entry instead."""

    default_reason = "SIMILAR_MEMORY"

    def __init__(self, *, tier: str, memory_id: str, content: str, score: float) -> None:
        super().__init__(
            f"the {tier} tier already holds a similar entry ({memory_id}: {content[:60]!r}, "
            f"similarity {score:.2f}); update or replace it instead of adding another",
            metadata={"tier": tier, "memory_id": memory_id, "score": f"{score:.3f}"},
        )
        self.tier = tier
        self.memory_id = memory_id
        self.content = content
        self.score = score


class ConfigError(SidecarError):
    """Invalid configuration: the message names the offending key."""

    default_reason = "INVALID_CONFIG"

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config: {key}: {problem}", metadata={"key": key})
        self.key = key
        self.problem = problem


class StoreError(SidecarError):
    """The database cannot be used as it is (unknown schema, newer version)."""

    code = "FAILED_PRECONDITION"
    default_reason = "STORE_UNUSABLE"
