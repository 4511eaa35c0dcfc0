"""Counting tokens the way DeerFlow does.

tiktoken's cl100k_base when tiktoken is installed and its encoding can be
loaded (it may need to fetch the encoding file once, which fails offline);
otherwise len(text) // 4. Responses say which counter produced their numbers.

Owns: which counter is used, chosen once per TokenCounter, and the counter names
responses report. Must not touch: configuration, gRPC, the store, other sidecar
modules. Building one may reach the network (tiktoken fetching its encoding, at
the engine's start-up); counting never does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("sidecar.tokens")

TIKTOKEN = "tiktoken_cl100k_base"
CHARS_DIV_4 = "chars_div_4"


class Encoding(Protocol):
    def encode(self, text: str, *, disallowed_special: Any = ...) -> list[int]: ...


def _load_cl100k() -> Encoding:
    import tiktoken  # an optional extra: `pip install memory-sidecar[tokens]`

    encoding: Encoding = tiktoken.get_encoding("cl100k_base")
    return encoding


class TokenCounter:
    """Counts tokens with the best counter available, chosen once."""

    def __init__(self, load: Callable[[], Encoding] = _load_cl100k) -> None:
        self._encoding: Encoding | None
        try:
            self._encoding = load()
            self.name = TIKTOKEN
        except Exception as exc:  # ImportError, or a failed download of the encoding
            log.info("token counts use len(text) // 4: tiktoken unavailable (%s)", exc)
            self._encoding = None
            self.name = CHARS_DIV_4

    def count(self, text: str) -> int:
        if self._encoding is None:
            return len(text) // 4
        # Memory text is data, not a prompt template: special-token look-alikes
        # are counted as plain text rather than refused.
        return len(self._encoding.encode(text, disallowed_special=()))
