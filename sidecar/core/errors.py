"""The one exception root, its typed leaves, and every reason they carry.

Domain code raises these; `sidecar.api.interceptors` is the one place that turns
them into gRPC status codes with a `google.rpc.ErrorInfo`. Each leaf carries a
canonical status-code name (not a grpc import: the domain never imports grpc),
a stable machine-readable `reason`, and string metadata.

Every reason is a member of `Reason`, here and nowhere else: clients read
them in ErrorInfo, so their values never change. A reason a caller branches
on has a leaf of its own (`MatchNotFound`, `PageTokenMismatch`, the database
faults), so the caller writes `except`/`isinstance`, never a comparison of
strings; any other reason is passed as `reason=Reason.X` to its status's
class.

Owns: the exception tree, each leaf's status-code name and default reason,
`Reason`, and DOMAIN. Must not touch: grpc or protobuf (sidecar.api.interceptors
maps the names), logging, or any other sidecar module: it imports none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import ClassVar

DOMAIN = "memory.v1"


class Reason(StrEnum):
    """Every ErrorInfo reason (and tool-error reason) the sidecar gives. A
    member's value is its name, spelled out: `auto()` would lower-case it."""

    # The status classes' defaults.
    INTERNAL = "INTERNAL"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    NOT_IMPLEMENTED = "NOT_IMPLEMENTED"
    UNAVAILABLE = "UNAVAILABLE"
    ABORTED = "ABORTED"
    INVALID_CONFIG = "INVALID_CONFIG"
    STORE_UNUSABLE = "STORE_UNUSABLE"

    # A request's fields.
    MALFORMED_REQUEST = "MALFORMED_REQUEST"
    CONTENT_EMPTY = "CONTENT_EMPTY"
    CONTENT_REJECTED = "CONTENT_REJECTED"
    CONFIDENCE_OUT_OF_RANGE = "CONFIDENCE_OUT_OF_RANGE"
    TIER_UNKNOWN = "TIER_UNKNOWN"
    STRATEGY_UNKNOWN = "STRATEGY_UNKNOWN"
    ID_EMPTY = "ID_EMPTY"
    ID_AND_MATCH = "ID_AND_MATCH"
    MATCH_EMPTY = "MATCH_EMPTY"
    SESSION_ID_EMPTY = "SESSION_ID_EMPTY"
    USER_ID_REQUIRED = "USER_ID_REQUIRED"
    USER_ID_EMPTY = "USER_ID_EMPTY"
    LIMIT_OUT_OF_RANGE = "LIMIT_OUT_OF_RANGE"
    MAX_MEMORIES_OUT_OF_RANGE = "MAX_MEMORIES_OUT_OF_RANGE"
    MAX_TOKENS_OUT_OF_RANGE = "MAX_TOKENS_OUT_OF_RANGE"
    FIELD_TOO_LONG = "FIELD_TOO_LONG"
    TOO_MANY_ITEMS = "TOO_MANY_ITEMS"
    CONTROL_CHARACTER = "CONTROL_CHARACTER"
    LONE_SURROGATE = "LONE_SURROGATE"
    JSON_TOO_DEEP = "JSON_TOO_DEEP"
    EXPIRY_CONFLICT = "EXPIRY_CONFLICT"
    TTL_OUT_OF_RANGE = "TTL_OUT_OF_RANGE"
    EXPIRES_AT_PAST = "EXPIRES_AT_PAST"
    EXPIRES_AT_TOO_FAR = "EXPIRES_AT_TOO_FAR"
    EXPIRES_AT_INVALID = "EXPIRES_AT_INVALID"
    HEADER_INVALID = "HEADER_INVALID"

    # Who may ask.
    TOKEN_MISSING = "TOKEN_MISSING"
    TOKEN_INVALID = "TOKEN_INVALID"
    SCOPE_FORBIDDEN = "SCOPE_FORBIDDEN"
    ERASE_NOT_GRANTED = "ERASE_NOT_GRANTED"

    # The entries a write or an edit meets.
    MEMORY_NOT_FOUND = "MEMORY_NOT_FOUND"
    EXPIRED = "EXPIRED"
    MATCH_NOT_FOUND = "MATCH_NOT_FOUND"
    EDIT_CONFLICT = "EDIT_CONFLICT"
    AMBIGUOUS_MATCH = "AMBIGUOUS_MATCH"
    TIER_BUDGET_EXCEEDED = "TIER_BUDGET_EXCEEDED"
    ENTRY_TOO_LARGE = "ENTRY_TOO_LARGE"
    TIER_DISABLED = "TIER_DISABLED"
    SIMILAR_MEMORY = "SIMILAR_MEMORY"
    DUPLICATE_CONTENT = "DUPLICATE_CONTENT"
    IDEMPOTENCY_KEY_REUSED = "IDEMPOTENCY_KEY_REUSED"
    IDEMPOTENCY_KEY_USED = "IDEMPOTENCY_KEY_USED"
    CALLER_GONE = "CALLER_GONE"

    # The model's tools.
    TOOL_UNKNOWN = "TOOL_UNKNOWN"
    ARGUMENTS_INVALID = "ARGUMENTS_INVALID"
    # Claude's memory tool (memory_20250818): its paths and lines.
    PATH_OUTSIDE_MEMORIES = "PATH_OUTSIDE_MEMORIES"
    PATH_NOT_FOUND = "PATH_NOT_FOUND"
    NOT_A_FILE = "NOT_A_FILE"
    FILE_EXISTS = "FILE_EXISTS"
    FILE_FIXED = "FILE_FIXED"
    LINE_OUT_OF_RANGE = "LINE_OUT_OF_RANGE"
    SPANS_ENTRIES = "SPANS_ENTRIES"

    # Pages, answers and exports.
    PAGE_SIZE_OUT_OF_RANGE = "PAGE_SIZE_OUT_OF_RANGE"
    PAGE_TOKEN_INVALID = "PAGE_TOKEN_INVALID"
    PAGE_TOKEN_MISMATCH = "PAGE_TOKEN_MISMATCH"
    RESPONSE_TOO_LARGE = "RESPONSE_TOO_LARGE"
    CURSOR_INVALID = "CURSOR_INVALID"
    BATCH_SIZE_OUT_OF_RANGE = "BATCH_SIZE_OUT_OF_RANGE"
    FOR_USER_WITH_AGENT = "FOR_USER_WITH_AGENT"
    FOR_USER_TIER = "FOR_USER_TIER"
    SCOPE_ERASED = "SCOPE_ERASED"
    EXPORTS_BUSY = "EXPORTS_BUSY"
    MCP_SESSIONS_EXHAUSTED = "MCP_SESSIONS_EXHAUSTED"

    # The database.
    DATABASE_UNAVAILABLE = "DATABASE_UNAVAILABLE"
    DATABASE_BUSY = "DATABASE_BUSY"
    DATABASE_READ_ONLY = "DATABASE_READ_ONLY"
    DATABASE_CORRUPT = "DATABASE_CORRUPT"
    DATABASE_IO_ERROR = "DATABASE_IO_ERROR"
    STORAGE_FULL = "STORAGE_FULL"
    REPLICA_BEHIND = "REPLICA_BEHIND"

    # WatchMemories.
    WATCHES_EXHAUSTED = "WATCHES_EXHAUSTED"
    WATCH_TOO_SLOW = "WATCH_TOO_SLOW"
    WATCH_GENERATION_PRUNED = "WATCH_GENERATION_PRUNED"
    WATCH_GENERATION_AHEAD = "WATCH_GENERATION_AHEAD"
    GENERATION_INVALID = "GENERATION_INVALID"
    RESUME_POINT_INVALID = "RESUME_POINT_INVALID"
    SERVER_STOPPING = "SERVER_STOPPING"

    # The operator's commands and the daemon's listeners.
    BACKUP_TARGET_EXISTS = "BACKUP_TARGET_EXISTS"
    IMPORT_SOURCE_MISSING = "IMPORT_SOURCE_MISSING"
    IMPORT_SOURCE_INVALID = "IMPORT_SOURCE_INVALID"
    IMPORT_LINE_INVALID = "IMPORT_LINE_INVALID"
    DAEMON_UNREACHABLE = "DAEMON_UNREACHABLE"
    TOKEN_FILE_UNREADABLE = "TOKEN_FILE_UNREADABLE"
    TLS_CA_FILE_UNREADABLE = "TLS_CA_FILE_UNREADABLE"
    BIND_FAILED = "BIND_FAILED"


