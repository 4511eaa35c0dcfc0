"""CRUD over a real gRPC connection, in both tiers, with scope isolation."""

from __future__ import annotations

import time

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import MakeSidecar, Running, error_info, refused

pytestmark = pytest.mark.contract

AGENT = pb.Scope(agent_id="coder", user_id="ada")


def test_add_defaults_to_agent_notes_and_returns_usage(sidecar: Running) -> None:
    response = sidecar.add("The repo uses uv, not pip", scope=AGENT, category="tooling")

    memory = response.memory
    assert response.created
    assert memory.id
    assert memory.tier == pb.TIER_MEMORY
    assert memory.content == "The repo uses uv, not pip"
    assert memory.category == "tooling"
    assert memory.confidence == 1.0
    assert memory.created_at == memory.updated_at
    assert abs(memory.created_at.ToSeconds() - time.time()) < 60
    assert response.usage == pb.TierUsage(
        tier=pb.TIER_MEMORY, used_chars=25, limit_chars=2200, entry_count=1, enabled=True
    )


def test_each_tier_holds_its_own_entries(sidecar: Running) -> None:
    note = sidecar.add("CI runs on Debian", scope=AGENT, tier=pb.TIER_MEMORY).memory
    fact = sidecar.add(
        "Ada is a staff engineer", scope=AGENT, tier=pb.TIER_USER, confidence=0.8
    ).memory
    assert fact.tier == pb.TIER_USER
    assert fact.confidence == pytest.approx(0.8)

    notes = sidecar.list(scope=AGENT, tier=pb.TIER_MEMORY)
    profile = sidecar.list(scope=AGENT, tier=pb.TIER_USER)
    both = sidecar.list(scope=AGENT)

    assert [m.id for m in notes.memories] == [note.id]
    assert [u.tier for u in notes.usage] == [pb.TIER_MEMORY]
    assert [m.id for m in profile.memories] == [fact.id]
    assert [u.tier for u in profile.usage] == [pb.TIER_USER]
    assert [m.id for m in both.memories] == [note.id, fact.id]
    assert {u.tier: u.used_chars for u in both.usage} == {
        pb.TIER_MEMORY: len("CI runs on Debian"),
        pb.TIER_USER: len("Ada is a staff engineer"),
    }


def test_list_keeps_insertion_order_and_filters_by_category(sidecar: Running) -> None:
    contents = ["zeta fact", "alpha fact", "mid fact", "another alpha"]
    categories = ["b", "a", "b", "a"]
    ids = [
        sidecar.add(c, scope=AGENT, category=k).memory.id
        for c, k in zip(contents, categories, strict=True)
    ]

    listed = sidecar.list(scope=AGENT)
    assert [m.id for m in listed.memories] == ids
    only_a = sidecar.list(scope=AGENT, category="a")
    assert [m.content for m in only_a.memories] == ["alpha fact", "another alpha"]
    # Usage always covers the whole tier, whatever the category filter.
    assert only_a.usage[0].entry_count == 4


def test_usage_counts_the_rendered_separator(sidecar: Running) -> None:
    sidecar.add("abc", scope=AGENT)
    response = sidecar.add("defg", scope=AGENT)
    # "abc" + "\n§\n" + "defg"
    assert response.usage.used_chars == 3 + 3 + 4
    assert response.usage.entry_count == 2


def test_identical_content_returns_the_existing_entry(sidecar: Running) -> None:
    first = sidecar.add("Prefers tabs", scope=AGENT, tier=pb.TIER_USER)
    again = sidecar.add("  Prefers tabs \n", scope=AGENT, tier=pb.TIER_USER, category="x")

    assert not again.created
    assert again.memory == first.memory
    assert again.usage == first.usage
    assert len(sidecar.list(scope=AGENT).memories) == 1
    # The same text in the other tier is a different entry.
    other = sidecar.add("Prefers tabs", scope=AGENT, tier=pb.TIER_MEMORY)
    assert other.created
    assert other.memory.id != first.memory.id


