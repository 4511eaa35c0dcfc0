"""A stand-in for the OpenAI-compatible HTTP endpoints the daemon calls (a
keyword model's chat completions, an embedding server): a real HTTP server
on a free loopback port, speaking just enough of the protocol. TEI, vLLM
and Ollama cannot run here."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class JsonEndpoint:
    """Answers every POST with answer(body), after `delay` seconds, with
    `status`; with `trickle`, the body arrives a `piece` bytes at a time,
    `trickle` seconds apart."""

    status: int = 200
    delay: float = 0.0
    trickle: float = 0.0
    piece: int = 1
    # Set when the client hung up before the whole reply was sent.
    cut_off: threading.Event = field(default_factory=threading.Event)
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def answer(self, body: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                )
                time.sleep(server.delay)
                payload = server.answer(body)
                try:
                    self.send_response(server.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if not server.trickle:
                        self.wfile.write(payload)
                        return
                    for start in range(0, len(payload), server.piece):
                        self.wfile.write(payload[start : start + server.piece])
                        self.wfile.flush()
                        time.sleep(server.trickle)
                except OSError:
                    server.cut_off.set()

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Serve on `port` (a free one when 0) until the block ends."""
        httpd = ThreadingHTTPServer(("127.0.0.1", self.port), self.handler())
        self.port = httpd.server_address[1]
        # shutdown() waits for the loop to look at its flag, once per poll:
        # at the default 0.5 s that was half a second of every teardown.
        threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()
        try:
            yield
        finally:
            httpd.shutdown()
            httpd.server_close()
