"""Paging (AIP-158) and responses that never exceed the response limit."""

from __future__ import annotations

import base64
import json
import random
import string
from typing import Any

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.api.paging import PageTokens
from sidecar.core.errors import InvalidArgument
from sidecar.ops import cli
from tests.conftest import (
    CALL_SECONDS,
    MakeSidecar,
    Running,
    error_info,
    stop_sidecar,
)

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
UNLIMITED = "defaults: {memory_char_limit: 0, user_char_limit: 0}\n"
SMALL = 64 * 1024  # the smallest max_response_bytes there is


def words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))
        for _ in range(count)
    )


def fill(running: Running, count: int, size: int = 0, prefix: str = "fact") -> list[str]:
    """`count` memories (about `size` characters each, if given); their ids."""
    rng = random.Random(count)
    ids = []
    for n in range(count):
        text = f"{prefix} {n} " + (words(rng, size // 6) if size else "")
        ids.append(running.add(text[: size or None], scope=SCOPE).memory.id)
    return ids


def every_page(running: Running, request: pb.GetMemoriesRequest) -> list[pb.GetMemoriesResponse]:
    pages = []
    while True:
        page = running.stub.GetMemories(request, timeout=CALL_SECONDS)
        pages.append(page)
        if not page.next_page_token:
            return pages
        request.page_token = page.next_page_token


def test_get_memories_pages_through_everything_in_order(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    ids = fill(running, 25)
    pages = every_page(running, pb.GetMemoriesRequest(scope=SCOPE, page_size=10))
    assert [len(p.memories) for p in pages] == [10, 10, 5]
    assert [m.id for p in pages for m in p.memories] == ids
    # Usage on every page, the same each time.
    assert all(p.usage == pages[0].usage for p in pages)
    assert {u.tier: u.entry_count for u in pages[0].usage}[pb.TIER_MEMORY] == 25
    # Without page_size everything fits one default page.
    whole = running.list(scope=SCOPE)
    assert [m.id for m in whole.memories] == ids
    assert whole.next_page_token == ""


def test_a_page_that_would_pass_the_response_limit_ends_early(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED, max_response_bytes=SMALL)
    ids = fill(running, 40, size=4000)  # about 160 KB in all
    pages = every_page(running, pb.GetMemoriesRequest(scope=SCOPE))
    assert len(pages) >= 3
    assert all(p.ByteSize() <= SMALL for p in pages)
    assert [m.id for p in pages for m in p.memories] == ids


def test_page_tokens_are_bound_to_their_request(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    fill(running, 5)
    first = running.list(scope=SCOPE, page_size=2)
    token = first.next_page_token
    assert token

    def refused(**fields: Any) -> str:
        with pytest.raises(grpc.RpcError) as caught:
            running.list(**fields)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return str(error_info(caught.value).reason)

    assert refused(scope=SCOPE, page_token=token, tier=pb.TIER_USER) == "PAGE_TOKEN_MISMATCH"
    other = pb.Scope(agent_id="writer", user_id="ada")
    assert refused(scope=other, page_token=token) == "PAGE_TOKEN_MISMATCH"
    assert refused(scope=SCOPE, page_token="not-a-token") == "PAGE_TOKEN_INVALID"
    # Forged tokens (a position past 64 bits, a boolean, deep nesting, a
    # very long one) are refused as invalid, not failed on.
    bound_to = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))[2]
    forged: list[Any]
    for forged in ([1, "list", bound_to, 2**70], [1, "list", bound_to, True], [[[[[]]]]] * 4):
        raw = base64.urlsafe_b64encode(json.dumps(forged).encode()).decode()
        assert refused(scope=SCOPE, page_token=raw) == "PAGE_TOKEN_INVALID"
    deep = base64.urlsafe_b64encode(b"[" * 100 + b"]" * 100).decode()
    assert refused(scope=SCOPE, page_token=deep) == "PAGE_TOKEN_INVALID"
    assert refused(scope=SCOPE, page_token="A" * 10_000) == "PAGE_TOKEN_INVALID"
    assert refused(scope=SCOPE, page_size=-1) == "PAGE_SIZE_OUT_OF_RANGE"
    # A search token does not page a list.
    search = running.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=SCOPE, query="fact", page_size=1), timeout=CALL_SECONDS
    )
    assert refused(scope=SCOPE, page_token=search.next_page_token) == "PAGE_TOKEN_MISMATCH"
    # The page size may change between pages; too large a one is cut to 1000.
    second = running.list(scope=SCOPE, page_size=5000, page_token=token)
    assert len(second.memories) == 3


def test_search_pages_are_slices_of_one_ranking(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    fill(running, 30, prefix="deploy note")
    whole = running.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=SCOPE, query="deploy note 7", limit=25), timeout=CALL_SECONDS
    )
    assert len(whole.hits) == 25
    assert whole.next_page_token == ""
    request = pb.SearchMemoriesRequest(scope=SCOPE, query="deploy note 7", limit=25, page_size=10)
    hits: list[pb.SearchHit] = []
    sizes = []
    while True:
        page = running.stub.SearchMemories(request, timeout=CALL_SECONDS)
        hits.extend(page.hits)
        sizes.append(len(page.hits))
        if not page.next_page_token:
            break
        request.page_token = page.next_page_token
    assert sizes == [10, 10, 5]
    assert [h.memory.id for h in hits] == [h.memory.id for h in whole.hits]


