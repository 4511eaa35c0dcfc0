"""Schema versions: a tier-less (schema 1) database is migrated losslessly."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.core.errors import StoreError
from sidecar.storage.schema import SCHEMA_VERSION
from sidecar.storage.store import Store
from tests.conftest import MakeSidecar, sqlite_file

# Rows as a schema-1 store held them: one flat table of agent notes, with
# the timestamp formats older writers used, odd content, and duplicates.
LEGACY_ROWS = [
    ("m-1", "coder", "2025-03-01T10:00:00Z", "Project uses pnpm", "tooling"),
    ("m-2", "coder", "2025-03-02T11:30:15.123456789+02:00", "Tests live in spec/", ""),
    ("m-3", "coder", "2025-03-03 09:15:00", "Déploiement: vendredi 🚫", "ops"),
    ("m-4", "writer", "2025-03-04 08:00:00.5 +0000 UTC", "House style: Oxford comma", "style"),
    ("m-5", "", "not a timestamp", "default agent note", ""),
    ("m-6", "coder", "2025-03-05T00:00:00Z", "Project uses pnpm", "dupe"),
    ("m-7", "coder", "2025-03-06T00:00:00Z", "x" * 3000, "long"),
]


def build_schema_1(path: Path) -> None:
    with sqlite_file(path) as conn:
        conn.executescript(
            """
            CREATE TABLE schema_version (version INTEGER NOT NULL);
            INSERT INTO schema_version VALUES (1);
            CREATE TABLE memories (
                id TEXT PRIMARY KEY, agent_id TEXT NOT NULL DEFAULT '',
                created_at TEXT NOT NULL, memory TEXT NOT NULL,
                category TEXT NOT NULL DEFAULT '');
            CREATE INDEX idx_memories_agent ON memories (agent_id);
            """
        )
        conn.executemany("INSERT INTO memories VALUES (?, ?, ?, ?, ?)", LEGACY_ROWS)
    conn.close()


def test_schema_1_rows_all_become_agent_notes(tmp_path: Path, make_sidecar: MakeSidecar) -> None:
    build_schema_1(tmp_path / "memory.db")

    running = make_sidecar()

    assert running.store.schema_version() == SCHEMA_VERSION == 10
    seen: dict[str, pb.Memory] = {}
    owner: dict[str, str] = {}
    for agent in ("coder", "writer", ""):
        listed = running.list(scope=pb.Scope(agent_id=agent, user_id="someone"))
        for memory in listed.memories:
            assert memory.tier == pb.TIER_MEMORY
            seen[memory.id] = memory
            owner[memory.id] = agent
        assert {u.tier: u.entry_count for u in listed.usage}[pb.TIER_USER] == 0
    assert set(seen) == {row[0] for row in LEGACY_ROWS}
    for memory_id, agent, _created, content, category in LEGACY_ROWS:
        memory = seen[memory_id]
        assert owner[memory_id] == agent
        assert (memory.content, memory.category, memory.confidence) == (content, category, 1.0)
        assert memory.created_at == memory.updated_at
    coder = running.list(scope=pb.Scope(agent_id="coder"), tier=pb.TIER_MEMORY)
    assert [m.id for m in coder.memories] == ["m-1", "m-2", "m-3", "m-6", "m-7"]

    def when(memory_id: str) -> datetime:
        return seen[memory_id].created_at.ToDatetime(tzinfo=UTC)

    assert when("m-1") == datetime(2025, 3, 1, 10, 0, tzinfo=UTC)
    assert when("m-2") == datetime(2025, 3, 2, 9, 30, 15, 123456, tzinfo=UTC)
    assert when("m-3") == datetime(2025, 3, 3, 9, 15, tzinfo=UTC)
    assert when("m-4") == datetime(2025, 3, 4, 8, 0, 0, 500000, tzinfo=UTC)
    assert when("m-5").year >= 2026  # unreadable: the migration time, row kept


def test_migrated_tier_over_budget_refuses_growth_but_keeps_everything(
    tmp_path: Path, make_sidecar: MakeSidecar
) -> None:
    build_schema_1(tmp_path / "memory.db")
    running = make_sidecar()
    usage = running.list(scope=pb.Scope(agent_id="coder"), tier=pb.TIER_MEMORY).usage[0]
    assert usage.used_chars > usage.limit_chars
    assert usage.entry_count == 5


def test_migration_is_recorded_and_runs_once(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    build_schema_1(path)
    store = Store(str(path))
    assert store.open() == SCHEMA_VERSION
    store.close()
    store = Store(str(path))
    assert store.open() == SCHEMA_VERSION
    assert store.integrity_check() == "ok"
    store.close()
    with sqlite_file(path) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        # Schema 4 sums each partition once, into its state row.
        assert (
            conn.execute(
                "SELECT owner, content_chars, entry_count FROM tier_state ORDER BY owner"
            ).fetchall()
            == conn.execute(
                "SELECT owner, SUM(content_chars), COUNT(*) FROM memories"
                " GROUP BY owner, tier ORDER BY owner"
            ).fetchall()
        )
        assert conn.execute("SELECT count(*) FROM memories").fetchone() == (len(LEGACY_ROWS),)
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    conn.close()


def test_a_fresh_database_gets_the_current_schema(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "new.db"))
    assert store.open() == SCHEMA_VERSION
    store.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    store = Store(str(path))
    store.open()
    store.close()
    with sqlite_file(path) as conn:
        conn.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(StoreError, match="schema version 99, newer than"):
        Store(str(path)).open()


def test_a_cagent_file_is_not_opened_as_a_store(tmp_path: Path) -> None:
    path = tmp_path / "cagent.db"
    with sqlite_file(path) as conn:
        conn.execute("CREATE TABLE memories (id TEXT PRIMARY KEY, created_at TEXT, memory TEXT)")
    conn.close()
    with pytest.raises(StoreError, match="import-cagent"):
        Store(str(path)).open()


def test_a_file_that_is_not_sqlite_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not a database, just some text " * 100)
    with pytest.raises(StoreError, match="not an SQLite database"):
        Store(str(path)).open()
