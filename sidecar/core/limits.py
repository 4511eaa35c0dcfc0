"""Limits on request fields, and the characters a field may hold.

Every refusal names the field and the limit, in the message and in the
ErrorInfo metadata, so a client can tell what to shorten.

Owns: the Limits record and the checks on lengths, control characters and item
counts, with their reasons. Must not touch: the defaults (sidecar.config.settings holds
them), protobuf messages (callers pass strings and counts), the store; no state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sidecar.core.errors import InvalidArgument, Reason

# Unicode's Cc category is exactly U+0000-U+001F and U+007F-U+009F. A
# multi-line text may hold tab, newline and carriage return; nothing else in
# it (NUL, ESC, DEL, ...) is allowed anywhere.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")
_MULTILINE_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


@dataclass(frozen=True, slots=True)
class Limits:
    """Built from the configuration (ServerSettings.limits), where the defaults live."""

    content_chars: int
    category_chars: int
    id_chars: int
    query_chars: int
    message_chars: int
    recent_messages: int
    keywords: int
    # Not a request field: the largest response the service sends.
    response_bytes: int = 4 * 1024 * 1024


def checked(field: str, value: str, limit: int, *, multiline: bool = False) -> str:
    """The value, if it is within `limit` characters and has no stray controls."""
    if len(value) > limit:
        raise InvalidArgument(
            f"{field} is {len(value):,} characters long; the limit is {limit:,}",
            reason=Reason.FIELD_TOO_LONG,
            metadata={"field": field, "limit": limit, "length": len(value)},
        )
    found = (_MULTILINE_CONTROLS if multiline else _CONTROLS).search(value)
    if found:
        position, char = found.start(), found.group()
        raise InvalidArgument(
            f"{field} holds the control character U+{ord(char):04X} at position {position}",
            reason=Reason.CONTROL_CHARACTER,
            metadata={"field": field, "position": position, "character": f"U+{ord(char):04X}"},
        )
    return value


def counted(field: str, count: int, limit: int) -> None:
    if count > limit:
        raise InvalidArgument(
            f"{field} has {count:,} items; the limit is {limit:,}",
            reason=Reason.TOO_MANY_ITEMS,
            metadata={"field": field, "limit": limit, "count": count},
        )