def test_a_large_search_stays_under_the_response_limit(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED, max_response_bytes=SMALL)
    fill(running, 40, size=4000)
    request = pb.SearchMemoriesRequest(scope=SCOPE, query="fact", limit=1000)
    first = running.stub.SearchMemories(request, timeout=CALL_SECONDS)
    assert first.ByteSize() <= SMALL
    assert first.next_page_token
    assert 0 < len(first.hits) < 40


def test_an_injection_too_large_to_send_is_refused_with_a_reason(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 200000}\n", max_response_bytes=SMALL)
    fill(running, 20, size=4000)  # about 80 KB, all of it in the frozen block
    with pytest.raises(grpc.RpcError) as caught:
        running.turn("s", "hello", scope=SCOPE)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(caught.value)
    assert info.reason == "RESPONSE_TOO_LARGE"
    assert int(info.metadata["size"]) > SMALL == int(info.metadata["max"])
    assert "max_response_bytes" in (caught.value.details() or "")
    # Nothing was lost, and the entries can still be read, a page at a time.
    pages = every_page(running, pb.GetMemoriesRequest(scope=SCOPE))
    assert sum(len(p.memories) for p in pages) == 20


def test_the_cli_lists_every_page(
    make_sidecar: MakeSidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    running = make_sidecar(UNLIMITED, max_response_bytes=SMALL)
    ids = fill(running, 40, size=4000)
    address = ["--address", running.addresses.api, "--agent-id", "coder", "--user-id", "ada"]
    assert cli.main(["list", *address, "--json"], environ={}) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m["id"] for m in listed["memories"]] == ids
    assert "nextPageToken" not in listed


def forged(token: str, position: int) -> str:
    """The token with its position changed and everything else kept: what a
    client that read the (unencrypted) format could make."""
    fields = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    fields[3] = position
    return base64.urlsafe_b64encode(json.dumps(fields).encode()).decode().rstrip("=")


def test_a_forged_or_unsigned_token_is_refused(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(UNLIMITED)
    fill(running, 6)
    token = running.list(scope=SCOPE, page_size=2).next_page_token
    assert len(running.list(scope=SCOPE, page_size=2, page_token=token).memories) == 2
    for position in (0, 1, 4, 10**6):
        with pytest.raises(grpc.RpcError) as caught:
            running.list(scope=SCOPE, page_size=2, page_token=forged(token, position))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(caught.value).reason == "PAGE_TOKEN_INVALID"
    # A token of the first, unsigned format (version 1) names no signature:
    # refused, with a message that says to start again.
    bound_to = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))[2]
    old = base64.urlsafe_b64encode(json.dumps([1, "list", bound_to, 2]).encode()).decode()
    with pytest.raises(grpc.RpcError) as caught:
        running.list(scope=SCOPE, page_size=2, page_token=old)
    assert error_info(caught.value).reason == "PAGE_TOKEN_INVALID"
    assert "first page" in (caught.value.details() or "")
    # Search tokens are signed too.
    request = pb.SearchMemoriesRequest(scope=SCOPE, query="fact", page_size=1)
    request.page_token = running.stub.SearchMemories(request, timeout=CALL_SECONDS).next_page_token
    request.page_token = forged(request.page_token, 3)
    with pytest.raises(grpc.RpcError) as caught:
        running.stub.SearchMemories(request, timeout=CALL_SECONDS)
    assert error_info(caught.value).reason == "PAGE_TOKEN_INVALID"


def test_a_token_from_one_replica_pages_on_another(make_sidecar: MakeSidecar) -> None:
    # Two daemons on one database (a load balancer between them): each page
    # may land on either.
    first, second = make_sidecar(UNLIMITED), make_sidecar(UNLIMITED)
    ids = fill(first, 5)
    page = first.list(scope=SCOPE, page_size=2)
    rest = second.list(scope=SCOPE, page_size=2, page_token=page.next_page_token)
    last = first.list(scope=SCOPE, page_size=2, page_token=rest.next_page_token)
    assert [m.id for p in (page, rest, last) for m in p.memories] == ids
    # A daemon that starts again keeps honouring them (the key is the database's).
    stop_sidecar(first)
    stop_sidecar(second)
    again = make_sidecar(UNLIMITED)
    rest = again.list(scope=SCOPE, page_size=2, page_token=page.next_page_token)
    last = again.list(scope=SCOPE, page_size=2, page_token=rest.next_page_token)
    assert [m.id for p in (page, rest, last) for m in p.memories] == ids


def test_a_token_of_several_positions_round_trips_and_is_checked() -> None:
    """An export cursor holds one position per partition (sidecar.api.export)."""
    pages = PageTokens(b"k" * 32)
    token = pages.encode("export", "d", [7, 9])
    assert pages.decode_positions(token, "export", "d", 2) == [7, 9]
    assert pages.decode_positions("", "export", "d", 2) == [0, 0]
    # A token of one position (a cursor issued before) is that position in each.
    assert pages.decode_positions(pages.encode("export", "d", 7), "export", "d", 2) == [7, 7]
    for bad in (
        lambda: pages.decode_positions(token, "export", "d", 3),  # another count
        lambda: pages.decode(token, "export", "d"),  # a list where one is expected
        lambda: pages.decode_positions(pages.encode("export", "d", [1] * 5), "export", "d", 5),
        lambda: pages.decode_positions(pages.encode("export", "d", [-1, 2]), "export", "d", 2),
    ):
        with pytest.raises(InvalidArgument):
            bad()
