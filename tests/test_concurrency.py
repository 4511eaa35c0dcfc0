"""Many writers and readers at once: budgets hold, nothing is lost, nothing locks up."""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import (
    CALL_SECONDS,
    WAIT_SECONDS,
    MakeSidecar,
)

pytestmark = pytest.mark.contract

SCOPES = [pb.Scope(agent_id=f"agent-{i}", user_id=f"user-{i % 2}") for i in range(3)]
BUDGETS = {pb.TIER_MEMORY: 400, pb.TIER_USER: 250}
EXPECTED = {"OK", "FAILED_PRECONDITION"}  # budget refusals are part of the game
ENOUGH = 100  # calls through before the load may stop


def test_mixed_load_keeps_every_invariant(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(
        "defaults: {memory_char_limit: 400, user_char_limit: 250}", max_workers=12
    )
    stub = running.stub
    codes: Counter[str] = Counter()
    problems: list[str] = []
    lock = threading.Lock()
    # At least 3 s of load, and on until enough calls went through: a loaded
    # machine gets longer, never a failure for being slow (within the bound).
    started = time.monotonic()

    def loading() -> bool:
        elapsed = time.monotonic() - started
        with lock:
            done = codes["OK"]
        return elapsed < 3.0 or (done <= ENOUGH and elapsed < WAIT_SECONDS)

    def note(code: str, problem: str | None = None) -> None:
        with lock:
            codes[code] += 1
            if problem:
                problems.append(problem)

    def writer(n: int) -> None:
        scope = SCOPES[n % len(SCOPES)]
        tier = pb.TIER_USER if n % 2 else pb.TIER_MEMORY
        session = f"writer-{n}"
        own: str | None = None
        version = 0
        while loading():
            version += 1
            content = f"w{n} v{version}"
            try:
                if own is None:
                    response = stub.AddMemory(
                        pb.AddMemoryRequest(scope=scope, tier=tier, content=content),
                        timeout=CALL_SECONDS,
                    )
                    own = response.memory.id
                elif version % 4 == 0:
                    response = stub.DeleteMemory(
                        pb.DeleteMemoryRequest(scope=scope, id=own), timeout=CALL_SECONDS
                    )
                    own = None
                    content = ""
                else:
                    response = stub.UpdateMemory(
                        pb.UpdateMemoryRequest(scope=scope, id=own, content=content),
                        timeout=CALL_SECONDS,
                    )
                note("OK")
                if response.usage.used_chars > BUDGETS[tier]:
                    note("OK", f"{tier} at {response.usage.used_chars} after a write")
                # No stale frozen block once a write is acknowledged (on_write).
                block = stub.InjectForTurn(
                    pb.InjectForTurnRequest(scope=scope, session_id=session), timeout=CALL_SECONDS
                ).system_block
                if content and content not in block:
                    note("OK", f"{content!r} acknowledged but not in the next turn")
            except grpc.RpcError as error:
                note(error.code().name)
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION and own is None:
                    time.sleep(0.01)

    def reader(n: int) -> None:
        scope = SCOPES[n % len(SCOPES)]
        while loading():
            try:
                stub.InjectForTurn(
                    pb.InjectForTurnRequest(
                        scope=scope, session_id=f"reader-{n}", user_message="w1 v2"
                    ),
                    timeout=CALL_SECONDS,
                )
                stub.SearchMemories(
                    pb.SearchMemoriesRequest(scope=scope, query="w2"), timeout=CALL_SECONDS
                )
                note("OK")
            except grpc.RpcError as error:
                note(error.code().name)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(12)]
    threads += [threading.Thread(target=reader, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_SECONDS)
    assert not [t for t in threads if t.is_alive()], "a thread is stuck: deadlock"

    assert set(codes) <= EXPECTED, codes  # never UNAVAILABLE (locked), INTERNAL, ...
    assert codes["OK"] > ENOUGH
    assert problems == []
    for scope in SCOPES:
        listed = running.list(scope=scope)
        for usage in listed.usage:
            assert usage.used_chars <= BUDGETS[usage.tier]
        rendered = {
            tier: "\n§\n".join(m.content for m in listed.memories if m.tier == tier)
            for tier in BUDGETS
        }
        for usage in listed.usage:
            assert len(rendered[usage.tier]) == usage.used_chars
