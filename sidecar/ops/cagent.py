"""Reading a cagent memory.db, for `memory-sidecar import-cagent`.

cagent keeps one agent's notes in `memories(id TEXT PRIMARY KEY, created_at
TEXT, memory TEXT, category TEXT DEFAULT '')`; early versions have no
category column, and some name the table `user_memories`.

Owns: cagent's schema variants and turning their rows into LegacyEntry records.
Must not touch: the sidecar's own database (sidecar.ops.cli imports the entries
through sidecar.storage.store). Its SQL, on cagent's file opened read-only, is the one
sqlite3 use outside the storage layer.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sidecar.core.clock import parse_timestamp, system_clock, to_micros
from sidecar.core.errors import InvalidArgument, Reason
from sidecar.storage.archive import LegacyEntry

_TABLES = ("memories", "user_memories")


def read_entries(path: str | Path) -> tuple[list[LegacyEntry], list[str]]:
    """Entries in the file's insertion order, and warnings about them."""
    if not Path(path).is_file():
        raise InvalidArgument(f"{path}: no such file", reason=Reason.IMPORT_SOURCE_MISSING)
    # Read-only, so a cagent still running against the file is not disturbed.
    conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
    try:
        try:
            tables = {
                row[0]
                for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        except sqlite3.DatabaseError as exc:
            raise InvalidArgument(
                f"{path}: not an SQLite database ({exc})", reason=Reason.IMPORT_SOURCE_INVALID
            ) from None
        table = next((t for t in _TABLES if t in tables), None)
        if table is None:
            raise InvalidArgument(
                f"{path}: no cagent memories table (looked for {', '.join(_TABLES)})",
                reason=Reason.IMPORT_SOURCE_INVALID,
            )
        columns = {row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')}
        missing = {"id", "memory"} - columns
        if missing:
            raise InvalidArgument(
                f"{path}: table {table} lacks column(s) {', '.join(sorted(missing))}",
                reason=Reason.IMPORT_SOURCE_INVALID,
            )
        created = "created_at" if "created_at" in columns else "NULL"
        category = "category" if "category" in columns else "''"
        rows = conn.execute(
            f'SELECT id, {created}, memory, {category} FROM "{table}" ORDER BY rowid'
        ).fetchall()
    finally:
        conn.close()

    now = to_micros(system_clock())
    entries, warnings = [], []
    for memory_id, created_text, content, category_value in rows:
        moment = parse_timestamp(created_text)
        if moment is None:
            warnings.append(
                f"{memory_id}: unreadable created_at {created_text!r}; using the import time"
            )
        entries.append(
            LegacyEntry(
                id=str(memory_id),
                content=(content or "").strip(),
                category=category_value or "",
                created_at_micros=to_micros(moment) if moment else now,
            )
        )
    return entries, warnings
