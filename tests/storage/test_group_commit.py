"""Group commit (sidecar.storage.group_commit): concurrent adds sharing one
transaction keep each caller's budget check, idempotency and error.

Grouping is forced, never timed: the first write holds its transaction open
(its `still_wanted` waits) until the others have queued behind it, so they
commit together as the next group, which the store's counts then show.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.core.errors import BudgetExceeded, CallerGone, DatabaseIOError
from sidecar.core.memory import Scope, Tier, rendered_chars
from sidecar.storage.store import Store
from sidecar.storage.writes import NewEntry, TierPolicy, Written
from tests.conftest import WAIT_SECONDS, eventually

SCOPE = Scope("agent")
UNLIMITED = TierPolicy(0)
Outcome = Written | Exception


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(str(tmp_path / "m.db"))
    opened.open()
    yield opened
    opened.close()


def _entry(content: str, key: str = "") -> NewEntry:
    return NewEntry(SCOPE, Tier.MEMORY, content, idempotency_key=key)


def _adds(store: Store, contents: list[str]) -> list[Callable[[], Written]]:
    return [functools.partial(store.add, _entry(content), UNLIMITED) for content in contents]


def _grouped(store: Store, writes: list[Callable[[], Written]]) -> list[Outcome]:
    """Run `writes` concurrently as one group: a first add holds the write
    transaction until all of them wait behind it. Their outcomes, in order."""
    held = threading.Event()

    def hold() -> bool:
        held.set()
        eventually(lambda: store.group_commit.waiting() == len(writes), "the writes to queue")
        return True

    opener = threading.Thread(
        target=store.add, args=(_entry("opens the group"), UNLIMITED), kwargs={"still_wanted": hold}
    )
    opener.start()
    assert held.wait(WAIT_SECONDS)
    outcomes: list[Outcome | None] = [None] * len(writes)

    def run(index: int) -> None:
        try:
            outcomes[index] = writes[index]()
        except Exception as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(writes))]
    for thread in threads:
        thread.start()
    for thread in [opener, *threads]:
        thread.join(WAIT_SECONDS)
        assert not thread.is_alive()
    assert store.group_commit.largest == len(writes), "the writes did not commit as one group"
    assert all(outcome is not None for outcome in outcomes)
    return [outcome for outcome in outcomes if outcome is not None]


def _stored(store: Store) -> list[str]:
    memories, _ = store.list_memories(SCOPE, [Tier.MEMORY])
    return [m.content for m in memories if m.content != "opens the group"]


def test_a_lone_write_commits_at_once_in_a_transaction_of_its_own(store: Store) -> None:
    written = store.add(_entry("alone"), UNLIMITED)
    assert written.created
    assert _stored(store) == ["alone"]
    counts = store.group_commit
    assert (counts.commits, counts.writes, counts.largest) == (1, 1, 1)


def test_a_group_keeps_the_budget_exact(tmp_path: Path) -> None:
    # The opener writes to another owner: the tier under test starts empty.
    store = Store(str(tmp_path / "m.db"))
    store.open()
    fits, size = 7, 20
    limit = rendered_chars(fits * size, fits)
    policy = TierPolicy(limit)
    user = Scope("agent", "someone")

    def add(i: int) -> Callable[[], Written]:
        return lambda: store.add(NewEntry(user, Tier.USER, f"{i:02d}".ljust(size, "x")), policy)

    outcomes = _grouped(store, [add(i) for i in range(32)])
    stored = [o for o in outcomes if isinstance(o, Written)]
    refused = [o for o in outcomes if isinstance(o, BudgetExceeded)]
    assert (len(stored), len(refused)) == (fits, 32 - fits)
    usage = store.usage(user, [Tier.USER])[Tier.USER]
    assert (usage.used_chars, usage.entry_count) == (limit, fits)
    # Each write saw the ones before it in the group: usage grew one entry at a time.
    assert sorted(o.usage.entry_count for o in stored) == list(range(1, fits + 1))
    # Every refusal was measured against the group's earlier writes: the tier full.
    assert all(o.used == limit for o in refused)
    store.close()


def test_a_key_retried_within_a_group_returns_the_first_write(store: Store) -> None:
    outcomes = _grouped(
        store, [lambda: store.add(_entry("said once", key="k1"), UNLIMITED) for _ in range(6)]
    )
    assert all(isinstance(o, Written) for o in outcomes)
    written = [o for o in outcomes if isinstance(o, Written)]
    assert len({w.memory.id for w in written}) == 1
    assert sum(w.created for w in written) == 1
    assert _stored(store) == ["said once"]


def test_a_refusal_in_a_group_leaves_the_others_written(store: Store) -> None:
    def add(content: str, wanted: bool = True) -> Callable[[], Written]:
        return lambda: store.add(_entry(content), UNLIMITED, still_wanted=lambda: wanted)

    outcomes = _grouped(store, [add("first"), add("gone", wanted=False), add("third")])
    assert isinstance(outcomes[1], CallerGone)
    assert [o.memory.content for o in outcomes if isinstance(o, Written)] == ["first", "third"]
    assert _stored(store) == ["first", "third"]
    # Generations follow the group's order: each write on top of the one before.
    first, third = outcomes[0], outcomes[2]
    assert isinstance(first, Written)
    assert isinstance(third, Written)
    assert third.previous == first.generation


def test_a_write_failing_otherwise_fails_alone_and_the_others_run_again(store: Store) -> None:
    def broken() -> bool:
        raise RuntimeError("not a refusal")

    outcomes = _grouped(
        store,
        [
            lambda: store.add(_entry("before"), UNLIMITED),
            lambda: store.add(_entry("broken"), UNLIMITED, still_wanted=broken),
            lambda: store.add(_entry("after"), UNLIMITED),
        ],
    )
    assert isinstance(outcomes[1], RuntimeError)
    assert sorted(_stored(store)) == ["after", "before"]
    assert isinstance(outcomes[0], Written)
    assert isinstance(outcomes[2], Written)


def test_a_failed_commit_acknowledges_no_write_of_the_group(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = store.tables.backend
    opened = backend.write_transaction

    @contextlib.contextmanager
    def commit_fails() -> Iterator[Any]:
        with opened() as transaction:
            yield transaction
            if store.group_commit.commits:  # the opener's, first, goes through
                transaction.rollback(False)
                raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(backend, "write_transaction", commit_fails)
    outcomes = _grouped(store, _adds(store, [f"lost {i}" for i in range(4)]))
    assert all(isinstance(o, DatabaseIOError) for o in outcomes)
    assert _stored(store) == []


def test_each_write_is_followed_after_the_commit_in_the_group_order(
    store: Store, tmp_path: Path
) -> None:
    followed: list[tuple[str, bool]] = []

    def visible(content: str) -> bool:
        with contextlib.closing(sqlite3.connect(tmp_path / "m.db")) as other:
            query = "SELECT COUNT(*) FROM memories WHERE content = ?"
            return bool(other.execute(query, (content,)).fetchone()[0])

    def after(written: Written) -> None:
        content = written.memory.content
        followed.append((content, visible(content)))
        if content == "b":
            raise RuntimeError("its cache could not be updated")

    def add(content: str) -> Callable[[], Written]:
        return functools.partial(store.add, _entry(content), UNLIMITED, on_commit=after)

    outcomes = _grouped(store, [add("a"), add("b"), add("c")])
    # Committed (another connection sees it) before any follow-up ran.
    assert followed == [("a", True), ("b", True), ("c", True)]
    assert isinstance(outcomes[1], RuntimeError)
    assert [o.memory.content for o in outcomes if isinstance(o, Written)] == ["a", "c"]


def test_grouping_switched_off_runs_every_write_alone(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "m.db"), group_commit=False)
    store.open()
    done: list[Written] = []
    threads = [
        threading.Thread(target=lambda add=add: done.append(add()))
        for add in _adds(store, [f"n{i}" for i in range(8)])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_SECONDS)
    assert len(done) == 8
    assert store.group_commit.commits == 0
    store.close()


def test_every_commit_is_reported_with_its_writes(tmp_path: Path) -> None:
    sizes: list[int] = []
    store = Store(str(tmp_path / "m.db"), on_group=sizes.append)
    store.open()
    _grouped(store, _adds(store, [f"n{i}" for i in range(5)]))
    assert sizes == [1, 5]
    store.close()


@pytest.mark.contract
def test_only_sqlite_groups(databases: Callable[[str], str], backend: str) -> None:
    # PostgreSQL's writers of different partitions already run at once.
    store = Store(databases("grouping.db"))
    store.open()
    try:
        assert store.group_commit.enabled == (backend == "sqlite")
        assert store.add(_entry("written"), UNLIMITED).created
    finally:
        store.close()


def test_the_next_group_commits_while_one_applies_its_follow_ups_in_order(
    store: Store,
) -> None:
    """The lead passes on once a commit returns; the next group's follow-ups
    still wait for the group's before them, and each caller hears back only
    after its own follow-up ran."""
    followed: list[str] = []
    returned: list[str] = []
    seen_meanwhile: list[tuple[list[str], list[str]]] = []
    leading = threading.Event()

    def queued() -> bool:
        leading.set()
        eventually(lambda: store.group_commit.waiting() == 1, "the next write to queue")
        return True

    def after_first(written: Written) -> None:
        # The next write's transaction commits while this one's follow-up runs.
        eventually(lambda: store.group_commit.commits == 2, "the next group to commit")
        seen_meanwhile.append((list(followed), list(returned)))
        followed.append(written.memory.content)

    def after_next(written: Written) -> None:
        followed.append(written.memory.content)

    def add(content: str, after: Callable[[Written], None], **kwargs: Any) -> None:
        store.add(_entry(content), UNLIMITED, on_commit=after, **kwargs)
        returned.append(content)

    first = threading.Thread(
        target=add, args=("first", after_first), kwargs={"still_wanted": queued}
    )
    first.start()
    assert leading.wait(WAIT_SECONDS)
    following = threading.Thread(target=add, args=("next", after_next))
    following.start()
    for thread in (first, following):
        thread.join(WAIT_SECONDS)
        assert not thread.is_alive()
    # Meanwhile the next write had committed, but neither its follow-up ran
    # nor its caller heard back.
    assert seen_meanwhile == [([], [])]
    assert followed == ["first", "next"]
    assert sorted(returned) == ["first", "next"]
    assert _stored(store) == ["first", "next"]
