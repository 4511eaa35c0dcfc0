"""The `llm` keyword strategy: ask an OpenAI-compatible endpoint for keywords.

The runtime usually owns the model and passes the keywords it extracted; this
client is for runtimes that do not. Any failure (connection, HTTP status,
timeout, a reply without usable keywords) raises KeywordModelError, and
sidecar.domain.queries falls back to the local tokenizer and counts the fallback; after one,
turns skip that endpoint for a Pause (reason "paused").

Owns: the keyword prompt and reply parsing, Pause (the back-off sidecar.domain.queries
and sidecar.retrieval.semantic use), ModelError, and post_json, the one HTTP client (also
sidecar.retrieval.embedding's). Must not touch: the store, configuration (URL, key and
timeout are arguments), metrics. Its errors are not SidecarErrors: callers fall
back. A call blocks its caller on the network for up to timeout_seconds.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.retrieval.keywords import keywords

PROMPT = (
    "Extract the search keywords from the user's message: names, places, dates, "
    "objects and topics that a memory about this conversation would contain. "
    "Reply with the keywords only, comma-separated, at most 12."
)


# A keyword reply is a few hundred bytes; anything this big is not one.
_MAX_REPLY_BYTES = 1024 * 1024
# post_json reads a reply this many bytes at a time.
_CHUNK_BYTES = 64 * 1024


# After a model endpoint fails, calls skip it for a pause that doubles from
# the first to the longest, rather than each waiting out its deadline (an
# endpoint that hangs would otherwise add its whole timeout to every call).
PAUSE_FIRST_SECONDS = 1.0
PAUSE_LONGEST_SECONDS = 60.0


class Pause:
    """How long calls skip an endpoint that failed (see PAUSE_*): the first
    call after it ends tries again, and a success ends it for good."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.seconds = 0.0
        self._until = float("-inf")

    def remaining(self) -> float:
        return max(0.0, self._until - self._clock())

    def failed(self) -> float:
        """Starts or doubles the pause; its length."""
        # Racing failures may each double it: still bounded.
        self.seconds = min(max(2 * self.seconds, PAUSE_FIRST_SECONDS), PAUSE_LONGEST_SECONDS)
        self._until = self._clock() + self.seconds
        return self.seconds

    def succeeded(self) -> bool:
        """Ends the pause; whether there was one."""
        was = self.seconds > 0
        self.seconds, self._until = 0.0, float("-inf")
        return was


class ModelError(Exception):
    """A model endpoint (or a local model) could not answer.

    `reason` is a bounded label for metrics ('timeout', 'unreachable',
    'http_error', 'bad_reply', ...); `detail` is for logs.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class KeywordModelError(ModelError):
    """The model could not give keywords; `reason` is a bounded label."""


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
        try:
            raw = post_json(
                self.base_url,
                "/chat/completions",
                body,
                self.api_key,
                timeout_seconds=self.timeout_seconds,
                max_reply_bytes=_MAX_REPLY_BYTES,
            )
        except ModelError as exc:
            raise KeywordModelError(exc.reason, exc.detail) from None
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError) as exc:
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


def post_json(
    base_url: str,
    suffix: str,
    body: bytes,
    api_key: str,
    *,
    timeout_seconds: float,
    max_reply_bytes: int,
    inspect: Callable[[bytes], None] | None = None,
) -> bytes:
    """POST the JSON `body` to base_url + suffix (with `api_key` as a
    bearer token, if any) and return the reply body, read whole within
    timeout_seconds in all.

    A socket timeout bounds each read, not the call: an endpoint that
    trickles a byte at a time kept a turn waiting 7.5 s with a 1 s
    timeout. A timer shuts the socket down at the deadline, which ends
    whatever read is waiting. Every failure (a bad URL, no connection, the
    deadline, a status other than 200, a reply over max_reply_bytes) is a
    ModelError with a bounded `reason`, so callers can fall back and count
    why. Shared by the keyword model and the embedding endpoint.

    A 200 reply is read a chunk at a time, each handed to `inspect` (if
    given) as it arrives: a ModelError it raises ends the call there, so a
    reply the caller can tell is too big is not read whole.
    """
    timeout = f"no complete reply within {timeout_seconds:g} s"
    deadline = _Deadline(timeout_seconds)
    connection: http.client.HTTPConnection | None = None
    try:
        connection, path = _connection(base_url, suffix, timeout_seconds)
        deadline.start()
        status, data = _exchange(
            connection, deadline, path, body, api_key, max_reply_bytes, inspect
        )
        if deadline.expired:
            raise TimeoutError
    except ModelError:
        raise
    except TimeoutError:
        raise ModelError("timeout", timeout) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # ValueError: a bad port or header value, an unencodable host,
        # or an SSL socket read after the timer shut it down.
        if deadline.expired:
            raise ModelError("timeout", timeout) from None
        reason = "bad_reply" if isinstance(exc, http.client.HTTPException) else "unreachable"
        raise ModelError(reason, str(exc) or type(exc).__name__) from None
    finally:
        deadline.stop()
        if connection is not None:
            connection.close()
    if status != 200:
        raise ModelError("http_error", f"HTTP {status}")
    if len(data) > max_reply_bytes:
        raise ModelError("bad_reply", f"reply over {max_reply_bytes:,} bytes")
    return data


class _Deadline:
    """A call's deadline: a timer that, when it fires before stop(), shuts
    down every socket watched, which ends whatever read is waiting."""

    def __init__(self, seconds: float) -> None:
        self._lock = threading.Lock()
        self.expired = False
        self._done = False
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def start(self) -> None:
        self._timer.start()

    def watch(self, sock: socket.socket | None) -> None:
        """Shut this socket down too at the deadline; TimeoutError if it has
        passed already (while connecting)."""
        with self._lock:
            if sock is not None:
                self._sockets.append(sock)
            if self.expired:
                raise TimeoutError

    def stop(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def _connection(
    base_url: str, suffix: str, timeout_seconds: float
) -> tuple[http.client.HTTPConnection, str]:
    """An unopened connection to base_url's host, and the path to POST to."""
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ModelError("unreachable", f"not an http(s) URL: {base_url}")
    path = parts.path.rstrip("/") + suffix + (f"?{parts.query}" if parts.query else "")
    connection_type = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    return connection_type(parts.hostname, parts.port, timeout=timeout_seconds), path


def _exchange(
    connection: http.client.HTTPConnection,
    deadline: _Deadline,
    path: str,
    body: bytes,
    api_key: str,
    max_reply_bytes: int,
    inspect: Callable[[bytes], None] | None,
) -> tuple[int, bytes]:
    """Connect, POST the body to `path`, and read the reply: its status and
    body (a 200 one handed to `inspect` as it arrives)."""
    connection.connect()
    # The socket, kept: http.client hands it to the response and
    # drops its own reference once the reply headers are in.
    deadline.watch(connection.sock)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    connection.request("POST", path, body=body, headers=headers)
    response = connection.getresponse()
    status = response.status
    with response:
        return status, _read(response, max_reply_bytes, inspect if status == 200 else None)


def _read(
    response: http.client.HTTPResponse,
    max_reply_bytes: int,
    inspect: Callable[[bytes], None] | None,
) -> bytes:
    """The reply body, up to one byte over max_reply_bytes (so a longer one
    shows), a chunk at a time, each handed to `inspect` if given."""
    chunks: list[bytes] = []
    left = max_reply_bytes + 1
    while left > 0:
        chunk = response.read(min(_CHUNK_BYTES, left))
        if not chunk:
            break
        if inspect is not None:
            inspect(chunk)
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