def test_update_changes_only_the_fields_given(sidecar: Running) -> None:
    original = sidecar.add(
        "Deploys go to eu-west-1", scope=AGENT, category="infra", confidence=0.5
    ).memory
    time.sleep(0.002)

    content_only = sidecar.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=AGENT, id=original.id, content="Deploys go to eu-west-2")
    )
    assert content_only.memory.content == "Deploys go to eu-west-2"
    assert content_only.memory.category == "infra"
    assert content_only.memory.confidence == pytest.approx(0.5)
    assert content_only.memory.created_at == original.created_at
    assert content_only.memory.updated_at.ToNanoseconds() > original.updated_at.ToNanoseconds()
    assert content_only.usage.used_chars == len("Deploys go to eu-west-2")

    rest = sidecar.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=AGENT, id=original.id, category="", confidence=0.0)
    )
    assert rest.memory.content == "Deploys go to eu-west-2"
    assert rest.memory.category == ""
    assert rest.memory.confidence == 0.0
    assert sidecar.list(scope=AGENT).memories == [rest.memory]


def test_update_to_another_entrys_content_is_refused(sidecar: Running) -> None:
    first = sidecar.add("The repo uses uv", scope=AGENT).memory
    second = sidecar.add("The repo uses pip", scope=AGENT).memory
    before = sidecar.list(scope=AGENT)
    error = refused(
        sidecar.stub.UpdateMemory,
        pb.UpdateMemoryRequest(scope=AGENT, id=second.id, content="The repo uses uv"),
    )
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    info = error_info(error)
    assert info.reason == "DUPLICATE_CONTENT"
    assert dict(info.metadata) == {"id": second.id, "existing_id": first.id}
    assert sidecar.list(scope=AGENT) == before
    # Its own text again, or the same text in the other tier, is fine.
    same = pb.UpdateMemoryRequest(scope=AGENT, id=first.id, content="The repo uses uv")
    assert sidecar.stub.UpdateMemory(same).memory.content == "The repo uses uv"
    user = sidecar.add("Ada likes pip", scope=AGENT, tier=pb.TIER_USER).memory
    moved = pb.UpdateMemoryRequest(scope=AGENT, id=user.id, content="The repo uses uv")
    assert sidecar.stub.UpdateMemory(moved).memory.content == "The repo uses uv"


def test_delete_returns_the_entry_and_frees_its_budget(sidecar: Running) -> None:
    keep = sidecar.add("keep me", scope=AGENT).memory
    gone = sidecar.add("delete me", scope=AGENT).memory

    response = sidecar.stub.DeleteMemory(pb.DeleteMemoryRequest(scope=AGENT, id=gone.id))

    assert response.memory == gone
    assert response.usage.entry_count == 1
    assert response.usage.used_chars == len("keep me")
    assert [m.id for m in sidecar.list(scope=AGENT).memories] == [keep.id]


def test_scopes_never_see_or_change_each_other(sidecar: Running) -> None:
    mine = pb.Scope(agent_id="coder", user_id="ada")
    other_agent = pb.Scope(agent_id="writer", user_id="ada")
    other_user = pb.Scope(agent_id="coder", user_id="grace")

    note = sidecar.add("coder's note", scope=mine).memory
    profile = sidecar.add("Ada likes short answers", scope=mine, tier=pb.TIER_USER).memory

    # The user profile is shared by every agent serving that user...
    seen_by_writer = sidecar.list(scope=other_agent)
    assert [m.id for m in seen_by_writer.memories] == [profile.id]
    # ...and agent notes are shared by every user of that agent.
    seen_for_grace = sidecar.list(scope=other_user)
    assert [m.id for m in seen_for_grace.memories] == [note.id]
    # A scope with neither owner sees nothing, and the default scope is its own.
    assert list(sidecar.list(scope=pb.Scope(agent_id="x", user_id="y")).memories) == []
    assert list(sidecar.list().memories) == []

    stranger = pb.Scope(agent_id="x", user_id="y")
    for call, request in [
        (
            sidecar.stub.UpdateMemory,
            pb.UpdateMemoryRequest(scope=stranger, id=note.id, content="hijacked"),
        ),
        (sidecar.stub.DeleteMemory, pb.DeleteMemoryRequest(scope=stranger, id=profile.id)),
        (
            sidecar.stub.UpdateMemory,
            pb.UpdateMemoryRequest(scope=other_user, id=profile.id, content="hijacked"),
        ),
    ]:
        with pytest.raises(grpc.RpcError) as raised:
            call(request)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert [m.content for m in sidecar.list(scope=mine).memories] == [
        "coder's note",
        "Ada likes short answers",
    ]
    found = sidecar.stub.SearchMemories(pb.SearchMemoriesRequest(scope=stranger, query="coder"))
    assert list(found.hits) == []


