"""Crashes and shutdowns of a real daemon process: nothing acknowledged is lost."""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    Daemon,
    eventually,
    spawn_daemon,
)

WRITERS = 6


class Ledger:
    """What the writers asked for and what the daemon acknowledged."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acknowledged: dict[str, str] = {}  # id -> content last confirmed
        self.attempted: dict[str, set[str]] = {}  # id -> contents it may hold
        self.deleting: set[str] = set()  # deletes sent, maybe applied
        self.gone: set[str] = set()  # deletes confirmed
        self.adds: set[str] = set()  # contents sent in adds, maybe stored
        self.acks = 0  # confirmations received


def hammer(
    daemon: Daemon, round_: int, stop: threading.Event, ledger: Ledger
) -> list[threading.Thread]:
    """Writers add, update and delete until stopped or the daemon goes away."""

    def delete(stub: pb_grpc.MemoryServiceStub, scope: pb.Scope, victim: str) -> None:
        with ledger.lock:
            ledger.deleting.add(victim)
        stub.DeleteMemory(pb.DeleteMemoryRequest(scope=scope, id=victim), timeout=CALL_SECONDS)
        with ledger.lock:
            ledger.gone.add(victim)
            ledger.acknowledged.pop(victim, None)

    def writer(n: int) -> None:
        scope = pb.Scope(agent_id=f"agent-{n % 3}", user_id=f"user-{n % 2}")
        with grpc.insecure_channel(daemon.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            mine: list[str] = []
            i = 0
            while not stop.is_set():
                i += 1
                tier = pb.TIER_USER if i % 3 == 0 else pb.TIER_MEMORY
                content = f"round {round_} writer {n} fact {i}"
                try:
                    if i % 7 == 0 and mine:
                        delete(stub, scope, mine.pop(0))
                    elif i % 5 == 0 and mine:
                        target, updated = mine[-1], f"{content} (updated)"
                        with ledger.lock:
                            ledger.attempted[target].add(updated)
                        stub.UpdateMemory(
                            pb.UpdateMemoryRequest(scope=scope, id=target, content=updated),
                            timeout=CALL_SECONDS,
                        )
                        with ledger.lock:
                            ledger.acknowledged[target] = updated
                    else:
                        with ledger.lock:
                            ledger.adds.add(content)
                        added = stub.AddMemory(
                            pb.AddMemoryRequest(scope=scope, tier=tier, content=content),
                            timeout=CALL_SECONDS,
                        )
                        with ledger.lock:
                            ledger.acknowledged[added.memory.id] = content
                            ledger.acks += 1
                            ledger.attempted[added.memory.id] = {content}
                        mine.append(added.memory.id)
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.FAILED_PRECONDITION or not mine:
                        return  # the daemon went away: stop writing
                    try:  # a full tier: make room and go on
                        delete(stub, scope, mine.pop(0))
                    except grpc.RpcError:
                        return

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(WRITERS)]
    for thread in threads:
        thread.start()
    return threads


def wait_for_writes(ledger: Ledger, acks: int) -> None:
    """Until the writers are well into their stream (not a fixed sleep: a
    loaded machine may need longer to get going), then a little more."""
    eventually(lambda: ledger.acks >= acks, f"{acks} writes acknowledged", pause=0.02)
    time.sleep(0.2)


def everything(address: str) -> dict[str, pb.Memory]:
    """Every memory the writers' scopes hold; every tier within its budget."""
    found: dict[str, pb.Memory] = {}
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        for agent in range(3):
            for user in range(2):
                listed = stub.GetMemories(
                    pb.GetMemoriesRequest(
                        scope=pb.Scope(agent_id=f"agent-{agent}", user_id=f"user-{user}")
                    ),
                    timeout=CALL_SECONDS,
                )
                for usage in listed.usage:
                    assert usage.used_chars <= usage.limit_chars
                for memory in listed.memories:
                    found[memory.id] = memory
    return found


def check(found: dict[str, pb.Memory], ledger: Ledger) -> None:
    for memory_id, content in ledger.acknowledged.items():
        if memory_id in ledger.deleting:
            continue  # a delete was in flight: either outcome is right
        assert memory_id in found, f"acknowledged write {content!r} lost"
    for memory_id in ledger.gone:
        assert memory_id not in found, "acknowledged delete undone"
    for memory_id, memory in found.items():
        # Exactly one of the contents asked for: no torn or mixed write. An add
        # in flight at the kill may have landed without its id being known.
        allowed = ledger.attempted.get(memory_id) or ledger.adds
        assert memory.content in allowed, memory.content


