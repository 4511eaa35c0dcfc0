"""A throwaway PostgreSQL cluster for one test session.

initdb into a temporary directory, served on a Unix socket in that directory
only (no TCP port, unless one is asked for), with durability off (a test cluster is never kept). As
root, the server runs as the `postgres` user, since PostgreSQL refuses to run
as root. Each test gets databases of its own.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from tests.waits import START_SECONDS


def bindir() -> Path | None:
    """Where initdb and pg_ctl live (Debian keeps them off PATH)."""
    config = shutil.which("pg_config")
    if config:
        found = Path(
            subprocess.run([config, "--bindir"], capture_output=True, text=True).stdout.strip()
        )
        if (found / "initdb").exists():
            return found
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
    if versions:
        return versions[0].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


# What a throwaway cluster can skip: every commit waiting for the disk.
_NOT_DURABLE = ("fsync", "synchronous_commit", "full_page_writes")


class Cluster:
    def __init__(
        self, bin_dir: Path, *, durable: bool = False, port: int = 0, max_connections: int = 300
    ) -> None:
        self._bin = bin_dir
        # Also listen on 127.0.0.1:port (the superuser trusted), when given.
        self.port = port
        # Low for tests of what happens when the server runs out of slots.
        self._max_connections = max_connections
        # Tests run without fsync; `make bench` with PostgreSQL's defaults.
        self._durable = durable
        self.root = Path(tempfile.mkdtemp(prefix="memory-sidecar-pg-"))
        self.data = self.root / "data"
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = "postgres"
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._names = itertools.count(1)
        # Emptied databases new_database hands out again (see recycle).
        self._spare: list[str] = []

    def _run(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        command = list(args)
        if self._user:
            command = ["runuser", "-u", self._user, "--", *command]
        return subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=START_SECONDS
        )

    def start(self) -> None:
        if not self.data.exists():
            self.init()
        self.serve()

    def init(self) -> None:
        """initdb, without starting the server (serve() does)."""
        self._run(
            [
                str(self._bin / "initdb"),
                "-D",
                str(self.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale",
                "C",
            ]
        )
        # The superuser connects without a password; every other role must
        # give one, so tests can check that passwords reach the server.
        (self.data / "pg_hba.conf").write_text(
            "local all postgres trust\nlocal all all scram-sha-256\n"
            + ("host all postgres 127.0.0.1/32 trust\n" if self.port else "")
        )

    def serve(self) -> None:
        options = " ".join(
            [
                f"-c listen_addresses='{'127.0.0.1' if self.port else ''}'",
                *([f"-p {self.port}"] if self.port else []),
                f"-k {self.root}",
                f"-c max_connections={self._max_connections}",
            ]
            + ([] if self._durable else [f"-c {off}=off" for off in _NOT_DURABLE])
        )
        self._run(
            [
                str(self._bin / "pg_ctl"),
                "-D",
                str(self.data),
                "-o",
                options,
                "-l",
                str(self.root / "server.log"),
                "-w",
                # pg_ctl's own wait is a minute unless told.
                *("-t", str(int(START_SECONDS))),
                "start",
            ]
        )

    def stop(self) -> None:
        try:
            self._run([str(self._bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def tcp_dsn(self, database: str = "postgres") -> str:
        """The superuser's DSN over TCP (a cluster made with a port)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def dsn(self, database: str = "postgres", user: str = "postgres") -> str:
        host = urllib.parse.quote(str(self.root), safe="")
        port = f"&port={self.port}" if self.port else ""
        return f"postgresql://{user}@/{database}?host={host}{port}"

    def sql(self, statement: str, database: str = "postgres") -> list[tuple[object, ...]]:
        """Run one statement as the superuser; its rows."""
        import psycopg

        with psycopg.connect(self.dsn(database), autocommit=True) as connection:
            cursor = connection.execute(statement)
            return list(cursor.fetchall()) if cursor.description else []

    def new_database(self) -> str:
        """A fresh, empty database (or an emptied one, see recycle); its DSN."""
        if self._spare:
            return self.dsn(self._spare.pop())
        name = f"test_{next(self._names)}"
        self.sql(f"CREATE DATABASE {name}")
        return self.dsn(name)

    def owned_database(self, password: str) -> tuple[str, str, str]:
        """A fresh database owned by an ordinary role that logs in with this
        password (no reserved slots, no superuser rights): (DSN, database, role)."""
        name = urllib.parse.urlsplit(self.new_database()).path.lstrip("/")
        role = f"{name}_owner"
        self.sql(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        self.sql(f"ALTER DATABASE {name} OWNER TO {role}")
        self.sql(f"GRANT ALL ON SCHEMA public TO {role}", name)
        return self.dsn(name, user=role), name, role

    def recycle(self, dsn: str) -> None:
        """Empty a database a test is done with, for new_database to hand out
        again: as new as CREATE DATABASE makes it, for a tenth of the server's
        CPU (~10 ms, not ~0.1 s: a PostgreSQL test's largest cost). A
        database a test changed beyond its public schema (its owner,
        settings, grants, connection limit or other schemas) is left alone,
        never reused."""
        name = urllib.parse.urlsplit(dsn).path.lstrip("/")
        if not name.startswith("test_"):
            return
        import psycopg

        # One connection for all of it: a connection costs the server as
        # much as the rest.
        with psycopg.connect(self.dsn(name), autocommit=True) as connection:
            connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            row = connection.execute(
                "SELECT d.datdba = 'postgres'::regrole AND d.datacl IS NULL"
                " AND d.datconnlimit = -1 AND d.datallowconn"
                " AND NOT EXISTS (SELECT 1 FROM pg_db_role_setting s"
                " WHERE s.setdatabase = d.oid)"
                " AND NOT EXISTS (SELECT 1 FROM pg_event_trigger)"
                " AND NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname NOT IN"
                " ('public', 'pg_catalog', 'information_schema', 'pg_toast')"
                " AND nspname NOT LIKE 'pg\\_temp\\_%'"
                " AND nspname NOT LIKE 'pg\\_toast\\_temp\\_%')"
                " FROM pg_database d WHERE d.datname = current_database()"
            ).fetchone()
            if not (row and row[0]):
                return
            # What initdb's template holds in PostgreSQL 15: public owned by
            # pg_database_owner, usable (not writable) by everyone.
            connection.execute(
                "DROP SCHEMA public CASCADE; CREATE SCHEMA public AUTHORIZATION pg_database_owner;"
                " GRANT USAGE ON SCHEMA public TO PUBLIC;"
                " COMMENT ON SCHEMA public IS 'standard public schema'"
            )
        self._spare.append(name)
