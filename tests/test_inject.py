"""InjectForTurn over gRPC: the two blocks, snapshots, compaction, session end."""

from __future__ import annotations

import hashlib

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import MakeSidecar, Running

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
RULE = "═" * 48


def seed_both_tiers(running: Running) -> tuple[pb.Memory, ...]:
    return (
        running.add("Repo uses uv for Python packaging", scope=SCOPE).memory,
        running.add("CI runs on Debian bookworm", scope=SCOPE).memory,
        running.add("Ada is a staff engineer", scope=SCOPE, tier=pb.TIER_USER).memory,
    )


def test_system_block_has_seed_003s_format_exactly(sidecar: Running) -> None:
    seed_both_tiers(sidecar)
    turn = sidecar.turn("s1", "hello", scope=SCOPE)
    notes = len("Repo uses uv for Python packaging\n§\nCI runs on Debian bookworm")
    profile = len("Ada is a staff engineer")
    assert turn.system_block == (
        f"{RULE}\n"
        f"MEMORY (agent notes) [{notes * 100 // 2200}% — {notes}/2,200 chars]\n"
        f"{RULE}\n"
        "Repo uses uv for Python packaging\n"
        "§\n"
        "CI runs on Debian bookworm\n"
        "\n"
        f"{RULE}\n"
        f"USER PROFILE (who the user is) [{profile * 100 // 1375}% — {profile}/1,375 chars]\n"
        f"{RULE}\n"
        "Ada is a staff engineer"
    )
    assert turn.snapshot_sha256 == hashlib.sha256(turn.system_block.encode()).hexdigest()
    assert turn.token_counter == pb.TOKEN_COUNTER_CHARS_DIV_4
    assert turn.system_block_tokens == len(turn.system_block) // 4
    assert {u.tier: u.entry_count for u in turn.usage} == {pb.TIER_MEMORY: 2, pb.TIER_USER: 1}


def test_header_percentage_rounds_down_with_thousands_separators(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 12000}")
    running.add("x" * 1234, scope=SCOPE)
    block = running.turn("s", scope=SCOPE).system_block
    # 1234 / 12000 = 10.28%
    assert block.splitlines()[1] == "MEMORY (agent notes) [10% — 1,234/12,000 chars]"


def test_each_tier_only_in_its_own_block_and_empty_tiers_left_out(sidecar: Running) -> None:
    sidecar.add("Ada prefers dark mode", scope=SCOPE, tier=pb.TIER_USER)
    block = sidecar.turn("s", scope=SCOPE).system_block
    assert "MEMORY (agent notes)" not in block
    assert block.startswith(f"{RULE}\nUSER PROFILE (who the user is)")
    assert block.endswith("Ada prefers dark mode")

    empty = sidecar.turn("other", scope=pb.Scope(agent_id="nobody", user_id="nobody"))
    assert empty.system_block == ""
    assert empty.turn_context == ""


@pytest.mark.parametrize(
    ("flag", "gone", "kept"),
    [
        ("memory_enabled", "MEMORY (agent notes)", "USER PROFILE"),
        ("user_profile_enabled", "USER PROFILE", "MEMORY (agent notes)"),
    ],
)
def test_enable_flags_suppress_their_blocks(
    make_sidecar: MakeSidecar, flag: str, gone: str, kept: str
) -> None:
    writer = make_sidecar(name="flags.db")
    seed_both_tiers(writer)
    writer.sidecar.stop(grace=0)
    running = make_sidecar(f"defaults: {{{flag}: false}}", name="flags.db")
    turn = running.turn("s", "", scope=SCOPE)
    assert gone not in turn.system_block
    assert kept in turn.system_block
    # A disabled tier is not injected through the turn block either.
    with_system_off = make_sidecar(
        f"defaults: {{{flag}: false, inject_system_block: false}}", name="flags.db"
    )
    context = with_system_off.turn("s", "", scope=SCOPE).turn_context
    disabled = "memory" if flag == "memory_enabled" else "user"
    assert f'tier="{disabled}"' not in context
    assert context.count("<memory ") == (1 if disabled == "memory" else 2)


