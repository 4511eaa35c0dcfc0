"""The operator CLI: online commands against a daemon, offline ones on the file."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.ops import cli
from tests.conftest import (
    START_SECONDS,
    MakeSidecar,
    Running,
    sqlite_file,
)

SCOPE = pb.Scope(agent_id="coder", user_id="ada")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args), environ={})
    out, err = capsys.readouterr()
    return code, out, err


def online(running: Running) -> list[str]:
    return ["--address", running.addresses.api, "--agent-id", "coder", "--user-id", "ada"]


def test_add_list_search_update_rm_usage(
    sidecar: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    scope = online(sidecar)
    code, out, _ = run(capsys, "add", "The repo uses uv", "--category", "tooling", *scope)
    assert code == 0
    assert "The repo uses uv" in out
    assert out.splitlines()[0].split() == ["ID", "TIER", "CATEGORY", "CONF", "UPDATED", "CONTENT"]
    code, out, _ = run(capsys, "add", "Ada likes tea", "--tier", "user", "--json", *scope)
    fact = json.loads(out)
    assert fact["memory"]["tier"] == "TIER_USER"
    assert fact["created"] is True

    code, out, _ = run(capsys, "list", "--json", *scope)
    listed = json.loads(out)
    assert [m["content"] for m in listed["memories"]] == ["The repo uses uv", "Ada likes tea"]
    code, out, _ = run(capsys, "list", "--tier", "user", *scope)
    assert "Ada likes tea" in out
    assert "The repo uses uv" not in out

    code, out, _ = run(capsys, "search", "which repo tool", *scope)
    assert code == 0
    assert out.splitlines()[2].split()[0] == "1.000"
    assert "The repo uses uv" in out

    memory_id = fact["memory"]["id"]
    code, out, _ = run(capsys, "update", memory_id, "--content", "Ada likes green tea", *scope)
    assert code == 0
    assert "Ada likes green tea" in out

    code, out, _ = run(capsys, "usage", *scope)
    rows = [line.split() for line in out.splitlines()[2:]]
    assert rows == [
        ["memory", "16", "2,200", "0%", "1", "yes"],
        ["user", "19", "1,375", "1%", "1", "yes"],
    ]

    code, out, _ = run(capsys, "rm", memory_id, *scope)
    assert code == 0
    assert "removed:" in out
    assert [m.content for m in sidecar.list(scope=SCOPE).memories] == ["The repo uses uv"]


def test_inject_shows_both_blocks_and_leaves_no_session(
    make_sidecar: MakeSidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 0, max_injection_tokens: 55}")
    # 50 tokens of the 55 go to the most confident note in the frozen block...
    running.add("Release notes live in docs/ " + "r" * 172, scope=SCOPE, confidence=0.9)
    # ...so this one is left for the turn block.
    running.add("Deploys go through ops/deploy.sh", scope=SCOPE, confidence=0.5)
    running.add("Ada prefers short answers", scope=SCOPE, tier=pb.TIER_USER)
    code, out, _ = run(capsys, "inject", "how do deploys work?", *online(running))
    assert code == 0
    assert "── system_block" in out
    assert "USER PROFILE (who the user is)" in out
    assert "── turn_context" in out
    assert "Release notes" in out.split("── turn_context")[0]
    assert "ops/deploy.sh</memory>" in out.split("── turn_context")[1]
    assert running.sidecar.engine.stats().sessions == 0

    code, out, _ = run(capsys, "inject", "deploys", "--json", *online(running))
    turn = json.loads(out)
    assert "system_block" in turn
    assert "turn_context" in turn


def test_errors_are_clear_and_exit_non_zero(
    sidecar: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "rm", "no-such-id", *online(sidecar))
    assert code == 1
    assert "DeleteMemory failed: NOT_FOUND (MEMORY_NOT_FOUND): no memory with id" in err
    code, _, err = run(capsys, "add", "x" * 3000, *online(sidecar))
    assert code == 1
    assert "ENTRY_TOO_LARGE" in err
    assert "removing entries cannot make room" in err
    code, _, err = run(capsys, "list", "--address", "127.0.0.1:1", "--timeout", "2")
    assert code == 1
    assert "cannot reach memory-sidecar at 127.0.0.1:1" in err


def test_backup_is_consistent_while_the_daemon_writes(
    sidecar: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for n in range(50):
        sidecar.add(f"early fact {n} " + "padding " * 20, scope=pb.Scope(agent_id=f"a{n}"))
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            sidecar.add(f"late fact {n}", scope=pb.Scope(agent_id="busy"))
            n += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        copy = tmp_path / "backup.db"
        code, out, _ = run(capsys, "backup", str(copy), "--db", str(sidecar.db_path))
    finally:
        stop.set()
        writer.join()
    assert code == 0
    assert "integrity ok" in out
    with sqlite_file(copy) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        early = conn.execute("SELECT count(*) FROM memories WHERE content LIKE 'early%'")
        assert early.fetchone() == (50,)
    conn.close()
    code, _, err = run(capsys, "backup", str(copy), "--db", str(sidecar.db_path))
    assert code == 1
    assert "exists" in err


def test_export_import_round_trips_everything(
    sidecar: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sidecar.add("note with ünïcödé and\nnewline", scope=SCOPE, category="c1", confidence=0.25)
    sidecar.add("profile fact", scope=SCOPE, tier=pb.TIER_USER)
    other = sidecar.add("another agent", scope=pb.Scope(agent_id="writer")).memory
    sidecar.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=pb.Scope(agent_id="writer"), id=other.id, category="edited")
    )
    dump = tmp_path / "dump.jsonl"
    code, out, _ = run(capsys, "export", str(dump), "--db", str(sidecar.db_path))
    assert code == 0
    assert "exported 3 memories" in out

    fresh = tmp_path / "fresh.db"
    code, out, _ = run(capsys, "import", str(dump), "--db", str(fresh))
    assert code == 0
    assert "imported 3 of 3" in out
    again = tmp_path / "again.jsonl"
    run(capsys, "export", str(again), "--db", str(fresh))
    assert again.read_text() == dump.read_text()

    code, out, _ = run(capsys, "import", str(dump), "--db", str(fresh))
    assert "imported 0 of 3" in out
    assert "skipped 3" in out


def test_import_refuses_a_bad_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = {
        "id": "a",
        "tier": "memory",
        "owner": "x",
        "content": "fine",
        "category": "",
        "confidence": 1.0,
        "created_at": "2026-01-01T00:00:00.000000Z",
        "updated_at": "2026-01-01T00:00:00.000000Z",
    }
    bad = {**good, "id": "b", "confidence": 7}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    db = tmp_path / "m.db"
    code, _, err = run(capsys, "import", str(source), "--db", str(db))
    assert code == 1
    assert "line 2: confidence must be between 0 and 1" in err
    code, out, _ = run(capsys, "check", "--json", "--db", str(db))
    assert json.loads(out)["entries"] == []


def test_check_reports_schema_and_integrity(
    sidecar: Running, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sidecar.add("one", scope=SCOPE)
    sidecar.add("two", scope=SCOPE, tier=pb.TIER_USER)
    code, out, _ = run(capsys, "check", "--db", str(sidecar.db_path))
    assert code == 0
    assert "integrity  ok" in out
    assert "entries    2 in 2 tier(s) of 2 owner(s)" in out
    code, _, err = run(capsys, "check", "--db", str(tmp_path / "missing.db"))
    assert code == 1
    assert "no database at" in err
    assert not (tmp_path / "missing.db").exists()


def test_long_commands_show_progress_on_a_terminal(sidecar: Running, tmp_path: Path) -> None:
    for n in range(30):
        sidecar.add(f"fact {n} " + "words " * 50, scope=pb.Scope(agent_id=f"a{n}"))
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "backup",
            str(tmp_path / "b.db"),
            "--db",
            str(sidecar.db_path),
        ],
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
    )
    os.close(follower)
    out, _ = process.communicate(timeout=START_SECONDS)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    terminal = b"".join(chunks).decode()
    assert process.returncode == 0
    assert "backing up (pages):" in terminal
    assert "(100%)" in terminal
    assert "backed up" in out


def test_every_option_has_help() -> None:
    import argparse

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help and action.dest != "help":
                missing.append(f"{path}: {action.option_strings or action.dest}")

    walk(cli._parser(), "memory-sidecar")
    assert missing == []


def test_json_numbers_are_numbers(sidecar: Running, capsys: pytest.CaptureFixture[str]) -> None:
    sidecar.add("The repo uses uv", scope=SCOPE)
    code, out, _ = run(capsys, "inject", "uv?", "--json", *online(sidecar))
    assert code == 0
    shown = json.loads(out)
    assert isinstance(shown["snapshot_generation"], int)
    assert shown["snapshot_generation"] > 0


def test_update_without_fields_and_ids_without_a_scope_say_what_is_missing(
    sidecar: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    memory = sidecar.add("The repo uses uv", scope=SCOPE).memory
    code, _, err = run(capsys, "update", memory.id, *online(sidecar))
    assert code != 0
    assert "needs --content, --category or --confidence" in err
    unscoped = ["--address", sidecar.addresses.api]
    for command in (["rm", memory.id], ["update", memory.id, "--content", "x"]):
        code, _, err = run(capsys, *command, *unscoped)
        assert code != 0
        assert "--agent-id" in err, err
        assert "Traceback" not in err


def test_piped_tables_keep_whole_content_and_wide_characters_align(
    sidecar: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    from sidecar.ops.console import width

    long = "word " * 60 + "end"
    sidecar.add(long, scope=SCOPE)
    sidecar.add("東京の会議は火曜日", scope=SCOPE, category="会議")  # a wide category
    code, out, _ = run(capsys, "list", "--tier", "memory", *online(sidecar))
    assert code == 0
    assert long in out  # nothing cut when the output is not a terminal
    lines = [line for line in out.splitlines() if line.strip()]
    header = lines[0]
    content_column = width(header[: header.index("CONTENT")])
    row = next(line for line in lines if "東京" in line)
    assert width(row[: row.index("東京")]) == content_column
    assert width("東京") == 4
