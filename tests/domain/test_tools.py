"""sidecar.domain.tools over gRPC: ListTools and CallTool, on every backend.

The definitions must be usable as they are by OpenAI's and Anthropic's APIs
(checked against their shapes and as JSON Schema), and every call's text
must tell the model what happened and what each tier holds.
"""

from __future__ import annotations

import json
from typing import Any, cast

import grpc
import jsonschema
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.config.settings import Config
from sidecar.core.errors import DatabaseReadOnly, EditConflict, SidecarError, StoreError
from sidecar.core.memory import Memory, Scope, Tier
from sidecar.domain.engine import MemoryEngine
from sidecar.domain.tools import Tools
from sidecar.storage.writes import Edit, NewEntry
from tests.conftest import (
    CALL_SECONDS,
    ROOT,
    MakeEngine,
    MakeSidecar,
    Running,
    contents,
    error_info,
    refused,
)

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")


def tools(running: Running, scope: pb.Scope = SCOPE) -> dict[str, pb.Tool]:
    listed = running.stub.ListTools(pb.ListToolsRequest(scope=scope), timeout=CALL_SECONDS)
    return {tool.name: tool for tool in listed.tools}


def call(
    running: Running, name: str, raw: str | None = None, **arguments: Any
) -> tuple[pb.CallToolResponse, dict[str, Any]]:
    """One CallTool in SCOPE with these arguments (any name, `scope` too,
    is the model's argument: the runtime's scope is SCOPE)."""
    request = pb.CallToolRequest(
        scope=SCOPE,
        session_id="s1",
        name=name,
        arguments_json=json.dumps(arguments) if raw is None else raw,
    )
    response = running.stub.CallTool(request, timeout=CALL_SECONDS)
    return response, json.loads(response.structured_json)


def test_the_tools_are_defined_in_shapes_openai_and_anthropic_take(sidecar: Running) -> None:
    listed = tools(sidecar)
    assert list(listed) == ["memory", "memory_search", "memory_list"]
    for tool in listed.values():
        schema = json.loads(tool.input_schema_json)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object"
        # No scope can be named by the model.
        assert schema["additionalProperties"] is False
        assert not {"agent_id", "user_id", "scope"} & set(schema["properties"])
        assert json.loads(tool.openai_json) == {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": schema},
        }
        assert json.loads(tool.anthropic_json) == {
            "name": tool.name,
            "description": tool.description,
            "input_schema": schema,
        }
    memory = json.loads(listed["memory"].input_schema_json)
    assert memory["properties"]["action"]["enum"] == ["add", "replace", "remove"]
    assert memory["properties"]["target"]["enum"] == ["memory", "user"]
    # The descriptions teach the budgets of the caller's agent.
    assert "2,200" in listed["memory"].description
    assert "1,375" in listed["memory"].description


