"""The sync Client against a real daemon: retries that store once,
read-your-writes, typed errors, iterators that page and resume, the turn loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from client_testing import CALL_SECONDS, Cuts
from memory_sidecar_client import BudgetExceeded, Client, SidecarError, pb


class Recorder(grpc.UnaryUnaryClientInterceptor):
    """Every unary request the client sends, by method."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.requests.append((details.method.rpartition("/")[2], request))
        return continuation(details, request)

    def sent(self, method: str) -> list[Any]:
        return [request for name, request in self.requests if name == method]


def contents(client: Client) -> list[str]:
    return [m.content for m in client.list_memories()]


def test_a_write_retried_after_a_cut_is_stored_once(
    address: str, cuts: Cuts, scope: tuple[str, str], client: Client
) -> None:
    before = cuts.count()
    with Client(cuts.target, agent_id=scope[0], user_id=scope[1], timeout=CALL_SECONDS) as cut:
        cuts.arm("headers")
        # No key given: the client makes one, and sends it again on the retry.
        added = cut.add_memory("The repo uses uv, not pip")
    assert cuts.count() == before + 1
    # The first attempt committed; the retry found its entry.
    assert not added.created
    assert contents(client) == ["The repo uses uv, not pip"]


def test_a_write_without_a_key_is_not_retried_after_a_cut(
    cuts: Cuts, scope: tuple[str, str], client: Client
) -> None:
    note = client.add_memory("deploys on Fridays")
    with Client(cuts.target, agent_id=scope[0], user_id=scope[1], timeout=CALL_SECONDS) as cut:
        cuts.arm("headers")
        with pytest.raises(SidecarError) as cut_off:
            cut.update_memory(note.memory.id, content="deploys on Mondays")
    assert cut_off.value.code == grpc.StatusCode.UNAVAILABLE
    assert cut_off.value.reason == ""  # the daemon's answer never arrived
    assert contents(client) == ["deploys on Mondays"]


def test_reads_carry_the_highest_generation_written(address: str, scope: tuple[str, str]) -> None:
    recorder = Recorder()
    channel = grpc.intercept_channel(grpc.insecure_channel(address), recorder)
    with channel, Client(channel=channel, agent_id=scope[0], user_id=scope[1]) as client:
        first = client.add_memory("uses uv")
        second = client.add_memory("Ada prefers short answers", tier=pb.TIER_USER)
        assert client.generation == max(first.generation, second.generation) > 0
        listed = client.get_memories()
        client.search_memories("uv")
        turn = client.turn("s1", "which package manager?")
    sent = [*recorder.sent("GetMemories"), *recorder.sent("SearchMemories")]
    sent += recorder.sent("InjectForTurn")
    assert [request.min_generation for request in sent] == [client.generation] * 3
    # And the reads see the writes.
    assert [m.content for m in listed.memories] == ["uses uv", "Ada prefers short answers"]
    assert "uses uv" in turn.system_block


def test_a_tool_calls_writes_count_for_read_your_writes(
    address: str, scope: tuple[str, str]
) -> None:
    recorder = Recorder()
    channel = grpc.intercept_channel(grpc.insecure_channel(address), recorder)
    with channel, Client(channel=channel, agent_id=scope[0], user_id=scope[1]) as client:
        added = client.add_memory("uses uv")
        saved = client.call_tool("s1", "memory", {"action": "add", "content": "deploys on Fridays"})
        assert not saved.is_error, saved.text
        assert saved.generation > added.generation
        assert client.generation == saved.generation
        # Claude's memory tool: a create of two lines answers the later write's.
        created = client.call_tool(
            "s1",
            "memory",
            {"command": "create", "path": "/memories/user.md", "file_text": "Ada\nprefers tabs"},
        )
        assert not created.is_error, created.text
        assert created.generation > saved.generation
        # A read through a tool wrote nothing: 0, and the highest stays.
        listed = client.call_tool("s1", "memory_list", {})
        assert listed.generation == 0
        assert client.generation == created.generation
        memories = client.get_memories()
    (request,) = recorder.sent("GetMemories")
    assert request.min_generation == created.generation
    assert [m.content for m in memories.memories] == [
        "uses uv",
        "deploys on Fridays",
        "Ada",
        "prefers tabs",
    ]


def test_read_your_writes_can_be_turned_off(address: str, scope: tuple[str, str]) -> None:
    recorder = Recorder()
    channel = grpc.intercept_channel(grpc.insecure_channel(address), recorder)
    with (
        channel,
        Client(
            channel=channel, agent_id=scope[0], user_id=scope[1], read_your_writes=False
        ) as client,
    ):
        client.add_memory("uses uv")
        client.get_memories()
    (request,) = recorder.sent("GetMemories")
    assert request.min_generation == 0
    assert client.generation > 0


def test_a_budget_refusal_carries_the_usage_as_numbers(client: Client) -> None:
    client.add_memory("a" * 100)
    with pytest.raises(BudgetExceeded) as full:
        client.add_memory("b" * 2150)
    refused = full.value
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.reason == "TIER_BUDGET_EXCEEDED"
    assert (refused.tier, refused.used_chars, refused.limit_chars) == ("memory", 100, 2200)
    assert refused.requested_chars == 2153  # with the 3 separating characters
    assert refused.entry_chars is None
    with pytest.raises(BudgetExceeded) as too_large:
        client.add_memory("c" * 2300)
    assert too_large.value.reason == "ENTRY_TOO_LARGE"
    assert (too_large.value.entry_chars, too_large.value.limit_chars) == (2300, 2200)


