"""A TCP proxy in front of a daemon that cuts a connection on cue, for the
client libraries' retry and resume tests in every language.

The proxy reads the HTTP/2 frames the daemon sends. Armed with "headers", it
cuts the connection at the next HEADERS frame on a stream: the daemon has
answered (a unary write has committed), but the client never hears it, so it
sees UNAVAILABLE and must retry. Armed with "data", it cuts at the next DATA
frame: a server stream (ExportMemories, WatchMemories) breaks in the middle
and the client must resume. The cut frame is never forwarded.

Tests in Python use `CutProxy` directly. Go and TypeScript tests get its two
addresses in the environment (`MEMORY_SIDECAR_CUT_TARGET`: dial this instead
of the daemon; `MEMORY_SIDECAR_CUT_CONTROL`: a line protocol) and arm it over
the control socket: send `arm headers 1\\n` or `arm data 1\\n`, read `ok\\n`;
send `cuts\\n`, read the number of cuts made so far.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

FRAME_HEADER = 9
DATA, HEADERS = 0x0, 0x1
KINDS = {"data": DATA, "headers": HEADERS}


class CutProxy:
    """Forwards 127.0.0.1:<port> to `target`, cutting connections on cue."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host.strip("[]") or "127.0.0.1", int(port))
        self._lock = threading.Lock()
        self._armed: dict[int, int] = {}
        self._cuts = 0
        self._closed = threading.Event()
        self._listener = _listen()
        self._control = _listen()
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.control_address = f"127.0.0.1:{self._control.getsockname()[1]}"
        for accept in (self._accept, self._accept_control):
            threading.Thread(target=accept, daemon=True).start()

    @property
    def cuts(self) -> int:
        with self._lock:
            return self._cuts

    def arm(self, kind: str = "headers", count: int = 1) -> None:
        """Cut at the next `count` frames of `kind` ("headers" or "data")."""
        with self._lock:
            self._armed[KINDS[kind]] = self._armed.get(KINDS[kind], 0) + count

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()

    def environment(self) -> dict[str, str]:
        """What a Go or TypeScript test reads to find the proxy."""
        return {
            "MEMORY_SIDECAR_CUT_TARGET": self.address,
            "MEMORY_SIDECAR_CUT_CONTROL": self.control_address,
        }

    def close(self) -> None:
        self._closed.set()
        for sock in (self._listener, self._control):
            sock.close()

    def _take(self, frame_type: int, stream: int) -> bool:
        """Whether this frame is one to cut at (and count it if so)."""
        if stream == 0:
            return False
        with self._lock:
            if self._armed.get(frame_type, 0) <= 0:
                return False
            self._armed[frame_type] -= 1
            self._cuts += 1
            return True

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            pair = (client, upstream)
            threading.Thread(target=self._pump_up, args=pair, daemon=True).start()
            threading.Thread(target=self._pump_down, args=pair, daemon=True).start()

    def _pump_up(self, client: socket.socket, upstream: socket.socket) -> None:
        """Client to daemon: bytes as they come."""
        try:
            while chunk := client.recv(65536):
                upstream.sendall(chunk)
        except OSError:
            pass
        _close(client, upstream)

    def _pump_down(self, client: socket.socket, upstream: socket.socket) -> None:
        """Daemon to client: whole frames, so a cut falls on a frame boundary."""
        pending = b""
        try:
            while chunk := upstream.recv(65536):
                pending += chunk
                ready, pending = _frames(pending)
                for frame in ready:
                    frame_type = frame[3]
                    stream = struct.unpack(">I", frame[5:9])[0] & 0x7FFFFFFF
                    if self._take(frame_type, stream):
                        raise ConnectionAbortedError("cut on cue")
                    client.sendall(frame)
        except OSError:
            pass
        _close(client, upstream)

    def _accept_control(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._control.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_control, args=(conn,), daemon=True).start()

    def _serve_control(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rw", encoding="ascii", newline="\n") as lines:
            for line in lines:
                words = line.split()
                if words[:1] == ["arm"] and len(words) == 3 and words[1] in KINDS:
                    self.arm(words[1], int(words[2]))
                    lines.write("ok\n")
                elif words == ["disarm"]:
                    self.disarm()
                    lines.write("ok\n")
                elif words == ["cuts"]:
                    lines.write(f"{self.cuts}\n")
                else:
                    lines.write("error: arm headers|data N, disarm, cuts\n")
                lines.flush()


def _frames(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Split off the complete HTTP/2 frames at the start of `buffer`. The
    daemon speaks first with a SETTINGS frame (its preface is a frame)."""
    frames = []
    while len(buffer) >= FRAME_HEADER:
        length = int.from_bytes(buffer[:3], "big")
        if len(buffer) < FRAME_HEADER + length:
            break
        frames.append(buffer[: FRAME_HEADER + length])
        buffer = buffer[FRAME_HEADER + length :]
    return frames, buffer


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


@contextmanager
def cut_proxy(target: str) -> Iterator[CutProxy]:
    """A CutProxy in front of `target`, closed afterwards."""
    proxy = CutProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()