def test_the_budgets_in_the_descriptions_are_the_agents_own(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("agents: {tiny: {memory_char_limit: 300, user_profile_enabled: false}}")
    described = tools(running, pb.Scope(agent_id="tiny"))["memory"].description
    assert "memory: 300 characters" in described
    assert "user: switched off" in described


def test_add_saves_and_every_result_carries_the_tiers_usage(sidecar: Running) -> None:
    response, outcome = call(sidecar, "memory", action="add", content="Repo uses uv")
    assert not response.is_error
    assert (
        response.text == "Saved to agent notes (target=memory) [0% — 12/2,200 chars]: Repo uses uv"
    )
    assert outcome["ok"]
    assert outcome["created"]
    assert outcome["memory"]["content"] == "Repo uses uv"
    assert outcome["usage"] == {"memory": {"used_chars": 12, "limit_chars": 2200, "entry_count": 1}}
    user, _ = call(
        sidecar, "memory", action="add", target="user", content="Ada is a staff engineer"
    )
    assert user.text.startswith("Saved to user profile (target=user) [1% — 23/1,375 chars]")
    again, outcome = call(sidecar, "memory", action="add", content="Repo uses uv")
    assert not again.is_error
    assert not outcome["created"]
    assert again.text.startswith("Already saved")
    assert contents(sidecar, SCOPE) == ["Repo uses uv", "Ada is a staff engineer"]


def test_a_full_tier_is_a_tool_error_listing_the_entries_and_what_to_do(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 60}")
    call(running, "memory", action="add", content="Deploys go through ArgoCD")
    call(running, "memory", action="add", content="CI runs on Debian")
    before = contents(running, SCOPE)
    response, outcome = call(
        running, "memory", action="add", content="The staging cluster lives in eu-west-1"
    )
    assert response.is_error
    assert "Not saved: agent notes (target=memory) is full [45/60 chars]" in response.text
    assert "1. (25 chars) Deploys go through ArgoCD" in response.text
    assert "2. (17 chars) CI runs on Debian" in response.text
    assert "action=remove" in response.text
    assert "action=replace" in response.text
    assert outcome["error"]["reason"] == "TIER_BUDGET_EXCEEDED"
    assert [m["content"] for m in outcome["memories"]] == before
    assert contents(running, SCOPE) == before


def test_arguments_cannot_name_another_scope(sidecar: Running) -> None:
    other = pb.Scope(agent_id="victim", user_id="bob")
    sidecar.add("the victim's note", scope=other)
    for sneaky in ({"agent_id": "victim"}, {"user_id": "bob"}, {"scope": {"agent_id": "victim"}}):
        response, outcome = call(sidecar, "memory", action="add", content="planted", **sneaky)
        assert response.is_error
        assert outcome["error"]["reason"] == "ARGUMENTS_INVALID"
        assert "set by the connection" in response.text
        listed, _ = call(sidecar, "memory_list", **sneaky)
        assert listed.is_error
    assert contents(sidecar, other) == ["the victim's note"]
    assert contents(sidecar, SCOPE) == []


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"action": "add"}, "`content` is required"),
        ({"action": "add", "content": "   "}, "content is empty"),
        ({"action": "add", "content": 7}, "`content` must be a string"),
        ({"action": "erase", "content": "x"}, "`action` must be one of add, replace, remove"),
        ({"action": "add", "target": "team", "content": "x"}, "`target` must be one of"),
        ({"action": "replace", "new_text": "x"}, "`old_text` is required"),
        ({"action": "replace", "old_text": "x"}, "`new_text` is required"),
        (
            {"action": "replace", "old_text": "x", "new_text": "y", "content": "y"},
            "replace takes `old_text` and `new_text` (only the quoted text changes)",
        ),
        ({"action": "remove", "old_text": " "}, "`old_text` is empty"),
        ({"action": "add", "content": "x" * 70_000}, "content is 70,000 characters long"),
    ],
)
def test_a_models_mistake_is_a_tool_error_and_changes_nothing(
    sidecar: Running, arguments: dict[str, Any], expected: str
) -> None:
    response, outcome = call(sidecar, "memory", **arguments)
    assert response.is_error
    assert expected in response.text
    assert outcome["ok"] is False
    assert contents(sidecar, SCOPE) == []


def test_arguments_that_are_not_a_json_object_are_a_tool_error(sidecar: Running) -> None:
    for raw in ("{not json", "[1, 2]", '"add"'):
        response, outcome = call(sidecar, "memory", raw=raw)
        assert response.is_error
        assert outcome["error"]["reason"] == "ARGUMENTS_INVALID"
    # No arguments at all is an empty object: memory_list takes none.
    listed, _ = call(sidecar, "memory_list", raw="")
    assert not listed.is_error