class SidecarError(Exception):
    """Root of every error this package raises on purpose.

    `reason` overrides the class's default: a `Reason` at a raise site, or
    the reason a remote daemon answered with (sidecar.ops.mcp_stdio), kept
    as it came."""

    code: ClassVar[str] = "INTERNAL"
    default_reason: ClassVar[Reason] = Reason.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        # A plain str, as before Reason: what reaches ErrorInfo, JSON and
        # metric labels is the value alone.
        self.reason = str(reason or self.default_reason)
        # As given (counts stay integers: what a tool's JSON answer shows),
        # and as ErrorInfo carries them (strings).
        self.details: dict[str, object] = dict(metadata or {})
        self.metadata = {k: str(v) for k, v in self.details.items()}


class InvalidArgument(SidecarError):
    code = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_ARGUMENT


class NotFound(SidecarError):
    code = "NOT_FOUND"
    default_reason = Reason.MEMORY_NOT_FOUND


class AlreadyExists(SidecarError):
    code = "ALREADY_EXISTS"
    default_reason = Reason.ALREADY_EXISTS


class FailedPrecondition(SidecarError):
    code = "FAILED_PRECONDITION"
    default_reason = Reason.FAILED_PRECONDITION


class ResourceExhausted(SidecarError):
    """An answer too large to send (a request too large never reaches us:
    gRPC refuses it first, without details)."""

    code = "RESOURCE_EXHAUSTED"
    default_reason = Reason.RESPONSE_TOO_LARGE


