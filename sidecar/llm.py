"""The `llm` keyword strategy: ask an OpenAI-compatible endpoint for keywords.

The runtime usually owns the model and passes the keywords it extracted; this
client is for runtimes that do not. Any failure (connection, HTTP status,
timeout, a reply without usable keywords) raises KeywordModelError, and the
engine falls back to the local tokenizer and counts the fallback.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field

from sidecar.keywords import keywords

PROMPT = (
    "Extract the search keywords from the user's message: names, places, dates, "
    "objects and topics that a memory about this conversation would contain. "
    "Reply with the keywords only, comma-separated, at most 12."
)


# A keyword reply is a few hundred bytes; anything this big is not one.
_MAX_REPLY_BYTES = 1024 * 1024


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
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        raw = self._post(self.base_url.rstrip("/") + "/chat/completions", body, headers)
        try:
            reply = json.loads(raw)
        except ValueError as exc:
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

    def _post(self, url: str, body: bytes, headers: dict[str, str]) -> bytes:
        """POST and read the whole reply within timeout_seconds in all.

        A socket timeout bounds each read, not the call: an endpoint that
        trickles a byte at a time kept a turn waiting 7.5 s with a 1 s
        timeout. A timer shuts the socket down at the deadline, which ends
        whatever read is waiting.
        """
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise KeywordModelError("unreachable", f"not an http(s) URL: {url}")
        connection_type = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        connection = connection_type(parts.hostname, parts.port, timeout=self.timeout_seconds)
        expired = threading.Event()
        # The socket itself: http.client hands it to the response and drops
        # its own reference once the reply headers are in.
        sockets: list[socket.socket] = []

        def expire() -> None:
            expired.set()
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout_seconds, expire)
        timer.daemon = True
        timer.start()
        try:
            connection.connect()
            if connection.sock is not None:
                sockets.append(connection.sock)
            if expired.is_set():  # the deadline passed while connecting
                raise TimeoutError
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            with response:
                data = response.read(_MAX_REPLY_BYTES + 1)
            if expired.is_set():
                raise TimeoutError
        except TimeoutError:
            raise KeywordModelError(
                "timeout", f"no complete reply within {self.timeout_seconds:g} s"
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set():
                raise KeywordModelError(
                    "timeout", f"no complete reply within {self.timeout_seconds:g} s"
                ) from None
            reason = "unreachable" if isinstance(exc, ConnectionError | OSError) else "bad_reply"
            raise KeywordModelError(reason, str(exc) or type(exc).__name__) from None
        finally:
            timer.cancel()
            connection.close()
        if response.status != 200:
            raise KeywordModelError("http_error", f"HTTP {response.status}")
        if len(data) > _MAX_REPLY_BYTES:
            raise KeywordModelError("bad_reply", f"reply over {_MAX_REPLY_BYTES:,} bytes")
        return data
