"""Storage faults: a full disk, a read-only database, damaged pages, bad paths.
Each gets its own status code and reason, a message a person understands,
and no traceback; nothing acknowledged is lost."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.core.errors import DataLoss
from sidecar.core.memory import Memory, Tier
from sidecar.storage import archive
from sidecar.storage.store import Store
from tests.conftest import MakeSidecar, error_info, run_sidecar

SCOPE = pb.Scope(agent_id="coder", user_id="ada")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB filesystem of its own (tmpfs; needs root): room for the
    schema and a few dozen writes."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def filled(path: Path, count: int) -> None:
    store = Store(str(path))
    store.open()
    now = datetime.now(UTC)
    archive.restore(
        store,
        (
            (
                "coder",
                Memory(str(uuid.uuid4()), Tier.MEMORY, f"fact number {n} " * 8, "", 1.0, now, now),
            )
            for n in range(count)
        ),
    )
    store.close()


def test_a_full_disk_is_storage_full_and_loses_nothing(
    make_sidecar: MakeSidecar, small_disk: Path
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 0}\n", db=str(small_disk / "memory.db"))
    acknowledged = 0
    error: grpc.RpcError | None = None
    while error is None:
        try:
            running.add(f"note {acknowledged}: " + "x" * 2000, scope=SCOPE)
            acknowledged += 1
        except grpc.RpcError as failed:
            error = failed
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert error_info(error).reason == "STORAGE_FULL"
    assert "full" in (error.details() or "")
    assert acknowledged > 10
    # Reads still work, and every acknowledged write is there.
    listed = running.list(scope=SCOPE, tier=pb.TIER_MEMORY)
    assert listed.usage[0].entry_count == acknowledged


def test_a_read_only_database_refuses_to_start_with_one_line(
    small_disk: Path, tmp_path: Path
) -> None:
    db = small_disk / "memory.db"
    filled(db, 3)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    result = run_sidecar("serve", "--db", str(db), "--listen", "127.0.0.1:0")
    assert result.returncode != 0
    assert "DATABASE_READ_ONLY: " in result.stderr, result.stderr
    assert "cannot be written" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def damage(path: Path) -> None:
    """Overwrite a page in the middle of the file with garbage."""
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2 // 4096 * 4096)
        handle.write(os.urandom(4096))


def test_damaged_pages_are_data_loss_before_serving(tmp_path: Path) -> None:
    db = tmp_path / "memory.db"
    filled(db, 2000)
    damage(db)
    with pytest.raises(DataLoss) as caught:
        Store(str(db)).open()
    assert caught.value.reason == "DATABASE_CORRUPT"
    result = run_sidecar("serve", "--db", str(db), "--listen", "127.0.0.1:0")
    assert result.returncode != 0
    assert "DATABASE_CORRUPT: " in result.stderr, result.stderr
    assert "is damaged" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    checked = run_sidecar("check", "--db", str(db))
    assert checked.returncode == 1
    assert "Traceback" not in checked.stderr + checked.stdout
    assert "integrity" in checked.stdout or "damaged" in checked.stderr


@pytest.mark.parametrize("where", ["a file as a directory", "not a database"])
def test_a_bad_database_path_is_one_line(tmp_path: Path, where: str) -> None:
    afile = tmp_path / "plain.txt"
    afile.write_text("hello, I am not a database " * 100)
    db = afile / "memory.db" if where == "a file as a directory" else afile
    result = run_sidecar("serve", "--db", str(db), "--listen", "127.0.0.1:0")
    assert result.returncode != 0
    # One line of error; INFO lines of the start before it (the token
    # counter chosen as the daemon is built) are not errors.
    lines = [line for line in result.stderr.splitlines() if " INFO " not in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("memory-sidecar: "), result.stderr
    assert "Traceback" not in result.stderr