class DataLoss(SidecarError):
    """The database's storage is damaged: restore from a backup."""

    code = "DATA_LOSS"
    default_reason = Reason.DATABASE_CORRUPT


class Unimplemented(SidecarError):
    code = "UNIMPLEMENTED"
    default_reason = Reason.NOT_IMPLEMENTED


class Unavailable(SidecarError):
    code = "UNAVAILABLE"
    default_reason = Reason.UNAVAILABLE


class Unauthenticated(SidecarError):
    code = "UNAUTHENTICATED"
    default_reason = Reason.TOKEN_INVALID


class PermissionDenied(SidecarError):
    """The caller's token may not address the request's scope."""

    code = "PERMISSION_DENIED"
    default_reason = Reason.SCOPE_FORBIDDEN


class Aborted(SidecarError):
    """A stream ended because what it reads changed under it in a way it
    must not hide (an export over a scope erased meanwhile)."""

    code = "ABORTED"
    default_reason = Reason.ABORTED


class EditConflict(Aborted):
    """An edit made against an entry as it was read (`Edit.expected`) found
    it changed by another writer meanwhile: nothing was written; read it
    again and redo the edit."""

    default_reason = Reason.EDIT_CONFLICT


class CallerGone(SidecarError):
    """The caller cancelled or its deadline passed before the write began."""

    code = "DEADLINE_EXCEEDED"
    default_reason = Reason.CALLER_GONE


class BudgetExceeded(FailedPrecondition):
    """A write would push a tier past its character budget."""

    default_reason = Reason.TIER_BUDGET_EXCEEDED

    def __init__(
        self,
        *,
        tier: str,
        label: str,
        used: int,
        limit: int,
        requested: int,
        separator: int = 0,
    ) -> None:
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
        # The part of `requested` that separates a new entry from the tier's
        # others in the frozen block (what the model's tools explain).
        self.separator = separator


class EntryTooLarge(BudgetExceeded):
    """One entry longer than its tier's whole budget: no removal can make
    room for it; only a shorter entry fits."""

    default_reason = Reason.ENTRY_TOO_LARGE

    def __init__(self, *, tier: str, label: str, used: int, limit: int, entry: int) -> None:
        FailedPrecondition.__init__(
            self,
            f"this entry is {entry:,} characters and the whole {label} budget is "
            f"{limit:,}: shorten it to at most {limit:,} characters; removing entries "
            "cannot make room",
            metadata={"tier": tier, "entry_chars": entry, "limit_chars": limit},
        )
        self.tier, self.used, self.limit, self.requested = tier, used, limit, entry
        self.separator = 0