def test_unlimited_tier_shows_count_and_best_entries_within_the_token_budget(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 0, max_injection_tokens: 30}")
    running.add("low confidence filler " * 2, scope=SCOPE, confidence=0.2)
    running.add("top fact one", scope=SCOPE, confidence=0.9)
    running.add("top fact two", scope=SCOPE, confidence=0.9)
    running.add("x" * 400, scope=SCOPE, confidence=1.0)  # 100 tokens: never fits

    block = running.turn("s", "anything", scope=SCOPE).system_block
    lines = block.splitlines()
    assert lines[1] == "MEMORY (agent notes) [4 entries, 3 shown]"
    # Highest confidence first, then the most recent of equals.
    assert lines[3:] == [
        "top fact two",
        "§",
        "top fact one",
        "§",
        "low confidence filler low confidence filler",
    ]


def test_turns_without_writes_are_byte_identical_and_query_nothing(sidecar: Running) -> None:
    seed_both_tiers(sidecar)
    # The counter sees the writes (which, checking for near-duplicates, also
    # loaded both tiers: the first turn builds its snapshot from them).
    assert sidecar.db_queries() > 0
    first = sidecar.turn("s", "Which packaging tool does the repo use?", scope=SCOPE)
    assert not first.cache_hit

    before = sidecar.db_queries()
    later = [
        sidecar.turn("s", question, scope=SCOPE, recent_messages=["we talked about CI"])
        for question in ("Which packaging tool?", "", "Tell me about Debian", "uv or pip?")
    ]
    assert sidecar.db_queries() == before

    for turn in later:
        assert turn.cache_hit
        assert turn.system_block == first.system_block
        assert turn.snapshot_sha256 == first.snapshot_sha256
        assert turn.snapshot_generation == first.snapshot_generation


@pytest.mark.parametrize("change", ["add", "update", "delete"])
def test_writes_show_on_the_next_turn_under_on_write(sidecar: Running, change: str) -> None:
    notes = seed_both_tiers(sidecar)
    before = sidecar.turn("s", scope=SCOPE)
    if change == "add":
        sidecar.add("Deploys happen on Fridays", scope=SCOPE)
        expected = "Deploys happen on Fridays"
    elif change == "update":
        sidecar.stub.UpdateMemory(
            pb.UpdateMemoryRequest(scope=SCOPE, id=notes[1].id, content="CI runs on Alpine")
        )
        expected = "CI runs on Alpine"
    else:
        sidecar.stub.DeleteMemory(pb.DeleteMemoryRequest(scope=SCOPE, id=notes[1].id))
        expected = None

    after = sidecar.turn("s", scope=SCOPE)
    assert not after.cache_hit
    assert after.snapshot_generation > before.snapshot_generation
    if expected:
        assert expected in after.system_block
    else:
        assert "CI runs on Debian" not in after.system_block
    assert sidecar.turn("s", scope=SCOPE).cache_hit


