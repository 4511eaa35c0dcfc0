"""Layer 1, storage: the only code that touches Peewee, SQL or a driver.

The store (CRUD with budgets), its backends (SQLite, PostgreSQL), the schema
and its migrations, the change feeds, and the store's other tables reached
through it: persisted indexes, vectors, expiry, the event log, erasure, and
archives. Above this layer nothing sees a row or a connection.

Importing this package loads no module (see docs/ARCHITECTURE.md).

Owns: nothing but this docstring. Must not touch: any layer above
it (retrieval, config, domain, api, ops).
"""