def test_an_unknown_tool_is_the_runtimes_error(sidecar: Running) -> None:
    error = refused(
        sidecar.stub.CallTool, pb.CallToolRequest(scope=SCOPE, name="memory_delete_all")
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(error).reason == "TOOL_UNKNOWN"


def test_search_and_list_show_the_entries_and_the_usage(sidecar: Running) -> None:
    call(sidecar, "memory", action="add", content="Deploy target is AWS us-east-1")
    call(sidecar, "memory", action="add", content="CI runs on Debian bookworm")
    call(sidecar, "memory", action="add", target="user", content="Ada prefers dark mode")
    found, outcome = call(sidecar, "memory_search", query="where do we deploy?")
    assert not found.is_error
    assert found.text.splitlines()[0] == (
        "1 match (memory [2% — 59/2,200 chars], user [1% — 21/1,375 chars]):"
    )
    assert found.text.splitlines()[1] == "1. [memory] Deploy target is AWS us-east-1"
    assert [hit["content"] for hit in outcome["hits"]] == ["Deploy target is AWS us-east-1"]
    none, _ = call(sidecar, "memory_search", query="kubernetes", target="user")
    assert none.text == "No matches (user [1% — 21/1,375 chars])."
    listed, outcome = call(sidecar, "memory_list", target="memory")
    assert listed.text.splitlines() == [
        "agent notes (target=memory) [2% — 59/2,200 chars]:",
        "1. (30 chars) Deploy target is AWS us-east-1",
        "2. (26 chars) CI runs on Debian bookworm",
    ]
    assert outcome["usage"]["memory"]["entry_count"] == 2
    both, _ = call(sidecar, "memory_list")
    assert "user profile (target=user) [1% — 21/1,375 chars]:" in both.text
    bad, _ = call(sidecar, "memory_search", query="x", limit=0)
    assert bad.is_error
    assert "`limit` must be between 1 and 50" in bad.text


def test_writes_through_tools_refresh_the_frozen_block_as_grpc_writes_do(
    sidecar: Running,
) -> None:
    sidecar.add("Repo uses uv", scope=SCOPE)
    first = sidecar.turn("s", scope=SCOPE)
    assert sidecar.turn("s", scope=SCOPE).cache_hit
    call(sidecar, "memory", action="add", content="CI runs on Debian")
    after = sidecar.turn("s", scope=SCOPE)
    assert not after.cache_hit
    assert "CI runs on Debian" in after.system_block
    assert after.system_block != first.system_block
    # Byte-identical again until the next write; a search writes nothing.
    call(sidecar, "memory_search", query="Debian")
    again = sidecar.turn("s", scope=SCOPE)
    assert again.cache_hit
    assert again.system_block == after.system_block


def test_under_on_compaction_a_tool_write_waits_for_compaction(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {snapshot_refresh: on_compaction}")
    running.add("Repo uses uv", scope=SCOPE)
    first = running.turn("s", scope=SCOPE)
    call(running, "memory", action="add", content="CI runs on Debian")
    held = running.turn("s", scope=SCOPE)
    assert held.system_block == first.system_block
    running.stub.NotifyCompaction(pb.NotifyCompactionRequest(scope=SCOPE, session_id="s"))
    assert "CI runs on Debian" in running.turn("s", scope=SCOPE).system_block


def test_docs_api_names_every_tool_and_argument(sidecar: Running) -> None:
    text = (ROOT / "docs" / "API.md").read_text()
    section = text.split("## Tools for the model", 1)[1].split("\n## ", 1)[0]
    for name, tool in tools(sidecar).items():
        row = next(line for line in section.splitlines() if line.startswith(f"| `{name}` |"))
        for argument in json.loads(tool.input_schema_json)["properties"]:
            assert f"`{argument}`" in row, (name, argument)


def test_replace_and_remove_find_the_entry_by_its_text(sidecar: Running) -> None:
    call(sidecar, "memory", action="add", content="Deploy target is AWS us-east-1")
    call(sidecar, "memory", action="add", target="user", content="Ada prefers dark mode")
    replaced, outcome = call(
        sidecar, "memory", action="replace", old_text="us-east-1", new_text="eu-west-1"
    )
    assert not replaced.is_error
    assert replaced.text == (
        "Replaced in agent notes (target=memory) [1% — 30/2,200 chars]: "
        "now 'Deploy target is AWS eu-west-1' (was 'Deploy target is AWS us-east-1')"
    )
    assert outcome["action"] == "replace"
    assert outcome["previous"] == "Deploy target is AWS us-east-1"
    assert outcome["memory"]["content"] == "Deploy target is AWS eu-west-1"
    # The user tier is searched only with target=user.
    missing, outcome = call(sidecar, "memory", action="remove", old_text="dark mode")
    assert missing.is_error
    assert outcome["error"]["reason"] == "MATCH_NOT_FOUND"
    assert "memory_list or memory_search" in missing.text
    removed, _ = call(sidecar, "memory", action="remove", target="user", old_text="dark mode")
    assert removed.text == (
        "Removed from user profile (target=user) [0% — 0/1,375 chars]: 'Ada prefers dark mode'"
    )
    assert contents(sidecar, SCOPE) == ["Deploy target is AWS eu-west-1"]


def test_replace_changes_only_the_quoted_text(sidecar: Running) -> None:
    # Issue 33: a whole-entry swap turned this note into "pg-staging-3".
    note = "Staging DB host is pg-staging-2; production DB host is pg-prod-1; both need VPN."
    call(sidecar, "memory", action="add", content=note)
    response, outcome = call(
        sidecar, "memory", action="replace", old_text="pg-staging-2", new_text="pg-staging-3"
    )
    assert not response.is_error
    changed = note.replace("pg-staging-2", "pg-staging-3")
    assert contents(sidecar, SCOPE) == [changed]
    assert response.text.endswith(f"now {changed!r} (was {note!r})")
    assert outcome["previous"] == note
    # An empty new_text deletes the quoted words; the rest stays.
    call(sidecar, "memory", action="replace", old_text="; both need VPN", new_text="")
    assert contents(sidecar, SCOPE) == [changed.replace("; both need VPN", "")]


def test_text_in_the_other_target_is_pointed_to(sidecar: Running) -> None:
    call(sidecar, "memory", action="add", target="user", content="Ada prefers dark mode")
    response, outcome = call(
        sidecar, "memory", action="replace", old_text="dark mode", new_text="light mode"
    )
    assert response.is_error
    assert outcome["error"]["reason"] == "MATCH_NOT_FOUND"
    assert outcome["error"]["other_target"] == "user"
    assert "it is in user profile (target=user): call again with target=user" in response.text
    # Where it is in neither, nothing is pointed to.
    nowhere, outcome = call(sidecar, "memory", action="remove", old_text="Kubernetes")
    assert "other_target" not in outcome["error"]
    assert "call again with target" not in nowhere.text
    assert contents(sidecar, SCOPE) == ["Ada prefers dark mode"]


def test_a_missing_old_text_lists_the_entries_to_quote(sidecar: Running) -> None:
    empty, _ = call(sidecar, "memory", action="remove")
    assert "`old_text` is required here: quote the text of the entry to remove" in empty.text
    assert empty.text.endswith("Agent notes (target=memory) has no entries to remove.")
    for text in ("CI runs on Debian", "Deploys go through ArgoCD"):
        call(sidecar, "memory", action="add", content=text)
    response, outcome = call(sidecar, "memory", action="replace", new_text="Ubuntu")
    assert response.is_error
    assert outcome["error"]["reason"] == "ARGUMENTS_INVALID"
    assert response.text.splitlines()[1:] == [
        "1. CI runs on Debian",
        "2. Deploys go through ArgoCD",
        "Quote part of one of them as old_text.",
    ]
    assert "The entries of agent notes (target=memory):" in response.text.splitlines()[0]
    assert contents(sidecar, SCOPE) == ["CI runs on Debian", "Deploys go through ArgoCD"]


def test_old_text_twice_in_one_entry_is_refused_and_changes_nothing(sidecar: Running) -> None:
    call(sidecar, "memory", action="add", content="Ports: api 5433, replica 5433")
    response, outcome = call(sidecar, "memory", action="replace", old_text="5433", new_text="6543")
    assert response.is_error
    assert outcome["error"]["reason"] == "ARGUMENTS_INVALID"
    assert "`old_text` occurs 2 times in the entry 'Ports: api 5433, replica 5433'" in (
        response.text
    )
    assert "nothing was changed" in response.text
    assert contents(sidecar, SCOPE) == ["Ports: api 5433, replica 5433"]
    # A one-character old_text is held to the same rule: never a rewrite.
    single, _ = call(sidecar, "memory", action="replace", old_text="a", new_text="A")
    assert single.is_error
    assert "`old_text` occurs 2 times in the entry" in single.text
    assert contents(sidecar, SCOPE) == ["Ports: api 5433, replica 5433"]


def test_a_replace_raced_by_another_writer_is_computed_again(make_engine: MakeEngine) -> None:
    # Another writer changes the entry between the tool's read and its write:
    # the write is refused (EDIT_CONFLICT), the tool reads again, and both
    # changes survive. The read is wrapped only to place the other write.
    engine, _, _ = make_engine()
    scope = Scope("coder")
    engine.add(NewEntry(scope, Tier.MEMORY, "api on port 5433, cache on port 6379"))
    read = engine.holding
    raced: list[str] = []

    def holding(scope: Scope, tier: Tier, match: str) -> Memory:
        entry = read(scope, tier, match)
        if not raced:
            edit = Edit(scope, match="6379", tier=tier, content=entry.content + "!")
            raced.append(engine.update(edit)[0].content)
        return entry

    engine.holding = holding  # type: ignore[method-assign]
    result = Tools(engine, Config().server.limits()).call(
        scope, "s1", "memory", {"action": "replace", "old_text": "5433", "new_text": "5434"}
    )
    assert not result.is_error, result.text
    assert raced == ["api on port 5433, cache on port 6379!"]
    assert result.structured["previous"] == "api on port 5433, cache on port 6379!"
    memories, _ = engine.list_memories(scope, [Tier.MEMORY], "")
    assert [m.content for m in memories] == ["api on port 5434, cache on port 6379!"]


def test_an_edit_from_stale_content_is_refused_and_changes_nothing(
    make_engine: MakeEngine,
) -> None:
    engine, _, _ = make_engine()
    scope = Scope("coder")
    engine.add(NewEntry(scope, Tier.MEMORY, "uses uv"))
    stale = Edit(scope, match="uv", tier=Tier.MEMORY, content="uses pip", expected="uses")
    with pytest.raises(EditConflict) as refused_edit:
        engine.update(stale)
    assert refused_edit.value.code == "ABORTED"
    assert refused_edit.value.reason == "EDIT_CONFLICT"
    memories, _ = engine.list_memories(scope, [Tier.MEMORY], "")
    assert [m.content for m in memories] == ["uses uv"]


def test_an_ambiguous_old_text_lists_the_candidates_and_changes_nothing(sidecar: Running) -> None:
    for text in ("CI runs on Debian", "Staging runs on Debian too", "Prod runs on Alpine"):
        call(sidecar, "memory", action="add", content=text)
    before = contents(sidecar, SCOPE)
    response, outcome = call(
        sidecar, "memory", action="replace", old_text="Debian", new_text="Ubuntu"
    )
    assert response.is_error
    assert response.text.splitlines() == [
        "Not changed: old_text occurs in 2 entries:",
        "- 'CI runs on Debian'",
        "- 'Staging runs on Debian too'",
        "Quote more of the one you mean as old_text.",
    ]
    assert outcome["error"]["reason"] == "AMBIGUOUS_MATCH"
    assert contents(sidecar, SCOPE) == before
    exact, _ = call(
        sidecar, "memory", action="replace", old_text="CI runs on Debian", new_text="CI: Ubuntu"
    )
    assert not exact.is_error
    assert contents(sidecar, SCOPE) == [
        "CI: Ubuntu",
        "Staging runs on Debian too",
        "Prod runs on Alpine",
    ]


def test_a_replace_that_overflows_lists_the_entries(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 40}")
    call(running, "memory", action="add", content="CI runs on Debian")
    call(running, "memory", action="add", content="Tags by CI")
    response, outcome = call(
        running, "memory", action="replace", old_text="Debian", new_text="Debian 12 bookworm"
    )
    assert response.is_error
    assert outcome["error"]["reason"] == "TIER_BUDGET_EXCEEDED"
    # Counts are numbers in the data, as in `usage`.
    assert outcome["error"]["used_chars"] == 30
    assert outcome["error"]["requested_chars"] == 12
    assert "1. (17 chars) CI runs on Debian" in response.text
    assert contents(running, SCOPE) == ["CI runs on Debian", "Tags by CI"]


def test_an_entry_longer_than_the_whole_budget_says_to_shorten_it(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 40}")
    call(running, "memory", action="add", content="CI runs on Debian")
    response, outcome = call(running, "memory", action="add", content="x" * 45)
    assert response.is_error
    assert response.text == (
        "Not done: this entry is 45 characters and the whole agent notes budget is 40: "
        "shorten it to at most 40 characters; removing entries cannot make room."
    )
    assert outcome["error"]["reason"] == "ENTRY_TOO_LARGE"
    assert outcome["error"]["entry_chars"] == 45
    assert outcome["error"]["limit_chars"] == 40
    assert contents(running, SCOPE) == ["CI runs on Debian"]


def test_a_full_tier_explains_the_separator_in_what_an_add_needs(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 30}")
    call(running, "memory", action="add", content="CI runs on Debian")
    response, outcome = call(running, "memory", action="add", content="Tags by CI!")
    assert response.is_error
    assert (
        "This needs 14 more characters (11 for the entry, 3 for the separator between "
        "entries) and 13 are free." in response.text
    )
    assert outcome["error"]["requested_chars"] == 14


def test_a_near_duplicate_is_reported_or_refused_as_the_agent_says(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("agents: {strict: {similar_writes: refuse}}")
    call(running, "memory", action="add", target="user", content="User prefers dark mode")
    response, outcome = call(
        running, "memory", action="add", target="user", content="The user prefers dark mode"
    )
    assert not response.is_error
    assert "It nearly repeats 'User prefers dark mode'" in response.text
    assert [s["content"] for s in outcome["similar"]] == ["User prefers dark mode"]

    strict = pb.Scope(agent_id="strict", user_id="bob")
    request = pb.CallToolRequest(
        scope=strict,
        name="memory",
        arguments_json=json.dumps({"action": "add", "content": "Deploys go through ArgoCD"}),
    )
    assert not running.stub.CallTool(request, timeout=CALL_SECONDS).is_error
    request.arguments_json = json.dumps({"action": "add", "content": "Deploys go via ArgoCD"})
    refused_add = running.stub.CallTool(request, timeout=CALL_SECONDS)
    assert refused_add.is_error
    assert "already holds a similar entry: 'Deploys go through ArgoCD'" in refused_add.text
    assert json.loads(refused_add.structured_json)["error"]["reason"] == "SIMILAR_MEMORY"
    assert contents(running, strict) == ["Deploys go through ArgoCD"]


def test_docs_api_shows_each_schema_exactly(sidecar: Running) -> None:
    text = (ROOT / "docs" / "API.md").read_text()
    section = text.split("## Tools for the model", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```json\n")[1:]
    shown = [json.loads(block.split("```", 1)[0]) for block in blocks]
    assert shown == [json.loads(t.input_schema_json) for t in tools(sidecar).values()]


class _Failing:
    """An engine whose searches fail with one error."""

    def __init__(self, error: SidecarError) -> None:
        self.error = error

    def search(self, *args: Any, **kwargs: Any) -> None:
        raise self.error


def _search_failing_with(error: SidecarError) -> Any:
    engine = cast(MemoryEngine, _Failing(error))
    tools = Tools(engine, Config().server.limits())
    return tools.call(Scope("coder"), "s1", "memory_search", {"query": "uv"})


def test_a_database_the_operator_must_mend_is_the_runtimes_error() -> None:
    # A StoreError is a FAILED_PRECONDITION, but not the model's to fix.
    with pytest.raises(StoreError):
        _search_failing_with(StoreError("schema version 99, newer than this code"))
    # A read-only database has always been a tool error.
    result = _search_failing_with(DatabaseReadOnly("memory.db cannot be written"))
    assert result.is_error
    assert result.structured["error"]["reason"] == "DATABASE_READ_ONLY"