def test_on_compaction_keeps_the_block_frozen_until_compaction(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {snapshot_refresh: on_compaction}")
    seed_both_tiers(running)
    frozen = running.turn("s", scope=SCOPE)
    running.add("Staging cluster is called kestrel", scope=SCOPE)

    still = running.turn("s", "what is the staging cluster called?", scope=SCOPE)
    assert still.cache_hit
    assert still.system_block == frozen.system_block
    # The new memory is not lost meanwhile: the turn block carries it.
    assert "kestrel" in still.turn_context
    # Another session starts from the store as it is now.
    assert "kestrel" in running.turn("other", scope=SCOPE).system_block

    compacted = running.stub.NotifyCompaction(
        pb.NotifyCompactionRequest(session_id="s", scope=SCOPE)
    )
    assert compacted.invalidated
    rebuilt = running.turn("s", "what is the staging cluster called?", scope=SCOPE)
    assert not rebuilt.cache_hit
    assert "kestrel" in rebuilt.system_block
    assert "kestrel" not in rebuilt.turn_context  # now in the frozen block: not repeated


def test_compaction_rebuilds_and_is_idempotent(sidecar: Running) -> None:
    seed_both_tiers(sidecar)
    first = sidecar.turn("s", scope=SCOPE)
    compact = pb.NotifyCompactionRequest(session_id="s", scope=SCOPE)
    assert sidecar.stub.NotifyCompaction(compact).invalidated
    assert not sidecar.stub.NotifyCompaction(compact).invalidated
    assert not sidecar.stub.NotifyCompaction(
        pb.NotifyCompactionRequest(session_id="never", scope=SCOPE)
    ).invalidated
    rebuilt = sidecar.turn("s", scope=SCOPE)
    assert not rebuilt.cache_hit
    assert rebuilt.system_block == first.system_block
    assert sidecar.turn("s", scope=SCOPE).cache_hit


def test_end_session_drops_and_the_id_starts_afresh(sidecar: Running) -> None:
    seed_both_tiers(sidecar)
    sidecar.turn("s", scope=SCOPE)
    end = pb.EndSessionRequest(session_id="s", scope=SCOPE)
    assert sidecar.stub.EndSession(end).dropped
    assert not sidecar.stub.EndSession(end).dropped
    again = sidecar.turn("s", scope=SCOPE)
    assert not again.cache_hit


def test_no_leak_between_sessions_or_scopes(sidecar: Running) -> None:
    seed_both_tiers(sidecar)
    other = pb.Scope(agent_id="writer", user_id="grace")
    sidecar.add("Grace writes in British English", scope=other, tier=pb.TIER_USER)
    mine = sidecar.turn("s", scope=SCOPE)
    # The same session id reused for another scope gets that scope's memories only.
    theirs = sidecar.turn("s", scope=other)
    assert not theirs.cache_hit
    assert "Grace" in theirs.system_block
    assert "Ada" not in theirs.system_block + theirs.turn_context
    assert "Grace" not in mine.system_block + mine.turn_context


def test_session_ids_are_per_agent(sidecar: Running) -> None:
    """Two agents both calling their session "default" each keep their own
    snapshot, and neither can invalidate or end the other's."""
    coder, writer = pb.Scope(agent_id="coder", user_id="ada"), pb.Scope(agent_id="writer")
    sidecar.add("The repo uses uv", scope=coder)
    sidecar.add("Drafts go to the docs folder", scope=writer)
    hits = []
    for _ in range(10):
        for scope in (coder, writer):
            hits.append(sidecar.turn("default", scope=scope).cache_hit)
    # Only the first turn of each agent builds a snapshot.
    assert hits.count(False) == 2

    writer_compact = pb.NotifyCompactionRequest(session_id="default", scope=writer)
    assert sidecar.stub.NotifyCompaction(writer_compact).invalidated
    assert sidecar.turn("default", scope=coder).cache_hit
    assert not sidecar.turn("default", scope=writer).cache_hit

    # An unscoped call addresses the default scope's session, not theirs.
    assert not sidecar.stub.EndSession(pb.EndSessionRequest(session_id="default")).dropped
    assert not sidecar.stub.NotifyCompaction(
        pb.NotifyCompactionRequest(session_id="default")
    ).invalidated
    assert sidecar.stub.EndSession(pb.EndSessionRequest(session_id="default", scope=coder)).dropped
    assert not sidecar.turn("default", scope=coder).cache_hit
    assert sidecar.turn("default", scope=writer).cache_hit


def test_memories_in_the_system_block_are_not_repeated(sidecar: Running) -> None:
    seed_both_tiers(sidecar)
    turn = sidecar.turn("s", "Debian packaging with uv", scope=SCOPE)
    assert len(turn.system_block_memory_ids) == 3
    assert turn.turn_context == ""
    assert list(turn.injected_memory_ids) == []


def test_sessions_of_one_scope_share_one_snapshot(sidecar: Running) -> None:
    seed_both_tiers(sidecar)
    for n in range(50):
        sidecar.turn(f"session-{n}", scope=SCOPE)
    stats = sidecar.sidecar.engine.stats()
    assert stats.sessions == 50
    assert stats.views == 1
    assert stats.partitions == 2