@pytest.mark.parametrize("durability", ["normal", "full"])
def test_sigkill_mid_stream_loses_nothing_acknowledged(tmp_path: Path, durability: str) -> None:
    db = tmp_path / "memory.db"
    args = ("--db", str(db), "--listen", "127.0.0.1:0", "--durability", durability)
    ledger = Ledger()  # across rounds: each restart must still hold every round's writes
    daemon = spawn_daemon(*args)
    try:
        for round_ in range(3):
            stop = threading.Event()
            acks_before = ledger.acks
            threads: list[threading.Thread] = []
            try:
                threads = hammer(daemon, round_, stop, ledger)
                wait_for_writes(ledger, acks_before + 30)
                daemon.process.send_signal(signal.SIGKILL)
                daemon.wait()
            finally:
                stop.set()
                for thread in threads:
                    thread.join(WAIT_SECONDS)
                daemon.close()
            assert ledger.acks > acks_before, "no write was acknowledged before the kill"

            # The restart after the crash is checked, then is the next
            # round's victim: a start fewer per round, the same crashes.
            daemon = spawn_daemon(*args)
            check(everything(daemon.api), ledger)
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait() == 0
    finally:
        daemon.close()


def test_sigterm_under_load_drains_and_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "memory.db"
    args = ("--db", str(db), "--listen", "127.0.0.1:0", "--grace-seconds", "10")
    daemon = spawn_daemon(*args)
    stop, ledger = threading.Event(), Ledger()
    threads: list[threading.Thread] = []
    try:
        threads = hammer(daemon, 0, stop, ledger)
        wait_for_writes(ledger, 30)
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait() == 0, "\n".join(daemon.log)
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_SECONDS)
        daemon.close()
    assert ledger.acknowledged
    assert not Path(f"{db}-wal").exists()  # closed cleanly
    restarted = spawn_daemon(*args)
    try:
        check(everything(restarted.api), ledger)
    finally:
        restarted.close()


def grouped_commits(metrics: str) -> float:
    """How many commits of the daemon held more than one add (its metrics)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=CALL_SECONDS) as r:
        text = r.read().decode()
    values = {
        match[0]: float(match[1])
        for match in re.findall(
            r'^memory_db_write_group_size_(count|bucket\{le="1\.0"\}) (\S+)$', text, flags=re.M
        )
    }
    return values.get("count", 0.0) - values.get('bucket{le="1.0"}', 0.0)


def test_sigkill_amid_grouped_commits_loses_nothing_acknowledged(tmp_path: Path) -> None:
    # Adds of many scopes at once share commits (server.group_commit): a
    # kill while groups commit loses no add that was answered, and every
    # tier stays within its budget.
    db = tmp_path / "memory.db"
    args = ("--db", str(db), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0")
    ledger, stop = Ledger(), threading.Event()
    daemon = spawn_daemon(*args)
    threads: list[threading.Thread] = []
    try:
        threads = [adder(daemon, n, stop, ledger) for n in range(GROUPED_WRITERS)]
        eventually(lambda: grouped_commits(daemon.metrics) > 0, "a commit of several adds")
        wait_for_writes(ledger, ledger.acks + 30)
        daemon.process.send_signal(signal.SIGKILL)
        daemon.wait()
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_SECONDS)
        daemon.close()
    assert ledger.acks
    restarted = spawn_daemon(*args)
    try:
        check(everything(restarted.api), ledger)
    finally:
        restarted.close()


GROUPED_WRITERS = 12


def adder(daemon: Daemon, n: int, stop: threading.Event, ledger: Ledger) -> threading.Thread:
    """A writer of adds only, in one of the six scopes `everything` reads."""

    def write() -> None:
        scope = pb.Scope(agent_id=f"agent-{n % 3}", user_id=f"user-{n % 2}")
        tier = pb.TIER_USER if n % 4 == 0 else pb.TIER_MEMORY
        with grpc.insecure_channel(daemon.api) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            i = 0
            while not stop.is_set():
                i += 1
                content = f"grouped writer {n} fact {i}"
                with ledger.lock:
                    ledger.adds.add(content)
                try:
                    added = stub.AddMemory(
                        pb.AddMemoryRequest(scope=scope, tier=tier, content=content),
                        timeout=CALL_SECONDS,
                    )
                except grpc.RpcError:
                    return  # the daemon went away, or the tier is full: stop
                with ledger.lock:
                    ledger.acknowledged[added.memory.id] = content
                    ledger.attempted[added.memory.id] = {content}
                    ledger.acks += 1

    thread = threading.Thread(target=write)
    thread.start()
    return thread
