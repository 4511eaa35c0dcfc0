"""Limits on request fields, and the characters a field may hold.

Every refusal names the field and the limit, in the message and in the
ErrorInfo metadata, so a client can tell what to shorten.

Owns: the Limits record and the checks on lengths, control characters, lone
surrogates and item counts, and the parse of JSON a caller sends inside a
field (`caller_json`), with their reasons. Must not touch: the defaults
(sidecar.config.settings holds them), protobuf messages (callers pass strings
and counts), the store; no state.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sidecar.core.errors import InvalidArgument, Reason

# Unicode's Cc category is exactly U+0000-U+001F and U+007F-U+009F. A
# multi-line text may hold tab, newline and carriage return; nothing else in
# it (NUL, ESC, DEL, ...) is allowed anywhere.
# Half of a UTF-16 surrogate pair is no character: it cannot be encoded as
# UTF-8, so the store, the protobuf answer and the log would each fail on it.
# Protobuf refuses it in a string field; JSON inside one spells it "\ud800".
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_MULTILINE_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
_SURROGATES = re.compile("[\ud800-\udfff]")


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
    if found and _SURROGATES.match(found.group()):
        raise _lone_surrogate(field, found.group(), found.start())
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


def _lone_surrogate(field: str, char: str, position: int) -> InvalidArgument:
    return InvalidArgument(
        f"{field} holds half of a surrogate pair (U+{ord(char):04X}) at position {position}, "
        "which is not a character: send text as valid Unicode",
        reason=Reason.LONE_SURROGATE,
        metadata={"field": field, "position": position, "character": f"U+{ord(char):04X}"},
    )


# How deep JSON a caller sends may nest: a tool call's arguments nest two
# levels. Python's parser recurses once per level and gives up (RecursionError)
# near a thousand, so the depth is counted before it runs.
JSON_DEPTH = 32
# A JSON string, possessively: an unterminated one is given up on at once.
_JSON_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)
# Outside strings, brackets alone, of one kind (the depth is the same).
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
# Only an escape of U+D800-U+DFFF can put a surrogate in parsed JSON.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _too_deep(text: str) -> bool:
    """Whether the brackets outside strings nest deeper than JSON_DEPTH:
    the innermost pairs taken away, one level a round, in C (a text may be
    as wide as a request). What is left after the last round is unbalanced
    (JSON the parser refuses) or deeper: its openers are levels more."""
    outside = _JSON_STRING.sub("", text).encode("utf-8", "surrogatepass")
    brackets = outside.translate(_ONE_KIND, _NOT_BRACKETS)
    rounds = 0
    while brackets and rounds < JSON_DEPTH:
        inner = brackets.replace(b"[]", b"")
        if inner == brackets:
            break
        brackets, rounds = inner, rounds + 1
    return rounds + brackets.count(b"[") > JSON_DEPTH


def caller_json(field: str, text: str) -> Any:
    """`text` parsed as JSON: InvalidArgument when it nests deeper than
    JSON_DEPTH (JSON_TOO_DEEP) or a string in it, key or value, holds half a
    surrogate pair (LONE_SURROGATE, as `checked` says of a field);
    ValueError when it is not JSON. Every JSON a caller sends is read
    through here."""
    if _too_deep(text):
        raise InvalidArgument(
            f"{field} nests more than {JSON_DEPTH} levels deep",
            reason=Reason.JSON_TOO_DEEP,
            metadata={"field": field, "limit": JSON_DEPTH},
        )
    parsed = json.loads(text)
    if _SURROGATE_ESCAPE.search(text):
        for value in _strings(parsed):
            found = _SURROGATES.search(value)
            if found:
                raise _lone_surrogate(field, found.group(), found.start())
    return parsed


def _strings(value: Any) -> list[str]:
    """Every string in parsed JSON, keys and values (no recursion)."""
    strings, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return strings
