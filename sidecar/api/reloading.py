"""Files re-read while serving, by a watcher thread, never on a call's path.

`auth_token_file`, `auth_tokens_file` and the token files it names are read
at start (an error then stops the daemon) and re-read every
`server.auth_reload_seconds` by one `Watcher` thread, so a rotated
Kubernetes Secret takes effect without a restart. A call only reads the
value last swapped in (one reference, replaced whole): a file whose read
blocks (a FIFO, a hung network mount) or that takes long to parse stalls the
watcher at worst, never a call.

Files are opened without blocking and must be regular files of bounded size
(`read_regular`): a FIFO, device or directory is refused without a read.

Owns: Reloading (the last good value and its log lines), Watcher (the thread)
and read_regular. Must not touch: what the files mean (sidecar.api.access and
sidecar.api.interceptors parse them), grpc, the engine, the store, os.environ.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from sidecar.core.errors import ConfigError

log = logging.getLogger("sidecar.reloading")

T = TypeVar("T")


class Unreadable(Exception):
    """A file that cannot be read, or may not be: the message says why."""


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them.

    Unreadable when it is missing or unreadable, not a regular file (a
    FIFO's open or read would block, a device's may do anything), or
    larger than `limit`. Checked before opening (so a device is never
    opened) and again on the open descriptor (the name may have been
    replaced in between); the open itself does not block (O_NONBLOCK).
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise Unreadable(f"{path} is not a regular file (a FIFO, device or directory?)")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Unreadable(f"{path} is not a regular file (a FIFO, device or directory?)")
            chunks: list[bytes] = []
            size = 0
            while size <= limit:
                chunk = os.read(fd, limit + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        raise Unreadable(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL in the name
        raise Unreadable(f"cannot read {path}: {exc}") from None
    if size > limit:
        raise Unreadable(f"{path} is larger than {limit} bytes")
    return b"".join(chunks)


class Reloading(Generic[T]):
    """A value read from files at start and re-read by `reload`.

    The content is compared, not timestamps: a rewrite in place within the
    filesystem's timestamp granularity changes neither inode nor mtime.
    Once serving, a read that fails (a file missing, unreadable, empty or
    invalid, caught mid-rewrite) keeps the last good value and says so in
    the log once per change; only at start-up is it an error, a
    ConfigError on `key`.
    """

    # How the log names the file and what is kept when a read fails.
    what: ClassVar[str] = "file"
    kept: ClassVar[str] = "value"

    def __init__(self, key: str) -> None:
        # Serialises reloads (the watcher's and a test's); calls never take it.
        self._lock = threading.Lock()
        self._complaint = ""
        value, problem = self._read()
        if value is None or problem:
            raise ConfigError(key, problem)
        self._value: T = value

    def _read(self) -> tuple[T | None, str]:
        """The value (None: keep the last good one) and what is wrong ("": nothing)."""
        raise NotImplementedError

    def _news(self, old: T, new: T) -> str:
        """The log line for a changed value."""
        return f"{self.what} changed"

    @property
    def problems(self) -> int:
        """How many problems the last reload found (0: all well)."""
        return 1 if self._complaint else 0

    def current(self) -> T:
        """The value last read well: one attribute read, no file touched."""
        return self._value

    def reload(self) -> None:
        """Read the files again and swap in the new value, if good."""
        with self._lock:
            try:
                value, problem = self._read()
            except Exception as exc:
                # Nothing a file holds may end the watcher or reach a call.
                value, problem = None, f"cannot use it: {type(exc).__name__}: {exc}"
            if problem and problem != self._complaint:
                log.warning("%s: %s; keeping the last good %s", self.what, problem, self.kept)
            self._complaint = problem
            if value is not None:
                if value != self._value:
                    log.info("%s", self._news(self._value, value))
                self._value = value  # one reference: a call sees the old or the new


class Watcher:
    """Calls `reload` on each file every `interval` seconds, on a thread of its own.

    >>> watcher = Watcher([tokens], interval=1.0)
    >>> watcher.start()
    >>> watcher.stop()
    """

    def __init__(self, files: Sequence[Reloading[Any]], interval: float) -> None:
        self._files = tuple(files)
        self._interval = interval
        self._stopped = threading.Event()
        # A daemon thread: one stuck in a hung mount must not keep the process alive.
        self._thread = threading.Thread(target=self._run, name="auth-reload", daemon=True)

    def run_once(self) -> None:
        for file in self._files:
            file.reload()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self.run_once()
            except Exception:  # reload catches what files cause; this is a bug
                log.exception("reloading auth files failed; trying again")

    @property
    def problems(self) -> int:
        return sum(file.problems for file in self._files)

    def start(self) -> None:
        if self._files:  # nothing to watch without auth files
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread; give up waiting after `timeout` (a read stuck in a hung mount)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the auth file watcher is stuck in a read; leaving it behind")
