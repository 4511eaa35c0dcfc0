"""SQLite's WAL checkpoints, run by a thread of their own instead of by the
writer whose commit crosses the threshold.

With SQLite's default (`wal_autocheckpoint` 1000 pages), the connection
whose commit takes the WAL past 1,000 pages copies the WAL back into the
database file and fsyncs it before its COMMIT returns: the write that
happens to cross the line pays for every write before it. Into a tier of
100,000 memories that was a third of the daemon's time per AddMemory and
most of its p99 (bench section 12). Here the store's pooled connections
checkpoint only past a far larger backstop (`BACKSTOP_PAGES`, for when this
thread stalls or dies), and a Checkpointer runs a PASSIVE checkpoint every
`interval` seconds on a connection of its own. PASSIVE never waits for a
reader or a writer, so it never delays one.

The WAL starts over from its beginning when a write begins with every frame
copied. Between bursts of writes the thread's pass is that copy; under a
steady stream of writes it rarely is (the write in flight while the thread
copies adds frames after it), and the WAL grows until the backstop, where a
writer's own checkpoint finds only the frames since the thread's last pass
to copy, and the write after it starts the WAL over: one write in some 250
pays for a short checkpoint, where one in 70 paid for a long one.
`journal_size_limit` truncates the file back to `WAL_FILE_LIMIT` bytes
whenever the WAL starts over.

Owns: Checkpointer (its thread, its connection, its counts), the pragmas
the pooled connections take for it. Must not touch: the pool or its
connections (sidecar.storage._sqlite sets the pragmas when it opens them),
PostgreSQL, anything above the storage layer.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("sidecar.checkpoint")

# Past this many WAL pages a writer checkpoints in its own commit, as
# SQLite does by default at 1,000: the bound on the WAL, reached under a
# steady stream of writes, when the thread stalls or fails, or while a
# reader holds an old snapshot. 16 MiB at SQLite's default 4 KiB pages.
BACKSTOP_PAGES = 4_096
# The WAL file is truncated back to this size whenever the WAL starts over.
WAL_FILE_LIMIT = 16 * 1024 * 1024
# How often the thread checkpoints. A pass with nothing to copy reads the
# WAL index and returns (no I/O), so an idle daemon pays nothing for it.
INTERVAL_SECONDS = 0.25

# The pragmas every pooled writer connection takes (sidecar.storage._sqlite).
PRAGMAS = (("wal_autocheckpoint", BACKSTOP_PAGES), ("journal_size_limit", WAL_FILE_LIMIT))


class Checkpointer:
    """Runs `PRAGMA wal_checkpoint(PASSIVE)` on the SQLite file at `path`
    every `interval` seconds, from `start()` until `stop()`.

    A pass that fails (the disk, a file gone) logs one WARNING line, without
    a traceback, for the first failure in a row, reopens its connection and
    tries again at the next interval: the backstop keeps the WAL bounded
    meanwhile.
    """

    def __init__(self, path: str, *, interval: float = INTERVAL_SECONDS) -> None:
        self._path = path
        self._interval = interval
        self._connection: sqlite3.Connection | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # What the tests read: passes run and failed in all, failures in a
        # row, and the (WAL frames, frames copied) of the last pass.
        self.passes = 0
        self.failures = 0
        self.failing = 0
        self.last: tuple[int, int] = (0, 0)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="sqlite-checkpoint", daemon=True)
        self._thread.start()

    def stop(self, wait: float = 5.0) -> None:
        """End the thread and close its connection (within `wait` seconds)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(wait)
        if thread.is_alive():  # pragma: no cover - a checkpoint stuck on the disk
            log.warning("the WAL checkpoint thread did not stop within %.1f s", wait)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                self.checkpoint()
        finally:
            self._close()

    def checkpoint(self) -> None:
        """One pass (the thread's; a test may run one itself while it is stopped)."""
        try:
            if self._connection is None:
                self._connection = sqlite3.connect(self._path, check_same_thread=False)
            _busy, frames, copied = self._connection.execute(
                "PRAGMA wal_checkpoint(PASSIVE)"
            ).fetchone()
        except (sqlite3.Error, OSError) as exc:
            self.failures += 1
            self.failing += 1
            if self.failing == 1:
                log.warning(
                    "WAL checkpoint of %s failed (%s); retrying every %.2f s",
                    self._path,
                    exc,
                    self._interval,
                )
            self._close()
            return
        if self.failing:
            log.info("WAL checkpoint of %s works again", self._path)
        self.failing = 0
        self.passes += 1
        self.last = (int(frames), int(copied))

    def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
