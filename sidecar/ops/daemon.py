"""`memory-sidecar serve`: open, migrate, serve, and shut down on a signal.

serve() opens the store (creating an SQLite file's directory) and migrates
it, and builds and starts a sidecar.api.server.Sidecar. While the database is
out of reach it binds the listeners meanwhile (health NOT_SERVING, the API
refusing calls with DATABASE_UNAVAILABLE) and tries again
(sidecar.ops.startup); once open it reports SERVING. It then waits for SIGTERM,
SIGINT or `stop`, and stops the server before closing the store.
sidecar.ops.cli also uses setup_logging, and open_store for the offline
commands.

Owns: the process's life: logging set-up, signal handling, the Store built
from the settings (its directory, its pool's size), and the order open,
migrate (listening meanwhile if that waits), serve, stop, close.
Must not touch: parsing or validating settings (it is handed a Config),
request handling, SQL, os.environ.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.config.settings import Config, ServerSettings, is_loopback
from sidecar.core.clock import Clock, system_clock
from sidecar.core.errors import StoreError
from sidecar.ops.startup import wait_for_database
from sidecar.storage.store import Store, is_dsn

if TYPE_CHECKING:
    from sidecar.api.server import Addresses, Sidecar
    from sidecar.core.metrics import Metrics

log = logging.getLogger("sidecar")


# Libraries that log every MCP session and connection at info: only their
# warnings, unless the daemon logs at debug.
_CHATTY = ("mcp", "uvicorn", "httpx2")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if level != "debug":
        for name in _CHATTY:
            logging.getLogger(name).setLevel(logging.WARNING)


def pooled_connections(server: ServerSettings) -> int:
    """The store's pool at most: db_pool_size, or by default one connection
    per RPC worker (and per MCP worker thread: as many again), and a few
    for start-up and tools. On PostgreSQL the change feed's listener takes
    one more."""
    return server.db_pool_size or server.max_workers * (2 if server.mcp_listen else 1) + 4


def open_store(
    config: Config, metrics: Metrics | None = None, clock: Clock = system_clock
) -> Store:
    server = config.server
    if not is_dsn(server.db):
        directory = Path(server.db).parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"cannot create {directory} for the database {server.db}: {exc.strerror or exc}"
            ) from None
    return Store(
        server.db,
        password=server.db_password,
        synchronous=server.durability,
        busy_timeout_ms=server.busy_timeout_ms,
        max_connections=pooled_connections(server),
        pool_idle_seconds=server.db_pool_idle_seconds,
        on_query=metrics.db_query if metrics else None,
        group_commit=server.group_commit,
        on_group=metrics.db_write_group_size.observe if metrics else None,
        expiry_batch=server.expiry_sweep_batch,
        expiry_grace_seconds=server.expiry_grace_seconds,
        clock=clock,
    )


def serve(config: Config, *, stop: threading.Event | None = None) -> int:
    """Run until SIGTERM or SIGINT (or `stop` is set); return the exit code."""
    stop = stop or threading.Event()
    with _signals_set(stop):
        return _serve(config, stop)


@contextlib.contextmanager
def _signals_set(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set `stop`, from a thread of their own.

    Not from a Python handler: Event.set takes a lock, and a second signal
    arriving while the handler holds it (make forwards SIGTERM to its child
    as the group gets it too) deadlocked the main thread for good; and the
    kernel may hand the signal to any thread (gRPC runs many), leaving a
    main thread blocked in a wait unwoken. The interpreter's own C handler
    writes each signal to a wakeup pipe, whatever the thread; the relay
    thread reads it and sets `stop`. (Off the main thread, as in tests that
    run serve on a thread, signals are left alone.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    handlers = {
        signum: signal.signal(signum, lambda signum, frame: None)
        for signum in (signal.SIGTERM, signal.SIGINT)
    }

    def relay() -> None:
        if os.read(read, 1):  # b"": the pipe closed, serve returned
            stop.set()

    relaying = threading.Thread(target=relay, name="signals", daemon=True)
    relaying.start()
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(previous)
        os.close(write)
        relaying.join(5)
        os.close(read)


def _serve(config: Config, stop: threading.Event) -> int:
    # Imported here: the operator commands use setup_logging and open_store
    # and need neither the gRPC server nor the metrics registry.
    from sidecar.api.server import Sidecar
    from sidecar.core.metrics import Metrics

    _bound_descriptors(config.server)
    _warn_insecure(config.server)
    metrics = Metrics()
    store = open_store(config, metrics)
    # Built before the first attempt, since connect() is part of every
    # attempt. Its listeners are bound first of all (answering NOT_SERVING):
    # a port already in use is then refused before any database is created
    # or migrated.
    sidecar = Sidecar(config, store, metrics=metrics)
    found = _listen(sidecar)
    try:
        version = _open_when_ready(config, store, sidecar, found, stop)
        if version is None:
            # An attempt may still be under way on its thread: the store is
            # left to the process's exit rather than closed under it (the
            # stopped feed refuses to start after this).
            sidecar.stop(0)
            log.info("stopped before the database was ready")
            return 0
        addresses = sidecar.ready()
    except BaseException:
        sidecar.stop(0)
        store.close()
        raise
    _log_serving(addresses, store, version)
    stop.wait()
    _shut_down(config, sidecar, store)
    return 0


def _bound_descriptors(server: ServerSettings) -> None:
    """Raise the descriptor limit to the hard one, and say in one line what
    it is and what the HTTP listeners may hold under it."""
    from sidecar.api.bounds import connection_caps, raise_descriptor_limit

    before, after, hard = raise_descriptor_limit()
    how = f"raised from {before}" if after > before else f"not raised; hard limit {hard}"
    caps = connection_caps(server, after)
    log.info(
        "descriptor limit %d (%s); HTTP connections at most mcp=%d metrics=%d",
        after,
        how,
        caps.mcp,
        caps.metrics,
    )


def _warn_insecure(server: ServerSettings) -> None:
    """One warning per listener that insecure leaves open to other hosts."""
    if not server.insecure or server.auth_token_file or server.auth_tokens_file:
        return  # with a token required, insecure changes nothing
    if not is_loopback(server.listen):
        log.warning(
            "insecure: the API on %s is reachable from other hosts and requires no token",
            server.listen,
        )
    if server.mcp_listen and not is_loopback(server.mcp_listen):
        log.warning(
            "insecure: MCP on %s is reachable from other hosts, requires no token and "
            "checks no Host or Origin header (no DNS-rebinding protection)",
            server.mcp_listen,
        )


def _listen(sidecar: Sidecar) -> Addresses:
    """Bind the listeners (NOT_SERVING until ready), or stop them and raise."""
    try:
        return sidecar.listen()
    except BaseException:
        sidecar.stop(0)
        raise


def _open_when_ready(
    config: Config, store: Store, sidecar: Sidecar, found: Addresses, stop: threading.Event
) -> int | None:
    """Open the store and connect, retrying while the database is out of reach.

    Returns the schema version, or None when `stop` came first. While it
    waits, the listeners refuse calls with why (said in the log once).
    """
    said: list[bool] = []
    versions: list[int] = []

    def attempt() -> None:
        # Open and connect (the page key, the change feed) together: either
        # may meet a passing failure (no free slot for the feed's listener,
        # an outage between the two), and both are retried.
        versions.append(store.open())
        sidecar.connect()

    def waiting(why: str) -> None:
        if not said:
            said.append(True)
            log.info(
                "listening api=%s health=%s metrics=%s mcp=%s;"
                " NOT_SERVING until the database is ready",
                found.api,
                found.health or "-",
                found.metrics or "-",
                found.mcp or "-",
            )
        sidecar.gate.wait(why)

    opened = wait_for_database(
        attempt,
        backend=store.backend,
        timeout=config.server.startup_timeout_seconds,
        stop=stop,
        waiting=waiting,
    )
    return versions[-1] if opened else None


def _log_serving(addresses: Addresses, store: Store, version: int) -> None:
    log.info(
        "serving api=%s health=%s metrics=%s mcp=%s db=%s schema=%d",
        addresses.api,
        addresses.health or "-",
        addresses.metrics or "-",
        addresses.mcp or "-",
        store.path,
        version,
    )
    if addresses.mcp:
        # The URL on a line of its own: what an operator pastes into a host.
        log.info(
            "MCP (streamable HTTP) at %s; `memory-sidecar mcp-config --host HOST` prints "
            "an entry for Claude Code, Claude Desktop or Cursor",
            addresses.mcp,
        )


def _shut_down(config: Config, sidecar: Sidecar, store: Store) -> None:
    """Drain the listeners for up to grace_seconds, then close the store."""
    log.info("shutting down: draining for up to %gs", config.server.grace_seconds)
    sidecar.stop()
    store.close()
    log.info("stopped")
