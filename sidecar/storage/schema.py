"""The schema: the column layout of the tables the store's queries are built
on (the Peewee models, bound per store), the version this code writes, and
bringing a database up to it.

The migrations themselves are the backends' (sidecar.storage._sqlite,
sidecar.storage._postgres); this module reads the version a database is at and runs
the steps newer than it. One of the storage modules, the only code that
touches Peewee (see sidecar.storage.store); it imports none of the others but the
private helpers.

Owns: the Peewee models (_Row, _Key) and their binding to one database,
SCHEMA_VERSION, reading a database's version and migrating it, ANALYZE
after a bulk write. Must not touch: the migrations' SQL (the backends'),
reads or writes of entries (sidecar.storage.store and its neighbours).
"""

from __future__ import annotations

import logging
from typing import TypeVar

import peewee

from sidecar.core.errors import StoreError
from sidecar.storage import _sqlite
from sidecar.storage._backend import SCHEMA_TABLE, Backend

log = logging.getLogger("sidecar.schema")

SCHEMA_VERSION = _sqlite.MIGRATIONS[-1][0]


class _Row(peewee.Model):
    """Column layout of `memories` (schema 2). Bound per store, see _bind."""

    seq = peewee.AutoField()
    memory_id = peewee.TextField(column_name="id", unique=True)
    tier = peewee.TextField()
    owner = peewee.TextField()
    content = peewee.TextField()
    content_chars = peewee.IntegerField()
    content_sha256 = peewee.TextField()
    category = peewee.TextField(default="")
    confidence = peewee.FloatField(default=1.0)
    created_at = peewee.BigIntegerField()
    updated_at = peewee.BigIntegerField()
    # Schema 7: when the entry expires (microseconds), NULL for never.
    expires_at = peewee.BigIntegerField(null=True)
    # Schema 10: the user_id (and the session, when the write named one) of
    # the scope that wrote the entry; NULL for rows written before (an
    # unknown writer, never erased by ForgetUser as written for anyone).
    written_for_user_id = peewee.TextField(null=True)
    written_in_session = peewee.TextField(null=True)


class _Key(peewee.Model):
    """Column layout of `idempotency_keys` (schema 3)."""

    owner = peewee.TextField()
    tier = peewee.TextField()
    key = peewee.TextField()
    memory_id = peewee.TextField()
    content_sha256 = peewee.TextField()
    created_at = peewee.BigIntegerField()

    class Meta:
        primary_key = peewee.CompositeKey("owner", "tier", "key")


M = TypeVar("M", bound=peewee.Model)


def _bind(model: type[M], db: peewee.Database, table: str) -> type[M]:
    # A subclass per store instead of model.bind(db): binding mutates the class,
    # and two stores in one process (tests, the import command) must not share.
    meta = type("Meta", (), {"database": db, "table_name": table})
    return type(model.__name__.lstrip("_"), (model,), {"Meta": meta, "__module__": __name__})


def current_version(backend: Backend) -> int:
    """The schema version of the database (0: an empty one). Call inside a
    connection."""
    tables = backend.table_names()
    if SCHEMA_TABLE not in tables:
        if "memories" in tables:
            raise StoreError(
                f"{backend.location} holds a 'memories' table but no schema version: it looks "
                "like a cagent memory.db; adopt it with `memory-sidecar import-cagent`"
            )
        if tables:
            raise StoreError(
                f"{backend.location} is not a memory-sidecar database (it has tables "
                f"{sorted(tables)})"
            )
        return 0
    row = backend.db.execute_sql(f"SELECT version FROM {SCHEMA_TABLE}").fetchone()
    return int(row[0]) if row else 0


def migrate(backend: Backend) -> int:
    """Run the backend's migrations newer than the database, in one
    transaction only one process at a time runs; return the version now.
    Call inside a connection."""
    db = backend.db
    with backend.migration_transaction():
        current = current_version(backend)
        if current > SCHEMA_VERSION:
            raise StoreError(
                f"{backend.location} has schema version {current}, newer than this "
                f"memory-sidecar understands ({SCHEMA_VERSION}); upgrade memory-sidecar"
            )
        for version, what, step in backend.migrations:
            if version <= current:
                continue
            log.info("migrating %s to schema %d (%s)", backend.location, version, what)
            step(db)
            db.execute_sql(f"UPDATE {SCHEMA_TABLE} SET version = {db.param}", (version,))
            current = version
    return current


def analyze(backend: Backend) -> None:
    """Refresh the query planner's statistics (after a bulk write), in a
    pooled connection of its own."""
    with backend.guard(), backend.db.connection_context():
        backend.analyze()
