"""Per-tier character budgets: edges, messages, atomicity, concurrency."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import MakeSidecar, Running, error_info, refused

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")

SMALL = """
defaults:
  memory_char_limit: 20
  user_char_limit: 10
"""


def test_default_budgets_are_the_seeds(sidecar: Running) -> None:
    usage = {u.tier: u.limit_chars for u in sidecar.list(scope=SCOPE).usage}
    assert usage == {pb.TIER_MEMORY: 2200, pb.TIER_USER: 1375}


def test_exactly_at_the_limit_is_accepted(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(SMALL)
    running.add("a" * 7, scope=SCOPE)
    # 7 + len("\n§\n") + 10 == 20
    response = running.add("b" * 10, scope=SCOPE)
    assert response.usage.used_chars == 20
    assert response.usage.limit_chars == 20


def test_one_character_over_is_refused_with_details(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(SMALL)
    running.add("a" * 7, scope=SCOPE)
    before = running.list(scope=SCOPE)

    error = refused(running.add, "b" * 11, scope=SCOPE)

    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(error)
    assert info.reason == "TIER_BUDGET_EXCEEDED"
    assert dict(info.metadata) == {
        "tier": "memory",
        "used_chars": "7",
        "limit_chars": "20",
        "requested_chars": "14",
    }
    assert error.details() == (
        "agent notes at 7/20 chars; this entry needs 14 more but only 13 are free; "
        "replace or remove an entry first"
    )
    assert running.list(scope=SCOPE) == before


def test_message_uses_thousands_separators(sidecar: Running) -> None:
    sidecar.add("x" * 2094, scope=SCOPE)
    error = refused(sidecar.add, "y" * 177, scope=SCOPE)
    assert (error.details() or "").startswith(
        "agent notes at 2,094/2,200 chars; this entry needs 180 more but only 106 are free"
    )


def test_user_tier_has_its_own_budget(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(SMALL)
    running.add("a" * 20, scope=SCOPE)  # notes full
    running.add("u" * 10, scope=SCOPE, tier=pb.TIER_USER)  # profile full, separately
    error = refused(running.add, "v", scope=SCOPE, tier=pb.TIER_USER)
    info = error_info(error)
    assert info.metadata["tier"] == "user"
    assert (error.details() or "").startswith("user profile at 10/10 chars")


def test_characters_are_code_points_not_bytes(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(SMALL)
    # 10 code points, 4 of them multi-byte in UTF-8 (é, ß, 日, 🙂).
    text = "café ßx日🙂z"
    assert len(text) == 10
    assert len(text.encode()) > 10
    response = running.add(text, scope=SCOPE, tier=pb.TIER_USER)
    assert response.usage.used_chars == 10
    error = refused(running.add, "é", scope=SCOPE, tier=pb.TIER_USER)
    assert error_info(error).metadata["requested_chars"] == "4"


def test_update_that_grows_past_the_limit_isrefused(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(SMALL)
    first = running.add("a" * 7, scope=SCOPE).memory
    running.add("b" * 10, scope=SCOPE)
    before = running.list(scope=SCOPE)

    error = refused(
        running.stub.UpdateMemory,
        pb.UpdateMemoryRequest(scope=SCOPE, id=first.id, content="a" * 8),
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(error_info(error).metadata) == {
        "tier": "memory",
        "used_chars": "20",
        "limit_chars": "20",
        "requested_chars": "1",
    }
    assert running.list(scope=SCOPE) == before

    same_size = running.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=SCOPE, id=first.id, content="c" * 7)
    )
    assert same_size.usage.used_chars == 20


def test_an_over_budget_tier_may_still_shrink(make_sidecar: MakeSidecar) -> None:
    roomy = make_sidecar(name="shared.db")
    big = roomy.add("a" * 30, scope=SCOPE).memory
    roomy.sidecar.stop(grace=0)
    # The operator lowers the budget below what is stored.
    tight = make_sidecar(SMALL, name="shared.db")

    error = refused(tight.add, "more", scope=SCOPE)
    assert error_info(error).reason == "TIER_BUDGET_EXCEEDED"
    grown = refused(
        tight.stub.UpdateMemory, pb.UpdateMemoryRequest(scope=SCOPE, id=big.id, content="a" * 31)
    )
    # Longer than the whole (lowered) budget: no removal could make room.
    assert error_info(grown).reason == "ENTRY_TOO_LARGE"
    shrunk = tight.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=SCOPE, id=big.id, content="a" * 25)
    )
    assert shrunk.usage.used_chars == 25


def test_an_entry_longer_than_the_whole_budget_has_its_own_reason(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 50}")
    running.add("x" * 10, scope=SCOPE)
    error = refused(running.add, "y" * 51, scope=SCOPE)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(error)
    assert info.reason == "ENTRY_TOO_LARGE"
    assert dict(info.metadata) == {"tier": "memory", "entry_chars": "51", "limit_chars": "50"}
    assert error.details() == (
        "this entry is 51 characters and the whole agent notes budget is 50: "
        "shorten it to at most 50 characters; removing entries cannot make room"
    )
    # An entry of exactly the budget is refused for lack of room, not size.
    fits_alone = refused(running.add, "z" * 50, scope=SCOPE)
    assert error_info(fits_alone).reason == "TIER_BUDGET_EXCEEDED"
    assert [m.content for m in running.list(scope=SCOPE).memories] == ["x" * 10]


def test_zero_means_unlimited(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 0}")
    response = running.add("z" * 8000, scope=SCOPE)
    assert response.usage.limit_chars == 0
    assert response.usage.used_chars == 8000


def test_per_agent_budgets(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("agents: {tiny: {memory_char_limit: 5}}")
    running.add("x" * 100, scope=pb.Scope(agent_id="big"))
    error = refused(running.add, "x" * 6, scope=pb.Scope(agent_id="tiny"))
    assert error_info(error).metadata["limit_chars"] == "5"


def test_disabled_tier_refuses_writes_but_allows_delete(make_sidecar: MakeSidecar) -> None:
    open_running = make_sidecar(name="flags.db")
    kept = open_running.add("old profile fact", scope=SCOPE, tier=pb.TIER_USER).memory
    open_running.sidecar.stop(grace=0)
    running = make_sidecar("defaults: {user_profile_enabled: false}", name="flags.db")

    error = refused(running.add, "new fact", scope=SCOPE, tier=pb.TIER_USER)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(error).reason == "TIER_DISABLED"
    error = refused(
        running.stub.UpdateMemory, pb.UpdateMemoryRequest(scope=SCOPE, id=kept.id, content="x")
    )
    assert error_info(error).reason == "TIER_DISABLED"
    usage = {u.tier: u.enabled for u in running.list(scope=SCOPE).usage}
    assert usage == {pb.TIER_MEMORY: True, pb.TIER_USER: False}
    running.stub.DeleteMemory(pb.DeleteMemoryRequest(scope=SCOPE, id=kept.id))
    assert list(running.list(scope=SCOPE).memories) == []


def test_concurrent_writers_never_overflow_a_tier(make_sidecar: MakeSidecar) -> None:
    limit = 500
    running = make_sidecar(f"defaults: {{memory_char_limit: {limit}}}", max_workers=8)
    entry = 17  # each entry after the first costs 17 + 3 chars
    fits = 1 + (limit - entry) // (entry + 3)
    attempts = 64
    start = threading.Barrier(16)

    def writer(n: int) -> str:
        if n < 16:
            start.wait()
        try:
            running.add(f"fact number {n:05d}", scope=SCOPE)
        except grpc.RpcError as error:
            return f"{error.code().name} {error_info(error).reason}"
        return "ok"

    with ThreadPoolExecutor(max_workers=16) as pool:
        outcomes = list(pool.map(writer, range(attempts)))

    listed = running.list(scope=SCOPE, tier=pb.TIER_MEMORY)
    assert outcomes.count("ok") == fits == len(listed.memories)
    assert outcomes.count("FAILED_PRECONDITION TIER_BUDGET_EXCEEDED") == attempts - fits
    assert listed.usage[0].used_chars <= limit
    rendered = "\n§\n".join(m.content for m in listed.memories)
    assert len(rendered) == listed.usage[0].used_chars