def test_default_scope_works_with_empty_ids(sidecar: Running) -> None:
    added = sidecar.add("default scope note")
    assert [m.id for m in sidecar.list(scope=pb.Scope()).memories] == [added.memory.id]
    assert list(sidecar.list(scope=pb.Scope(agent_id="someone")).memories) == []


def test_a_profile_write_without_a_user_id_is_refused(make_sidecar: MakeSidecar) -> None:
    # It would land in the one profile every caller without a user id shares.
    running = make_sidecar()
    request = pb.AddMemoryRequest(
        scope=pb.Scope(agent_id="coder"), tier=pb.TIER_USER, content="Prefers tabs"
    )
    error = refused(running.stub.AddMemory, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(error)
    assert info.reason == "USER_ID_REQUIRED"
    assert info.metadata["field"] == "scope.user_id"
    assert "shared_user_profile" in (error.details() or "")
    listed = running.list(scope=pb.Scope(agent_id="coder"))
    assert list(listed.memories) == []
    # With a user id it is that user's profile; the agent may also mean the
    # shared one.
    ada = pb.Scope(agent_id="coder", user_id="ada")
    running.stub.AddMemory(pb.AddMemoryRequest(scope=ada, tier=pb.TIER_USER, content="Tabs"))
    shared = make_sidecar("defaults:\n  shared_user_profile: true\n", name="shared.db")
    added = shared.stub.AddMemory(request)
    assert added.memory.content == "Prefers tabs"


def test_search_ranks_matches_and_filters(sidecar: Running) -> None:
    a = sidecar.add("Caroline moved to Berlin", scope=AGENT).memory
    b = sidecar.add("Berlin office opens in May", scope=AGENT, tier=pb.TIER_USER).memory
    c = sidecar.add("Caroline adopted a dog in Berlin", scope=AGENT).memory
    sidecar.add("unrelated", scope=AGENT)

    hits = sidecar.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=AGENT, query="caroline BERLIN")
    ).hits
    assert [h.memory.id for h in hits] == [a.id, c.id, b.id]
    assert hits[0].score == pytest.approx(1.0)  # best similarity, confidence 1.0
    # No length normalisation: a and c match the same words equally, and
    # the tie breaks by insertion order; b matches one word only.
    assert hits[0].score == hits[1].score > hits[2].score

    user_only = sidecar.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=AGENT, query="berlin", tier=pb.TIER_USER)
    ).hits
    assert [h.memory.id for h in user_only] == [b.id]

    all_terms = sidecar.stub.SearchMemories(
        pb.SearchMemoriesRequest(scope=AGENT, query="caroline dog", match_all=True)
    ).hits
    assert [h.memory.id for h in all_terms] == [c.id]

    capped = sidecar.stub.SearchMemories(pb.SearchMemoriesRequest(scope=AGENT, limit=2)).hits
    assert len(capped) == 2
    everything = sidecar.stub.SearchMemories(pb.SearchMemoriesRequest(scope=AGENT)).hits
    assert len(everything) == 4