def test_other_errors_are_typed_with_reason_and_metadata(client: Client) -> None:
    with pytest.raises(SidecarError) as missing:
        client.delete_memory("no-such-id")
    assert not isinstance(missing.value, BudgetExceeded)
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert missing.value.reason == "MEMORY_NOT_FOUND"
    assert missing.value.metadata == {"id": "no-such-id"}
    assert missing.value.domain == "memory.v1"


def test_iterators_follow_every_page(client: Client) -> None:
    for n in range(5):
        client.add_memory(f"note {n} about deploys")
    assert [m.content for m in client.list_memories(page_size=2)] == [
        f"note {n} about deploys" for n in range(5)
    ]
    hits = list(client.search_hits("deploys", page_size=2))
    assert sorted(hit.memory.content for hit in hits) == [
        f"note {n} about deploys" for n in range(5)
    ]


def exported(batches: list[pb.ExportMemoriesResponse]) -> list[str]:
    return [json.loads(line)["content"] for b in batches for line in b.jsonl.splitlines()]


def test_export_resumes_after_a_cut(cuts: Cuts, scope: tuple[str, str], client: Client) -> None:
    notes = [f"note {n}" for n in range(5)]
    for note in notes:
        client.add_memory(note)
    # Where a first export's first batch left off: the cut export resumes there.
    first = next(iter(client.export_memories(batch_size=2)))
    before = cuts.count()
    with Client(cuts.target, agent_id=scope[0], user_id=scope[1], timeout=CALL_SECONDS) as cut:
        cuts.arm("data")
        rest = list(cut.export_memories(batch_size=2, cursor=first.cursor))
        assert cuts.count() == before + 1
        assert exported([first, *rest]) == notes
        assert rest[-1].done
        # From the start, cut at its first batch: every line, once.
        cuts.arm("data")
        assert exported(list(cut.export_memories(batch_size=2))) == notes
    assert cuts.count() == before + 2


def test_watch_resumes_after_the_last_event_across_a_cut(
    cuts: Cuts, scope: tuple[str, str], client: Client
) -> None:
    before = cuts.count()
    with Client(cuts.target, agent_id=scope[0], user_id=scope[1], timeout=CALL_SECONDS) as cut:
        events = cut.watch_memories(timeout=CALL_SECONDS)
        assert next(events).kind == pb.MemoryEvent.KIND_SYNC
        client.add_memory("first")
        assert next(events).memory.content == "first"
        # The next event's frame is cut: the client watches again after "first".
        cuts.arm("data")
        client.add_memory("second")
        second = next(events)
        client.add_memory("third")
        third = next(events)
        events.close()
    assert cuts.count() == before + 1
    assert (second.kind, second.memory.content) == (pb.MemoryEvent.KIND_ADD, "second")
    assert third.memory.content == "third"  # nothing repeated


def test_the_turn_loop(client: Client) -> None:
    client.add_memory("The repo uses uv, not pip")
    first = client.turn("chat-1", "Which package manager?")
    again = client.turn("chat-1", "And for tests?")
    assert "The repo uses uv, not pip" in first.system_block
    assert (first.cache_hit, again.cache_hit) == (False, True)
    assert again.snapshot_sha256 == first.snapshot_sha256
    assert again.snapshot_generation == first.snapshot_generation == client.generation
    assert client.notify_compaction("chat-1").invalidated
    assert client.end_session("chat-1").dropped
    assert not client.end_session("chat-1").dropped


def test_tools_in_both_shapes_and_their_calls(client: Client) -> None:
    openai = client.tools("openai")
    assert [tool["function"]["name"] for tool in openai] == [
        "memory",
        "memory_search",
        "memory_list",
    ]
    assert all(tool["type"] == "function" for tool in openai)
    anthropic = client.tools("anthropic")
    assert anthropic[0] == {"type": "memory_20250818", "name": "memory"}
    assert [tool["name"] for tool in anthropic[1:]] == ["memory_search", "memory_list"]
    assert all("input_schema" in tool for tool in anthropic[1:])
    plain = client.tools("anthropic", claude_memory_tool=False)
    assert plain[0]["name"] == "memory"
    assert "input_schema" in plain[0]

    added = client.call_tool("s1", "memory", {"action": "add", "content": "uses uv"})
    assert not added.is_error
    assert "uses uv" in added.text
    # Claude's memory tool is called `memory` too: its calls carry a command.
    viewed = client.call_tool("s1", "memory", '{"command": "view", "path": "/memories/notes.md"}')
    assert not viewed.is_error
    assert "uses uv" in viewed.text
    wrong = client.call_tool(
        "s1", "memory", {"action": "replace", "old_text": "pip", "new_text": "x"}
    )
    assert wrong.is_error
    assert wrong.structured


def test_the_package_imports_installed_and_without_the_server(tmp_path: Path) -> None:
    # The server package hidden: importing it would fail. No PYTHONPATH: the
    # client must come from the environment's installed packages.
    probe = (
        "import sys; sys.modules['sidecar'] = None;"
        "import importlib.metadata, memory_sidecar_client as c, memory_sidecar_client.aio;"
        "assert importlib.metadata.version('memory-sidecar-client') == c.__version__;"
        "assert not [m for m in sys.modules if m.startswith('sidecar') and sys.modules[m]];"
        "print(c.Client.__name__, c.AsyncClient.__name__)"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=CALL_SECONDS,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Client", "AsyncClient"]
