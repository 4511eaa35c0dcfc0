"""sidecar.domain.receipts: a tool call answers the highest generation its
writes took, over gRPC (CallTool's `generation`) and in the domain.

A generation is placed by the writes around it: an AddMemory before a tool
call answers less than the call, one after it more, so the call's answer is
the generation of its own write (the largest, when it wrote several).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.config.settings import Config
from sidecar.core.memory import Scope, Tier
from sidecar.domain.receipts import receipt, recording
from sidecar.domain.tools import Tools
from sidecar.storage.writes import NewEntry
from tests.conftest import CALL_SECONDS, MakeEngine, MakeSidecar, Running, contents

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
NOTES = "/memories/notes.md"


def call(running: Running, name: str, **arguments: Any) -> pb.CallToolResponse:
    request = pb.CallToolRequest(
        scope=SCOPE, session_id="s1", name=name, arguments_json=json.dumps(arguments)
    )
    response: pb.CallToolResponse = running.stub.CallTool(request, timeout=CALL_SECONDS)
    return response


def added(running: Running, content: str) -> int:
    """The generation an AddMemory in SCOPE answers."""
    return int(running.add(content, scope=SCOPE).generation)


def test_a_memory_tool_write_answers_its_generation(sidecar: Running) -> None:
    before = added(sidecar, "The repo uses uv")
    saved = call(sidecar, "memory", action="add", content="Deploys go through ArgoCD")
    assert not saved.is_error
    assert saved.generation > before
    changed = call(sidecar, "memory", action="replace", old_text="ArgoCD", new_text="Flux")
    assert not changed.is_error
    assert changed.generation > saved.generation
    removed = call(sidecar, "memory", action="remove", old_text="Flux")
    assert not removed.is_error
    assert removed.generation > changed.generation
    assert added(sidecar, "CI runs on Debian") > removed.generation
    # An entry already saved answers as AddMemory does: a generation a read
    # sees it at (the tier's current one), never 0.
    again = call(sidecar, "memory", action="add", content="The repo uses uv")
    assert not again.is_error
    assert again.generation >= before
    assert contents(sidecar, SCOPE, min_generation=again.generation) == [
        "The repo uses uv",
        "CI runs on Debian",
    ]


def test_reads_and_refusals_answer_no_generation(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 60}")
    assert call(running, "memory", action="add", content="Deploys go through ArgoCD").generation
    for name, arguments in [
        ("memory_search", {"query": "ArgoCD"}),
        ("memory_list", {}),
        ("memory_20250818", {"command": "view", "path": NOTES}),
    ]:
        read = call(running, name, **arguments)
        assert not read.is_error, read.text
        assert read.generation == 0, name
    full = call(running, "memory", action="add", content="The staging cluster is in eu-west-1")
    assert full.is_error
    assert "is full" in full.text
    assert full.generation == 0
    mistaken = call(running, "memory", action="remove", old_text="no such text")
    assert mistaken.is_error
    assert mistaken.generation == 0
    unknown = call(running, "memory", action="add", content="x", scope="other")
    assert unknown.is_error
    assert unknown.generation == 0


def test_claudes_memory_tool_answers_the_highest_of_its_writes(sidecar: Running) -> None:
    before = added(sidecar, "The repo uses uv")
    # notes.md holds that entry: create is refused, and wrote nothing.
    exists = call(sidecar, "memory_20250818", command="create", path=NOTES, file_text="x")
    assert exists.is_error
    assert exists.generation == 0
    user = "/memories/user.md"
    created = call(
        sidecar,
        "memory_20250818",
        command="create",
        path=user,
        file_text="Ada is a staff engineer\nAda prefers tabs\nAda reviews on Fridays",
    )
    assert not created.is_error, created.text
    after = added(sidecar, "CI runs on Debian")
    assert before < created.generation < after
    inserted = call(
        sidecar,
        "memory_20250818",
        command="insert",
        path=NOTES,
        insert_line=2,
        insert_text="Deploys go through ArgoCD\nStaging is in eu-west-1",
    )
    assert not inserted.is_error, inserted.text
    assert inserted.generation > after
    edited = call(
        sidecar, "memory_20250818", command="str_replace", path=NOTES, old_str="uv", new_str="pip"
    )
    assert not edited.is_error, edited.text
    assert edited.generation > inserted.generation
    # The files' names are fixed: rename and delete are refused, and write nothing.
    renamed = call(
        sidecar, "memory_20250818", command="rename", old_path=NOTES, new_path="/memories/a.md"
    )
    deleted = call(sidecar, "memory_20250818", command="delete", path=NOTES)
    assert renamed.is_error
    assert deleted.is_error
    assert renamed.generation == deleted.generation == 0


def test_a_call_answers_the_largest_of_several_writes(make_engine: MakeEngine) -> None:
    # On SQLite each write takes the largest generation so far plus one: a
    # create of three lines after a write at g answers g + 3.
    engine, _, _ = make_engine()
    scope, tools = Scope("coder", "ada"), Tools(engine, Config().server.limits())
    first = engine.add(NewEntry(scope, Tier.MEMORY, "The repo uses uv")).generation
    result = tools.call(
        scope,
        "s1",
        "memory_20250818",
        {"command": "create", "path": "/memories/user.md", "file_text": "a one\nb two\nc three"},
    )
    assert not result.is_error, result.text
    assert result.generation == first + 3
    assert engine.add(NewEntry(scope, Tier.MEMORY, "CI runs on Debian")).generation == first + 4


def test_a_call_refused_after_a_write_answers_that_writes_generation(
    make_engine: MakeEngine,
) -> None:
    # The second line nearly repeats the first, which this agent refuses:
    # the call is an error, but the first line was saved and its generation
    # is what a read needs to see it.
    engine, _, _ = make_engine("defaults: {similar_writes: refuse}")
    scope, tools = Scope("coder", "ada"), Tools(engine, Config().server.limits())
    first = engine.add(NewEntry(scope, Tier.USER, "Ada is a staff engineer")).generation
    result = tools.call(
        scope,
        "s1",
        "memory_20250818",
        {
            "command": "insert",
            "path": NOTES,
            "insert_line": 0,
            "insert_text": "Deploys go through ArgoCD\nDeploys go via ArgoCD",
        },
    )
    assert result.is_error
    assert "similar entry" in result.text
    memories, _ = engine.list_memories(scope, [Tier.MEMORY], "")
    assert [m.content for m in memories] == ["Deploys go through ArgoCD"]
    assert result.generation == first + 1


def test_writes_are_noted_only_on_an_open_receipt(make_engine: MakeEngine) -> None:
    engine, _, _ = make_engine()
    scope, noting = Scope("coder"), recording(engine)
    outside = noting.add(NewEntry(scope, Tier.MEMORY, "The repo uses uv"))
    with receipt() as written:
        assert written.highest == 0
        # A read is the engine's own, and notes nothing.
        memories, _ = noting.list_memories(scope, [Tier.MEMORY], "")
        assert [m.content for m in memories] == ["The repo uses uv"]
        assert written.highest == 0
        inside = noting.add(NewEntry(scope, Tier.MEMORY, "CI runs on Debian")).generation
        gone = noting.delete(scope, outside.memory.id)[2]
    assert outside.generation < inside < gone
    assert written.highest == gone
    with receipt() as later:
        pass
    assert later.highest == 0
