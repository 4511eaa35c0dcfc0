"""Pages of list and search results (AIP-158), and responses that fit.

A page token says where the next page starts (a memory's seq for lists,
an offset into the ranking for search), carries a digest of the request
that asked for it, so a token replayed with other filters is refused
instead of silently paging through something else, and is signed
(HMAC-SHA256) with the database's own key (sidecar.storage.store.page_token_key),
so a token this server did not issue, or one edited to start elsewhere, is
refused. Every replica of one database holds the same key: a token issued
by one pages on any other. Tokens are not encrypted: a client may read
them, not make them. ExportMemories' cursors are page tokens too.

A page also ends early when the next entry would push the response past
the byte budget (server.max_response_bytes), so no response a client asks
for exceeds gRPC's default 4 MiB receive limit, whatever page_size says.

Owns: the page-token format (versioned, bound to a request digest, signed;
one position or a few, an export's one per partition),
page sizes, the byte budget that ends a page early, and the bound on an
InjectForTurn answer's size that says when to measure it. Must not touch: grpc
or generated classes (messages are only measured, through ByteSize), the
engine, the store (the key is handed in).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any

from sidecar.core.errors import InvalidArgument, PageTokenMismatch, Reason, ResourceExhausted
from sidecar.core.limits import caller_json

# 1: unsigned (before schema 8); 2: [2, kind, digest, position, signature].
_VERSION = 2
# Tokens this module issues are far shorter; positions are 64-bit seqs.
_MAX_TOKEN_CHARS = 256
_MAX_POSITION = 2**63 - 1
# A token holds one position, or one per partition an export reads (at
# most two: a scope's tiers).
_MAX_POSITIONS = 4
# A truncated HMAC-SHA256: 128 bits leave nothing to guess, and keep the
# token short.
_SIGNATURE_BYTES = 16
# Beyond its texts and ids, an InjectForTurn answer holds counts and usage.
_TURN_MARGIN = 64 * 1024


Position = int | Sequence[int]
_NOT_ISSUED = (
    "page_token is not a token this server issued; "
    "pass next_page_token from the previous response unchanged"
)


def digest(*fields: object) -> str:
    """A short fingerprint of the request fields a token is bound to."""
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(message, reason=Reason.PAGE_TOKEN_INVALID)


class PageTokens:
    """Issues and checks the page tokens of one database, signed with its key.

    >>> tokens = PageTokens(store.page_token_key())
    >>> token = tokens.encode("list", digest(scope), 42)
    >>> tokens.decode(token, "list", digest(scope))
    42

    Keyed once the store is open (`use`); nothing is served before that.
    """

    def __init__(self, key: bytes = b"") -> None:
        self._key = key

    def use(self, key: bytes) -> None:
        self._key = key

    def _signature(self, kind: str, bound_to: str, position: Position) -> str:
        if not self._key:
            # Serving before the store was opened: a bug, not a client error.
            raise RuntimeError("page tokens used before the database's key was read")
        fields = json.dumps([_VERSION, kind, bound_to, position], separators=(",", ":"))
        mac = hmac.digest(self._key, fields.encode(), "sha256")[:_SIGNATURE_BYTES]
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def encode(self, kind: str, bound_to: str, position: Position) -> str:
        """A token of one position, or of several (an export's, one per
        partition: sidecar.api.export)."""
        if not isinstance(position, int):
            position = list(position)
        signature = self._signature(kind, bound_to, position)
        raw = json.dumps([_VERSION, kind, bound_to, position, signature], separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    def decode(self, token: str, kind: str, bound_to: str) -> int:
        """The position a token points at; 0 for no token (the first page)."""
        position = self._decoded(token, kind, bound_to)
        if not isinstance(position, int):
            raise _invalid(_NOT_ISSUED)
        return position

    def decode_positions(self, token: str, kind: str, bound_to: str, count: int) -> list[int]:
        """The `count` positions a token points at: [0] * count for no
        token, and a token of one position (an export cursor issued before
        cursors held one per partition) as that position `count` times."""
        position = self._decoded(token, kind, bound_to)
        if isinstance(position, int):
            return [position] * count
        if len(position) != count:
            raise _invalid(_NOT_ISSUED)
        return position

    def _decoded(self, token: str, kind: str, bound_to: str) -> int | list[int]:
        if not token:
            return 0
        fields = _fields(token)
        if fields is not None and fields[0] == 1:
            raise _invalid(
                "page_token is of an older, unsigned format this server no longer accepts; "
                "start again from the first page (an empty page_token)"
            )
        valid = (
            fields is not None
            and len(fields) == 5
            and fields[0] == _VERSION
            and all(type(value) is str for value in (fields[1], fields[2], fields[4]))
            and _is_position(fields[3])
            # Constant time: how much of a guess matched must not show.
            and hmac.compare_digest(
                self._signature(fields[1], fields[2], fields[3]).encode(), fields[4].encode()
            )
        )
        if not valid or fields is None:
            raise _invalid(_NOT_ISSUED)
        _version, token_kind, token_digest, position, _signature = fields
        if (token_kind, token_digest) != (kind, bound_to):
            raise PageTokenMismatch(
                "page_token belongs to a different request; "
                "repeat every other field of the request that returned it"
            )
        return int(position) if isinstance(position, int) else [int(p) for p in position]


def _is_seq(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX_POSITION  # not a bool


def _is_position(value: Any) -> bool:
    """One position, or a short list of them."""
    if type(value) is list:
        return 0 < len(value) <= _MAX_POSITIONS and all(_is_seq(v) for v in value)
    return _is_seq(value)


def _fields(token: str) -> list[Any] | None:
    """A token's fields, or None when it is not a JSON list in base64."""
    if len(token) > _MAX_TOKEN_CHARS:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        fields = caller_json("page_token", raw.decode())
    except (binascii.Error, ValueError, InvalidArgument):
        return None
    return fields if isinstance(fields, list) and fields else None


def page_size(value: int, *, default: int, maximum: int) -> int:
    """The page size asked for: 0 is the default, over the maximum is the maximum."""
    if value < 0:
        raise InvalidArgument(
            f"page_size must not be negative, got {value}",
            reason=Reason.PAGE_SIZE_OUT_OF_RANGE,
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


def turn_bound(chars: int, ids: int, id_chars: int) -> int:
    """An upper bound on the bytes of an InjectForTurn answer whose texts
    hold `chars` characters and which lists `ids` ids, cheap to take where
    ByteSize is not: 4 bytes a character, an id at most `id_chars`, and a
    margin for counts and usage."""
    return 4 * chars + ids * (4 * id_chars + 4) + _TURN_MARGIN


def refuse_if_too_large(response: Any, max_bytes: int, what: str, hint: str) -> None:
    """Refuse a response the client could not receive, saying why."""
    size = int(response.ByteSize())
    if size > max_bytes:
        raise ResourceExhausted(
            f"the {what} would be {size:,} bytes, over the {max_bytes:,}-byte response "
            f"limit (server.max_response_bytes); {hint}",
            reason=Reason.RESPONSE_TOO_LARGE,
            metadata={"size": size, "max": max_bytes},
        )
