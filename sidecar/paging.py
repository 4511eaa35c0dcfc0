"""Pages of list and search results (AIP-158), and responses that fit.

A page token says where the next page starts (a memory's seq for lists,
an offset into the ranking for search) and carries a digest of the request
that asked for it, so a token replayed with other filters is refused
instead of silently paging through something else. Tokens are opaque to
clients and need no secrecy: the scope is checked on every call anyway.

A page also ends early when the next entry would push the response past
the byte budget (server.max_response_bytes), so no response a client asks
for exceeds gRPC's default 4 MiB receive limit, whatever page_size says.

Owns: the page-token format (versioned, bound to a request digest), page sizes,
and the byte budget that ends a page early. Must not touch: grpc or generated
classes (messages are only measured, through ByteSize), the engine, the store;
no state, and no signing: a token holds no secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

from sidecar.errors import InvalidArgument, ResourceExhausted

_VERSION = 1
# Tokens this module issues are far shorter; positions are 64-bit seqs.
_MAX_TOKEN_CHARS = 256
_MAX_POSITION = 2**63 - 1


def digest(*fields: object) -> str:
    """A short fingerprint of the request fields a token is bound to."""
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def encode(kind: str, bound_to: str, position: int) -> str:
    raw = json.dumps([_VERSION, kind, bound_to, position], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode(token: str, kind: str, bound_to: str) -> int:
    """The position a token points at; 0 for no token (the first page)."""
    if not token:
        return 0
    valid = False
    if len(token) <= _MAX_TOKEN_CHARS:
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            version, token_kind, token_digest, position = json.loads(raw)
            valid = (
                version == _VERSION
                and type(position) is int  # not a bool
                and 0 <= position <= _MAX_POSITION
            )
        except (binascii.Error, ValueError, TypeError, RecursionError):
            valid = False
    if not valid:
        raise InvalidArgument(
            "page_token is not a token this server issued; "
            "pass next_page_token from the previous response unchanged",
            reason="PAGE_TOKEN_INVALID",
        )
    if (token_kind, token_digest) != (kind, bound_to):
        raise InvalidArgument(
            "page_token belongs to a different request; "
            "repeat every other field of the request that returned it",
            reason="PAGE_TOKEN_MISMATCH",
        )
    return int(position)


def page_size(value: int, *, default: int, maximum: int) -> int:
    """The page size asked for: 0 is the default, over the maximum is the maximum."""
    if value < 0:
        raise InvalidArgument(
            f"page_size must not be negative, got {value}",
            reason="PAGE_SIZE_OUT_OF_RANGE",
            metadata={"page_size": value},
        )
    return min(value or default, maximum)


def _varint_size(value: int) -> int:
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def entry_size(message: Any) -> int:
    """Bytes a message adds as one element of a repeated field (field
    numbers below 16: a one-byte tag, the length, the message)."""
    size = int(message.ByteSize())
    return 1 + _varint_size(size) + size


class Budget:
    """Bytes left for a response's repeated entries."""

    # Room for a next_page_token and the fields set after filling.
    _RESERVE = 256

    def __init__(self, max_bytes: int, response: Any) -> None:
        self.left = max_bytes - int(response.ByteSize()) - self._RESERVE

    def take(self, message: Any, *, first: bool = False) -> bool:
        """Whether the message still fits (a page's first always does, or a
        page could be empty with more to come); if so, it is counted."""
        size = entry_size(message)
        if size > self.left and not first:
            return False
        self.left -= size
        return True


def refuse_if_too_large(response: Any, max_bytes: int, what: str, hint: str) -> None:
    """Refuse a response the client could not receive, saying why."""
    size = int(response.ByteSize())
    if size > max_bytes:
        raise ResourceExhausted(
            f"the {what} would be {size:,} bytes, over the {max_bytes:,}-byte response "
            f"limit (server.max_response_bytes); {hint}",
            reason="RESPONSE_TOO_LARGE",
            metadata={"size": size, "max": max_bytes},
        )