class AmbiguousMatch(FailedPrecondition):
    """An edit by text (`match`) whose text occurs in several entries: the
    caller must quote more of the one it means. `candidates` are (id, the
    start of its content), in insertion order, at most SHOWN of them; `more`
    says whether further entries hold the text too."""

    default_reason = Reason.AMBIGUOUS_MATCH
    # How much of each candidate's content (and of the match) the message and
    # details quote: the status travels in a trailer, which must stay small.
    PREVIEW_CHARS = 60
    # How many candidates are named; pass one more to say there are more.
    SHOWN = 5

    def __init__(
        self,
        *,
        tier: str,
        match: str,
        candidates: list[tuple[str, str]],
        categories: Sequence[str] = (),
    ) -> None:
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
        # The named entries whole, with their categories: how the model's
        # tools show them depends on both (sidecar.retrieval.scanner).
        named = candidates[: self.SHOWN]
        kinds = [*categories[: len(named)], *[""] * (len(named) - len(categories))]
        self.entries = [(i, content, kind) for (i, content), kind in zip(named, kinds, strict=True)]


class SimilarExists(AlreadyExists):
    """A new entry nearly repeats an existing one and the agent's
    similar_writes policy is refuse: replace the existing entry instead."""

    default_reason = Reason.SIMILAR_MEMORY

    def __init__(
        self, *, tier: str, memory_id: str, content: str, score: float, category: str = ""
    ) -> None:
        super().__init__(
            f"the {tier} tier already holds a similar entry ({memory_id}: {content[:60]!r}, "
            f"similarity {score:.2f}); update or replace it instead of adding another",
            metadata={"tier": tier, "memory_id": memory_id, "score": f"{score:.3f}"},
        )
        self.tier = tier
        self.memory_id = memory_id
        self.content = content
        self.category = category
        self.score = score


class ConfigError(SidecarError):
    """Invalid configuration: the message names the offending key."""

    default_reason = Reason.INVALID_CONFIG

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config: {key}: {problem}", metadata={"key": key})
        self.key = key
        self.problem = problem


class MatchNotFound(NotFound):
    """An edit by text (`match`) whose text occurs in no entry of the tier."""

    default_reason = Reason.MATCH_NOT_FOUND


class PageTokenMismatch(InvalidArgument):
    """A page token sent with other filters than the request that returned
    it (an export's cursor answers CURSOR_INVALID instead)."""

    default_reason = Reason.PAGE_TOKEN_MISMATCH


# --- the database -------------------------------------------------------------
# Each fault is a leaf of its status's class, so start-up (sidecar.ops.startup)
# tells what waiting may mend by type.


class StoreError(FailedPrecondition):
    """The database cannot be used as it is (unknown schema, newer version):
    the operator's to mend, so the model's tools (sidecar.domain.tools) let
    it through instead of answering it as a tool error as other
    FAILED_PRECONDITIONs are."""

    default_reason = Reason.STORE_UNUSABLE


class DatabaseUnavailable(Unavailable):
    """The database is out of reach, or not accepting connections yet."""

    default_reason = Reason.DATABASE_UNAVAILABLE


class DatabaseRefused(DatabaseUnavailable):
    """The database server answered and refused this daemon: wrong
    credentials, no such role or database, no permission. Callers see
    DATABASE_UNAVAILABLE as for a database out of reach; start-up fails at
    once instead of waiting for it (sidecar.ops.startup), since only a change
    of configuration mends it."""


class DatabaseBusy(Unavailable):
    """A lock, a connection or a slot stayed taken, or a write conflicted:
    nothing was written; retry."""

    default_reason = Reason.DATABASE_BUSY


class DatabaseReadOnly(FailedPrecondition):
    """The database refuses writes: a read-only file, directory or mount, or
    a PostgreSQL standby. Reads still work."""

    default_reason = Reason.DATABASE_READ_ONLY


class DatabaseIOError(Unavailable):
    """The disk failed a read or a write; retry."""

    default_reason = Reason.DATABASE_IO_ERROR


class StorageFull(ResourceExhausted):
    """The disk (or the database server's) is full; nothing was written."""

    default_reason = Reason.STORAGE_FULL
