"""Waiting for the database at start-up: retry what waiting can mend, fail
at once on what it cannot, and give up at a deadline.

A native sidecar that exits because PostgreSQL is not up yet is restarted
by the kubelet with a growing back-off, and holds the agent container back
all the while. So after a first failed attempt the daemon listens
(health NOT_SERVING, the API refusing calls with DATABASE_UNAVAILABLE: the
`waiting` callback) and tries to open the store again and again, with
capped exponential back-off and jitter, until it is open (SERVING),
SIGTERM comes, or server.startup_timeout_seconds have passed.

What is worth waiting for: a database out of reach or not accepting
connections yet (DATABASE_UNAVAILABLE: refused, timed out, starting up,
too many clients), busy (DATABASE_BUSY: another replica holds the
migration lock), or, on PostgreSQL, a standby refusing writes until a
failover promotes it. Everything else fails at once, in one line: a login
the server refused (DatabaseRefused), a schema newer than this code, a
damaged or read-only SQLite file, bad configuration. An SQLite file is
local: a first attempt that succeeds costs nothing more than before.

Owns: which start-up errors are transient, the back-off, the deadline, and
running each attempt in a thread of its own so a stop is heard at once.
Must not touch: the listeners (sidecar.api.server), signals (sidecar.ops.daemon),
SQL, os.environ.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from sidecar.core.errors import (
    DatabaseBusy,
    DatabaseReadOnly,
    DatabaseRefused,
    DatabaseUnavailable,
    SidecarError,
    Unavailable,
)

log = logging.getLogger("sidecar")

# Errors a later attempt may not meet.
_TRANSIENT = (DatabaseUnavailable, DatabaseBusy)
# How often the main thread looks for a stop while an attempt runs (a
# connect to a host that does not answer lasts up to its connect timeout).
_POLL_SECONDS = 0.05


def transient(exc: BaseException, backend: str) -> bool:
    """Whether waiting may mend the error an attempt to open failed with."""
    if isinstance(exc, DatabaseRefused):
        return False
    if isinstance(exc, _TRANSIENT):
        return True
    # A PostgreSQL standby refuses writes until a failover promotes it; an
    # SQLite file stays read-only until its operator changes it.
    return isinstance(exc, DatabaseReadOnly) and backend == "postgresql"


class Backoff:
    """Capped exponential delays with jitter: replicas that started together
    (a rollout, a node restart) do not knock in step."""

    def __init__(
        self, first: float = 0.25, cap: float = 5.0, rng: random.Random | None = None
    ) -> None:
        self._next = first
        self._cap = cap
        self._rng = rng or random.Random()

    def delay(self) -> float:
        """The next delay: between half and all of the current step."""
        step = self._next
        self._next = min(self._cap, step * 2)
        return step / 2 + self._rng.uniform(0, step / 2)


def _attempt(
    attempt: Callable[[], None], stop: threading.Event
) -> tuple[bool, BaseException | None]:
    """Run attempt() in a thread of its own: whether it ended before stop
    came (if not, it is left behind, a daemon thread, to end with the
    process), and its error if it failed."""
    errors: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            attempt()
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="open-database", daemon=True).start()
    # Signal handlers run on the main thread only between waits: short ones.
    while not done.wait(_POLL_SECONDS):
        if stop.is_set():
            return False, None
    return True, errors[0] if errors else None


def wait_for_database(
    attempt: Callable[[], None],
    *,
    backend: str,
    timeout: float,
    stop: threading.Event,
    waiting: Callable[[str], None] = lambda why: None,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Run attempt() until it succeeds (True) or stop is set (False).

    An error waiting cannot mend is raised at once; a transient one is
    retried after a back-off, told to `waiting` (what the API answers
    meanwhile), until `timeout` seconds have passed (0: never), and then
    raised (UNAVAILABLE) with its reason.
    """
    backoff = backoff or Backoff()
    deadline = clock() + timeout if timeout else None
    while True:
        ended, outcome = _attempt(attempt, stop)
        if not ended:
            return False
        if outcome is None:
            return True
        if not isinstance(outcome, SidecarError) or not transient(outcome, backend):
            raise outcome
        left = None if deadline is None else deadline - clock()
        if left is not None and left <= 0:
            raise Unavailable(
                f"gave up after {timeout:g} s (server.startup_timeout_seconds): {outcome.message}",
                reason=outcome.reason,
            ) from outcome
        delay = backoff.delay() if left is None else min(backoff.delay(), left)
        waiting(outcome.message)
        log.warning(
            "database not ready (%s: %s); trying again in %.1f s",
            outcome.reason,
            outcome.message,
            delay,
        )
        if stop.wait(delay):
            return False
