"""The `llm` keyword strategy: ask an OpenAI-compatible endpoint for keywords.

The runtime usually owns the model and passes the keywords it extracted; this
client is for runtimes that do not. Any failure (connection, HTTP status,
timeout, a reply without usable keywords) raises KeywordModelError, and the
engine falls back to the local tokenizer and counts the fallback.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from sidecar.keywords import keywords

PROMPT = (
    "Extract the search keywords from the user's message: names, places, dates, "
    "objects and topics that a memory about this conversation would contain. "
    "Reply with the keywords only, comma-separated, at most 12."
)


class KeywordModelError(Exception):
    """The model could not give keywords; `reason` is a bounded label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class KeywordModel:
    base_url: str
    model: str
    api_key: str = field(default="", repr=False)
    timeout_seconds: float = 5.0

    def keywords(self, text: str) -> list[str]:
        """Stemmed keywords for `text`, in the model's order."""
        body = json.dumps(
            {
                "model": self.model,
                "temperature": 0,
                "messages": [
                    {"role": "system", "content": PROMPT},
                    {"role": "user", "content": text},
                ],
            }
        ).encode()
        request = urllib.request.Request(
            self.base_url.rstrip("/") + "/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_seconds) as response:
                reply = json.load(response)
        except urllib.error.HTTPError as exc:
            raise KeywordModelError("http_error", f"HTTP {exc.code}") from None
        except TimeoutError as exc:
            raise KeywordModelError("timeout", str(exc)) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError | socket.timeout):
                raise KeywordModelError("timeout", str(exc.reason)) from None
            raise KeywordModelError("unreachable", str(exc.reason)) from None
        except (OSError, ValueError) as exc:
            raise KeywordModelError("bad_reply", str(exc)) from None
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise KeywordModelError("bad_reply", "no choices[0].message.content") from None
        if not isinstance(content, str):
            raise KeywordModelError("bad_reply", "content is not text")
        found = keywords(re.split(r"[,;\n]", content))
        if not found:
            raise KeywordModelError("empty", "the reply held no usable keywords")
        return found
