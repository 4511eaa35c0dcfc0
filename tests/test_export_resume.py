"""ExportMemories resumed from a cursor: every entry committed after the
cursor is in the resumed stream, exactly once, whatever order the seqs of
the scope's tiers committed in.

Seqs are drawn before commit. On PostgreSQL a write to one tier may hold a
seq while a larger seq of the other tier commits and is exported; a cursor of
one seq for the stream then skipped the held entry on resume (issue 34). A
cursor holds one seq per partition instead. Within a partition seqs commit in
order: every insert holds the partition's state row lock until it commits,
so a second writer of the tier (another replica) waits for the first. On
SQLite one writer holds the database at a time, so neither case can occur
there; the interleaved resume below still runs on both backends.

Writes are held deterministically: the daemon's insert is wrapped so that
a chosen content's transaction stops after its row (and seq) is inserted,
until the test lets it commit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.api import paging
from sidecar.core.memory import Scope, Tier
from sidecar.storage.archive import parse_line
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    MakeSidecar,
    Running,
    eventually,
)

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
UNLIMITED = "defaults: {memory_char_limit: 0, user_char_limit: 0}"
# Long enough for a test's failure, never reached when it passes.
SAFETY_SECONDS = WAIT_SECONDS


def export(running: Running, **fields: Any) -> list[pb.ExportMemoriesResponse]:
    request = pb.ExportMemoriesRequest(scope=SCOPE, **fields)
    return list(running.stub.ExportMemories(request, timeout=CALL_SECONDS))


def contents(responses: list[pb.ExportMemoriesResponse]) -> list[str]:
    text = "".join(response.jsonl for response in responses)
    return [parse_line(n, line)[1].content for n, line in enumerate(text.splitlines(), 1)]


def add(running: Running, content: str, tier: pb.Tier) -> pb.AddMemoryResponse:
    request = pb.AddMemoryRequest(scope=SCOPE, content=content, tier=tier)
    response: pb.AddMemoryResponse = running.stub.AddMemory(request, timeout=SAFETY_SECONDS)
    return response


class Held:
    """An AddMemory of `content` on `running`, held after its insert drew
    its seq and before its transaction commits, until `commit()` (or not
    held, with `hold` false: its seq recorded all the same)."""

    def __init__(self, running: Running, content: str, tier: pb.Tier, *, hold: bool = True) -> None:
        tables = running.store.tables
        self._insert = tables.insert
        self._tables = tables
        self.inserted = threading.Event()
        self._release = threading.Event()
        if not hold:
            self._release.set()
        # Every entry's seq as inserted while held, by content.
        self.seqs: dict[str, int] = {}
        self.acked: list[pb.AddMemoryResponse] = []

        def held(*args: Any, **kwargs: Any) -> Any:
            row = self._insert(*args, **kwargs)
            self.seqs[row.content] = row.seq
            if row.content == content:
                self.inserted.set()
                self._release.wait(SAFETY_SECONDS)
            return row

        tables.insert = held  # type: ignore[method-assign]
        self._thread = threading.Thread(
            target=lambda: self.acked.append(add(running, content, tier)), daemon=True
        )
        self._thread.start()
        assert self.inserted.wait(SAFETY_SECONDS), "the held write never inserted its row"

    def commit(self) -> pb.AddMemoryResponse:
        self._release.set()
        self._thread.join(SAFETY_SECONDS)
        assert self.acked, "the held write was never acknowledged"
        return self.acked[0]

    def close(self) -> None:
        self._release.set()
        self._tables.insert = self._insert  # type: ignore[method-assign]


@pytest.fixture
def holds() -> Iterator[list[Held]]:
    made: list[Held] = []
    yield made
    for held in made:
        held.close()


def test_a_write_committed_after_a_larger_seq_of_the_other_tier_is_in_the_resumed_export(
    make_sidecar: MakeSidecar, backend: str, holds: list[Held]
) -> None:
    if backend != "postgresql":
        pytest.skip("SQLite has one writer at a time: a held write holds every other")
    running = make_sidecar(UNLIMITED)
    # The other tier's write on a second replica: in one process the two
    # partitions may share a stripe lock, and the held write would hold it.
    other = make_sidecar(UNLIMITED)
    add(running, "user before", pb.TIER_USER)
    add(running, "memory before", pb.TIER_MEMORY)
    holds.append(Held(running, "user held", pb.TIER_USER))
    added = Held(other, "memory after", pb.TIER_MEMORY, hold=False)
    holds.append(added)
    added.commit()  # committed and acknowledged, with a larger seq
    assert holds[0].seqs["user held"] < added.seqs["memory after"]

    cut = export(running)
    assert contents(cut) == ["user before", "memory before", "memory after"]
    holds[0].commit()

    resumed = export(running, cursor=cut[-1].cursor)
    assert contents(resumed) == ["user held"]
    assert sorted(contents(cut) + contents(resumed)) == sorted(contents(export(running)))


def test_a_second_writer_of_a_tier_waits_for_the_first_so_a_resume_misses_neither(
    make_sidecar: MakeSidecar, backend: str, holds: list[Held]
) -> None:
    if backend != "postgresql":
        pytest.skip("SQLite has one writer at a time: a held write holds every other")
    import psycopg

    a = make_sidecar(UNLIMITED)
    b = make_sidecar(UNLIMITED)  # a replica on the same database
    add(a, "user before", pb.TIER_USER)
    holds.append(Held(a, "user held on a", pb.TIER_USER))
    second: list[pb.AddMemoryResponse] = []
    writer = threading.Thread(
        target=lambda: second.append(add(b, "user on b", pb.TIER_USER)), daemon=True
    )
    writer.start()

    def waiting_for_a_lock() -> bool:
        with psycopg.connect(a.db, autocommit=True) as connection:
            row = connection.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()
        return row is not None and row[0] >= 1

    eventually(waiting_for_a_lock, "b's write waits for the partition's lock a holds")
    cut = export(a)
    assert contents(cut) == ["user before"]
    holds[0].commit()
    writer.join(SAFETY_SECONDS)
    assert second, "b's write was never acknowledged"

    resumed = export(a, cursor=cut[-1].cursor)
    assert contents(resumed) == ["user held on a", "user on b"]


def test_a_resume_after_writes_to_both_tiers_in_any_order_is_exact(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar(UNLIMITED)
    for n in range(6):
        add(running, f"entry {n}", pb.TIER_USER if n % 3 else pb.TIER_MEMORY)
    stream = running.stub.ExportMemories(
        pb.ExportMemoriesRequest(scope=SCOPE, batch_size=2), timeout=CALL_SECONDS
    )
    received = [next(stream), next(stream)]
    stream.cancel()
    for n in range(6, 10):
        add(running, f"entry {n}", pb.TIER_MEMORY if n % 2 else pb.TIER_USER)
    rest = export(running, cursor=received[-1].cursor, batch_size=3)
    got = contents(received) + contents(rest)
    assert len(got) == len(set(got)) == 10
    assert sorted(got) == sorted(contents(export(running)))
    # A single-tier stream's cursor resumes that tier alone.
    users = export(running, tier=pb.TIER_USER, batch_size=1)
    assert contents(users) == contents(export(running, tier=pb.TIER_USER))


def test_a_cursor_of_one_seq_issued_before_is_read_as_that_seq_in_every_tier(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar(UNLIMITED)
    for n in range(4):
        add(running, f"entry {n}", (pb.TIER_USER, pb.TIER_MEMORY)[n % 2])
    pages = paging.PageTokens(running.store.page_token_key())
    scope = Scope(SCOPE.agent_id, SCOPE.user_id)
    partitions = [(scope.owner(tier), tier) for tier in Tier]
    # What a cursor was before it held a seq per partition: the last seq sent.
    memories, _ = running.store.list_memories(scope, tuple(Tier))
    (last,) = [m.seq for m in memories if m.content == "entry 1"]
    old = pages.encode("export", paging.digest("export", partitions), last)
    assert contents(export(running, cursor=old)) == ["entry 2", "entry 3"]
