"""`memory-sidecar import-cagent`: adopt a cagent memory.db into agent notes."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.core.memory import Tier
from sidecar.ops import cli
from sidecar.storage.store import Store
from tests.conftest import MakeSidecar, run_sidecar, sqlite_file

CAGENT_ROWS = [
    ("0b1c", "2025-06-01T08:00:00Z", "User's shell is fish", "environment"),
    ("1d2e", "2025-06-02T09:00:00.25+01:00", "Run tests with `just test`", "workflow"),
    ("2f3a", "2025-06-03T10:00:00Z", "L" * 150, "too-big"),
    ("3b4c", "2025-06-04T11:00:00Z", "Never push to main directly", ""),
    ("4c5d", "2025-06-05T12:00:00Z", "   ", ""),
]


def make_cagent_db(path: Path, *, with_category: bool = True) -> Path:
    with sqlite_file(path) as conn:
        if with_category:
            conn.execute(
                "CREATE TABLE memories (id TEXT PRIMARY KEY, created_at TEXT, memory TEXT,"
                " category TEXT DEFAULT '')"
            )
            conn.executemany("INSERT INTO memories VALUES (?, ?, ?, ?)", CAGENT_ROWS)
        else:
            conn.execute(
                "CREATE TABLE memories (id TEXT PRIMARY KEY, created_at TEXT, memory TEXT)"
            )
            conn.executemany("INSERT INTO memories VALUES (?, ?, ?)", [r[:3] for r in CAGENT_ROWS])
    conn.close()
    return path


def run_import(*args: str) -> tuple[int, str, str]:
    """The console command as an operator runs it, in a process of its own."""
    result = run_sidecar("import-cagent", *args)
    return result.returncode, result.stdout, result.stderr


def test_import_keeps_ids_times_categories_and_lists_what_does_not_fit(
    tmp_path: Path, make_sidecar: MakeSidecar
) -> None:
    source = make_cagent_db(tmp_path / "cagent.db")
    config = tmp_path / "config.yaml"
    config.write_text("agents: {coder: {memory_char_limit: 120}}\n")
    db = tmp_path / "memory.db"

    code, out, err = run_import(
        str(source), "--agent-id", "coder", "--db", str(db), "--config", str(config)
    )

    assert code == 0, err
    assert "imported 3 of 5 entries into the agent notes of 'coder'" in out
    assert "2f3a: does not fit: needs 153 chars" in out
    assert "4c5d: empty content" in out
    running = make_sidecar(config.read_text())
    listed = running.list(scope=pb.Scope(agent_id="coder"))
    assert [(m.id, m.content, m.category, m.tier) for m in listed.memories] == [
        ("0b1c", "User's shell is fish", "environment", pb.TIER_MEMORY),
        ("1d2e", "Run tests with `just test`", "workflow", pb.TIER_MEMORY),
        ("3b4c", "Never push to main directly", "", pb.TIER_MEMORY),
    ]
    created = [m.created_at.ToDatetime(tzinfo=UTC) for m in listed.memories]
    assert created == [
        datetime(2025, 6, 1, 8, 0, tzinfo=UTC),
        datetime(2025, 6, 2, 8, 0, 0, 250000, tzinfo=UTC),
        datetime(2025, 6, 4, 11, 0, tzinfo=UTC),
    ]
    # Nobody else sees them.
    assert list(running.list(scope=pb.Scope(agent_id="other")).memories) == []


def test_import_twice_adds_nothing_new(tmp_path: Path) -> None:
    source = make_cagent_db(tmp_path / "cagent.db", with_category=False)
    db = str(tmp_path / "memory.db")
    args = (str(source), "--agent-id", "coder", "--db", db)

    assert cli.main(["import-cagent", *args], environ={}) == 0
    code, out, _ = run_import(*args)

    assert code == 0
    assert "imported 0 of 5 entries" in out
    assert out.count("id already present") == 4


def test_import_of_a_missing_or_foreign_file_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "memory.db")
    code = cli.main(
        ["import-cagent", str(tmp_path / "nope.db"), "--agent-id", "a", "--db", db], environ={}
    )
    assert code == 1
    assert "nope.db: no such file" in capsys.readouterr().err

    other = tmp_path / "other.db"
    with sqlite_file(other) as conn:
        conn.execute("CREATE TABLE notes (x TEXT)")
    conn.close()
    code = cli.main(["import-cagent", str(other), "--agent-id", "a", "--db", db], environ={})
    assert code == 1
    assert "no cagent memories table" in capsys.readouterr().err


def test_import_indexes_the_agent_notes_when_they_are_held_compactly(tmp_path: Path) -> None:
    source = make_cagent_db(tmp_path / "cagent.db")
    config = tmp_path / "config.yaml"
    config.write_text("defaults: {memory_char_limit: 0}\nserver: {compact_tier_entries: 3}\n")
    db = tmp_path / "memory.db"

    code, out, err = run_import(
        str(source), "--agent-id", "coder", "--db", str(db), "--config", str(config)
    )

    assert code == 0, err
    assert "indexed: memory tier of 'coder', 4 memories" in out
    store = Store(str(db))
    store.open()
    try:
        assert store.indexes.source(Tier.MEMORY, "coder").indexed > 0
    finally:
        store.close()
