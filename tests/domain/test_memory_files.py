"""sidecar.domain.memory_files over gRPC: Claude's memory tool (memory_20250818).

Every input is built with the command types of Anthropic's Python SDK
(`BetaMemoryTool20250818*Command`) and sent through a real daemon's CallTool
as a runtime would send a `tool_use` block's input; the texts are what the
model reads back as the `tool_result`. The error texts are the SDK's
reference implementation's (BetaLocalFilesystemMemoryTool), so each has a
test.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import anthropic
import jsonschema
import pytest
from anthropic.lib.tools import BetaAbstractMemoryTool
from anthropic.types.beta import (
    BetaMemoryTool20250818CreateCommand,
    BetaMemoryTool20250818DeleteCommand,
    BetaMemoryTool20250818InsertCommand,
    BetaMemoryTool20250818RenameCommand,
    BetaMemoryTool20250818StrReplaceCommand,
    BetaMemoryTool20250818ViewCommand,
    BetaTextBlock,
    BetaToolUseBlock,
)
from pydantic import BaseModel
from typing_extensions import override

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.config.settings import Config
from sidecar.core.memory import Memory, Scope, Tier
from sidecar.domain.tools import Tools
from sidecar.storage.writes import Edit, NewEntry
from tests.conftest import (
    CALL_SECONDS,
    ROOT,
    MakeEngine,
    MakeSidecar,
    Running,
    contents,
)

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
NOTES, USER = "/memories/notes.md", "/memories/user.md"
THE_FILES = (
    "/memories holds two files: /memories/notes.md (your notes: the environment, "
    "conventions, lessons learned) and /memories/user.md (what you learn about the user)"
)


def send(
    running: Running, arguments: dict[str, Any], scope: pb.Scope = SCOPE
) -> tuple[str, bool, dict[str, Any]]:
    """One CallTool of memory_20250818: the text, is_error, the outcome."""
    request = pb.CallToolRequest(
        scope=scope,
        session_id="s1",
        name="memory_20250818",
        arguments_json=json.dumps(arguments),
    )
    response = running.stub.CallTool(request, timeout=CALL_SECONDS)
    return response.text, response.is_error, json.loads(response.structured_json)


def run(running: Running, command: BaseModel) -> tuple[str, bool, dict[str, Any]]:
    """A command as the SDK's types shape it (a `tool_use` input, as is)."""
    return send(running, command.model_dump())


def view(path: str, view_range: list[int] | None = None) -> BetaMemoryTool20250818ViewCommand:
    return BetaMemoryTool20250818ViewCommand(command="view", path=path, view_range=view_range)


def replace(path: str, old: str, new: str) -> BetaMemoryTool20250818StrReplaceCommand:
    return BetaMemoryTool20250818StrReplaceCommand(
        command="str_replace", path=path, old_str=old, new_str=new
    )


def insert(path: str, line: int, text: str) -> BetaMemoryTool20250818InsertCommand:
    return BetaMemoryTool20250818InsertCommand(
        command="insert", path=path, insert_line=line, insert_text=text
    )


def create(path: str, text: str) -> BetaMemoryTool20250818CreateCommand:
    return BetaMemoryTool20250818CreateCommand(command="create", path=path, file_text=text)


def notes(running: Running, *entries: str, scope: pb.Scope = SCOPE) -> None:
    for entry in entries:
        running.add(entry, scope=scope)


class Forwarder(BetaAbstractMemoryTool):
    """The SDK's own memory tool, each command forwarded to CallTool: the
    SDK parses a `tool_use` input into its command type and dispatches it."""

    def __init__(self, running: Running) -> None:
        super().__init__()
        self.running = running
        self.errors: list[bool] = []

    def _send(self, command: BaseModel) -> str:
        text, is_error, _ = run(self.running, command)
        self.errors.append(is_error)
        return text

    @override
    def view(self, command: BetaMemoryTool20250818ViewCommand) -> str:
        return self._send(command)

    @override
    def create(self, command: BetaMemoryTool20250818CreateCommand) -> str:
        return self._send(command)

    @override
    def str_replace(self, command: BetaMemoryTool20250818StrReplaceCommand) -> str:
        return self._send(command)

    @override
    def insert(self, command: BetaMemoryTool20250818InsertCommand) -> str:
        return self._send(command)

    @override
    def delete(self, command: BetaMemoryTool20250818DeleteCommand) -> str:
        return self._send(command)

    @override
    def rename(self, command: BetaMemoryTool20250818RenameCommand) -> str:
        return self._send(command)


def refusal(running: Running, command: BaseModel) -> tuple[str, str]:
    """A refused command's text and reason, having changed nothing."""
    before = contents(running, SCOPE)
    text, is_error, outcome = run(running, command)
    assert is_error, text
    assert outcome["ok"] is False
    assert contents(running, SCOPE) == before
    return text, outcome["error"]["reason"]


def test_list_tools_says_how_to_declare_it_apart_from_the_other_tools(sidecar: Running) -> None:
    listed = sidecar.stub.ListTools(pb.ListToolsRequest(scope=SCOPE), timeout=CALL_SECONDS)
    # Apart: a runtime passing every tool of `tools` to Anthropic's API
    # would otherwise declare two tools named memory.
    assert [tool.name for tool in listed.tools] == ["memory", "memory_search", "memory_list"]
    tool = listed.claude_memory_tool
    assert tool.name == "memory_20250818"
    # Exactly what the SDK's own memory tool declares.
    declared = Forwarder(sidecar).to_dict()
    assert (
        json.loads(tool.anthropic_json) == declared == {"type": "memory_20250818", "name": "memory"}
    )
    # Elsewhere a function tool, whose schema every SDK command fits.
    schema = json.loads(tool.input_schema_json)
    assert json.loads(tool.openai_json)["function"]["parameters"] == schema
    commands: list[BaseModel] = [
        view("/memories", [1, -1]),
        create(NOTES, "a"),
        replace(NOTES, "a", "b"),
        insert(NOTES, 0, "c"),
        BetaMemoryTool20250818DeleteCommand(command="delete", path=NOTES),
        BetaMemoryTool20250818RenameCommand(command="rename", old_path=NOTES, new_path=USER),
    ]
    for command in commands:
        jsonschema.validate(command.model_dump(exclude_none=True), schema)


def test_tool_use_inputs_as_the_sdk_parses_them(sidecar: Running) -> None:
    # The inputs of Claude's tool_use blocks, as they come: the SDK's tool
    # parses each into its command type and hands it on.
    tool = Forwarder(sidecar)
    inputs: list[dict[str, object]] = [
        {"command": "view", "path": "/memories"},
        {"command": "create", "path": NOTES, "file_text": "Repo uses uv\nCI on Debian\n"},
        {"command": "str_replace", "path": NOTES, "old_str": "Debian", "new_str": "Ubuntu"},
        {"command": "insert", "path": USER, "insert_line": 0, "insert_text": "Ada likes tea"},
        {"command": "view", "path": NOTES, "view_range": [2, 2]},
        {"command": "delete", "path": NOTES},
        {"command": "rename", "old_path": USER, "new_path": "/memories/profile.md"},
    ]
    texts = [tool.call(raw) for raw in inputs]
    assert tool.errors == [False, False, False, False, False, True, True]
    assert texts[1] == "File created successfully at: /memories/notes.md"
    assert texts[4] == (
        "Here's the content of /memories/notes.md with line numbers:\n     2\tCI on Ubuntu"
    )
    assert contents(sidecar, SCOPE, tier=pb.TIER_MEMORY) == ["Repo uses uv", "CI on Ubuntu"]
    assert contents(sidecar, SCOPE, tier=pb.TIER_USER) == ["Ada likes tea"]


def test_view_shows_the_directory_and_each_tier_with_line_numbers(sidecar: Running) -> None:
    notes(sidecar, "Repo uses uv", "CI runs on Debian", "Deploys go through ArgoCD")
    sidecar.add("Ada is a staff engineer", scope=SCOPE, tier=pb.TIER_USER)
    text, is_error, outcome = run(sidecar, view("/memories"))
    assert not is_error
    assert outcome == {"ok": True, "command": "view"}
    assert text == (
        "Here're the files and directories up to 2 levels deep in /memories, excluding "
        "hidden items:\n"
        "79B\t/memories\n"
        "56B\t/memories/notes.md\n"
        "23B\t/memories/user.md"
    )
    text, _, _ = run(sidecar, view(NOTES))
    assert text == (
        "Here's the content of /memories/notes.md with line numbers:\n"
        "     1\tRepo uses uv\n"
        "     2\tCI runs on Debian\n"
        "     3\tDeploys go through ArgoCD"
    )
    text, _, _ = run(sidecar, view(NOTES, [2, -1]))
    assert text.splitlines()[1:] == [
        "     2\tCI runs on Debian",
        "     3\tDeploys go through ArgoCD",
    ]
    text, _, _ = run(sidecar, view(NOTES, [1, 1]))
    assert text.splitlines()[1:] == ["     1\tRepo uses uv"]
    text, _, _ = run(sidecar, view(USER))
    assert text.splitlines()[1:] == ["     1\tAda is a staff engineer"]
    # A trailing slash, a doubled one: the same paths.
    assert run(sidecar, view("/memories//notes.md"))[0] == run(sidecar, view(NOTES))[0]
    assert run(sidecar, view("/memories/"))[0].startswith("Here're the files")


def test_an_entry_with_line_breaks_takes_several_lines(sidecar: Running) -> None:
    notes(sidecar, "Ports:\napi 5433\ncache 6379", "CI runs on Debian")
    text, _, _ = run(sidecar, view(NOTES))
    assert text.splitlines()[1:] == [
        "     1\tPorts:",
        "     2\tapi 5433",
        "     3\tcache 6379",
        "     4\tCI runs on Debian",
    ]
    text, is_error, _ = run(sidecar, replace(NOTES, "api 5433\ncache", "api 5434\ncache"))
    assert not is_error, text
    assert contents(sidecar, SCOPE) == ["Ports:\napi 5434\ncache 6379", "CI runs on Debian"]


def test_view_range_out_of_the_file_is_refused(sidecar: Running) -> None:
    notes(sidecar, "Repo uses uv", "CI runs on Debian")
    text, reason = refusal(sidecar, view(NOTES, [3, -1]))
    assert text == (
        "Invalid `view_range` parameter: [3, -1]. Its first element `3` should be within the "
        "range of lines of the file: [1, 2]."
    )
    assert reason == "LINE_OUT_OF_RANGE"
    text, reason = refusal(sidecar, view(NOTES, [2, 1]))
    assert "Its second element `1` should be -1 or at least its first element `2`" in text
    text, reason = refusal(sidecar, view(NOTES, [1]))
    assert reason == "ARGUMENTS_INVALID"


def test_create_fills_an_empty_tier_one_entry_per_line(sidecar: Running) -> None:
    text, is_error, _ = run(sidecar, create(NOTES, "# Notes\n- Repo uses uv\n\n- CI on Debian\n"))
    assert not is_error
    assert text == "File created successfully at: /memories/notes.md"
    assert contents(sidecar, SCOPE) == ["# Notes", "- Repo uses uv", "- CI on Debian"]
    text, reason = refusal(sidecar, create(NOTES, "something else"))
    assert text == (
        "File /memories/notes.md already exists. It holds 3 entries, one per line: view it, "
        "then add lines with insert or change them with str_replace."
    )
    assert reason == "FILE_EXISTS"
    # CRLF line ends and tabs, as some editors write them.
    text, is_error, _ = run(sidecar, create(USER, "Ada likes terse answers\r\n\tand tea\r\n"))
    assert not is_error
    assert contents(sidecar, SCOPE, tier=pb.TIER_USER) == ["Ada likes terse answers", "and tea"]


def test_other_paths_under_memories_do_not_exist_and_cannot_be_made(sidecar: Running) -> None:
    text, reason = refusal(sidecar, create("/memories/todo.md", "x"))
    assert text == f"Cannot create /memories/todo.md: {THE_FILES}; write to one of them."
    assert reason == "FILE_FIXED"
    text, reason = refusal(sidecar, view("/memories/todo.md"))
    assert text == (
        f"The path /memories/todo.md does not exist. Please provide a valid path. {THE_FILES}."
    )
    assert reason == "PATH_NOT_FOUND"
    text, reason = refusal(sidecar, replace("/memories/a/b.md", "x", "y"))
    assert text.startswith("The path /memories/a/b.md does not exist. Please provide a valid path.")
    text, reason = refusal(sidecar, replace("/memories", "x", "y"))
    assert (text, reason) == ("The path /memories is not a file.", "NOT_A_FILE")


def test_str_replace_edits_the_one_entry_holding_old_str(sidecar: Running) -> None:
    notes(sidecar, "Repo uses uv", "Deploy target is AWS us-east-1", "CI runs on Debian")
    text, is_error, _ = run(sidecar, replace(NOTES, "us-east-1", "eu-west-1"))
    assert not is_error
    assert text == (
        "The memory file has been edited. Here is the snippet showing the change (with line "
        "numbers):\n"
        "     1\tRepo uses uv\n"
        "     2\tDeploy target is AWS eu-west-1\n"
        "     3\tCI runs on Debian"
    )
    assert contents(sidecar, SCOPE) == [
        "Repo uses uv",
        "Deploy target is AWS eu-west-1",
        "CI runs on Debian",
    ]
    # What InjectForTurn shows next is the edited entry: the engine's write.
    block = sidecar.stub.InjectForTurn(
        pb.InjectForTurnRequest(scope=SCOPE, session_id="s2"), timeout=CALL_SECONDS
    ).system_block
    assert "eu-west-1" in block
    assert "us-east-1" not in block


def test_str_replace_to_nothing_removes_the_entry(sidecar: Running) -> None:
    notes(sidecar, "Repo uses uv", "Stale fact", "CI runs on Debian", "Another stale fact")
    # The whole line with its line break, as models delete a line.
    text, is_error, _ = run(sidecar, replace(NOTES, "Stale fact\n", ""))
    assert not is_error
    assert text.splitlines()[1:] == [
        "     1\tRepo uses uv",
        "     2\tCI runs on Debian",
        "     3\tAnother stale fact",
    ]
    # The line alone.
    run(sidecar, replace(NOTES, "Another stale fact", ""))
    # The line break before it.
    run(sidecar, replace(NOTES, "\nCI runs on Debian", ""))
    assert contents(sidecar, SCOPE) == ["Repo uses uv"]
    text, _, _ = run(sidecar, replace(NOTES, "Repo uses uv", ""))
    assert text == "The memory file has been edited. /memories/notes.md is now empty."
    assert contents(sidecar, SCOPE) == []


def test_what_old_str_and_new_str_share_is_not_a_change(sidecar: Running) -> None:
    notes(sidecar, "Repo uses uv", "CI runs on Debian", "Deploys go through ArgoCD")
    # Whole lines with their line breaks, as models quote them: each edit
    # changes one entry, though old_str spans two or three lines.
    text, is_error, _ = run(sidecar, replace(NOTES, "CI runs on Debian\n", "CI runs on Ubuntu\n"))
    assert not is_error, text
    text, is_error, _ = run(sidecar, replace(NOTES, "uv\nCI runs", "uv\nCI now runs"))
    assert not is_error, text
    text, is_error, _ = run(
        sidecar, replace(NOTES, "uv\nCI now runs on Ubuntu\nDeploys", "uv\nDeploys")
    )
    assert not is_error, text
    assert contents(sidecar, SCOPE) == ["Repo uses uv", "Deploys go through ArgoCD"]


def test_str_replace_errors_are_the_reference_implementations(sidecar: Running) -> None:
    notes(sidecar, "CI runs on Debian", "Staging runs on Debian too", "Prod runs on Alpine")
    sidecar.add("Ada prefers dark mode", scope=SCOPE, tier=pb.TIER_USER)
    text, reason = refusal(sidecar, replace(NOTES, "Debian", "Ubuntu"))
    assert text == (
        "No replacement was performed. Multiple occurrences of old_str `Debian` in lines: "
        "1, 2. Please ensure it is unique"
    )
    assert reason == "AMBIGUOUS_MATCH"
    text, reason = refusal(sidecar, replace(NOTES, "Windows", "Ubuntu"))
    assert text == (
        "No replacement was performed, old_str `Windows` did not appear verbatim in "
        "/memories/notes.md."
    )
    assert reason == "MATCH_NOT_FOUND"
    # In the other file: it says so.
    text, reason = refusal(sidecar, replace(NOTES, "dark mode", "light mode"))
    assert text.endswith(" It is in /memories/user.md: call str_replace with that path.")
    text, reason = refusal(
        sidecar, replace(NOTES, "Debian too\nProd runs", "Debian too; Prod runs")
    )
    assert text.startswith(
        "No replacement was performed: old_str spans lines 2-3 of /memories/notes.md, which "
        "belong to different entries"
    )
    assert reason == "SPANS_ENTRIES"
    text, reason = refusal(sidecar, replace(NOTES, "", "x"))
    assert reason == "ARGUMENTS_INVALID"


def test_insert_adds_entries_at_the_end_and_says_where(sidecar: Running) -> None:
    notes(sidecar, "Repo uses uv", "CI runs on Debian")
    text, is_error, _ = run(sidecar, insert(NOTES, 2, "Deploys go through ArgoCD"))
    assert not is_error
    assert text == "The file /memories/notes.md has been edited."
    text, _, _ = run(sidecar, insert(NOTES, 0, "Tests need Docker\nLint with ruff"))
    assert text == (
        "The file /memories/notes.md has been edited. Entries stay in the order they were "
        "saved, so the new text is at the end: lines 4, 5."
    )
    assert contents(sidecar, SCOPE) == [
        "Repo uses uv",
        "CI runs on Debian",
        "Deploys go through ArgoCD",
        "Tests need Docker",
        "Lint with ruff",
    ]
    text, reason = refusal(sidecar, insert(NOTES, 9, "x"))
    assert text == "Invalid `insert_line` parameter: 9. It should be within the range [0, 5]."
    assert reason == "LINE_OUT_OF_RANGE"
    text, reason = refusal(sidecar, insert(NOTES, 0, "  \n "))
    assert reason == "ARGUMENTS_INVALID"


def test_the_files_and_the_directory_cannot_be_deleted_or_renamed(sidecar: Running) -> None:
    notes(sidecar, "Repo uses uv")

    def delete(path: str) -> BetaMemoryTool20250818DeleteCommand:
        return BetaMemoryTool20250818DeleteCommand(command="delete", path=path)

    def rename(old: str, new: str) -> BetaMemoryTool20250818RenameCommand:
        return BetaMemoryTool20250818RenameCommand(command="rename", old_path=old, new_path=new)

    assert refusal(sidecar, delete("/memories")) == (
        "Cannot delete the /memories directory itself",
        "FILE_FIXED",
    )
    assert refusal(sidecar, delete(NOTES)) == (
        "Cannot delete /memories/notes.md: the two memory files always exist. To remove an "
        "entry, str_replace its whole line with an empty new_str.",
        "FILE_FIXED",
    )
    assert refusal(sidecar, delete("/memories/old.md")) == (
        f"The path /memories/old.md does not exist. {THE_FILES}.",
        "PATH_NOT_FOUND",
    )
    assert refusal(sidecar, rename(NOTES, "/memories/project.md")) == (
        f"Cannot rename /memories/notes.md: the memory files have fixed names. {THE_FILES}.",
        "FILE_FIXED",
    )
    assert refusal(sidecar, rename("/memories/a.md", NOTES))[1] == "PATH_NOT_FOUND"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/etc/passwd", "Path must start with /memories, got: /etc/passwd"),
        ("memories/notes.md", "Path must start with /memories, got: memories/notes.md"),
        ("/memoriesX/notes.md", "Path must start with /memories, got: /memoriesX/notes.md"),
        (
            "/memories/../etc/passwd",
            "Path /memories/../etc/passwd would escape /memories directory",
        ),
        ("/memories/./notes.md", "Path /memories/./notes.md would escape /memories directory"),
        ("/memories/%2e%2e/x", "Path /memories/%2e%2e/x would escape /memories directory"),
        ("/memories/%6eotes.md", "Path /memories/%6eotes.md would escape /memories directory"),
        ("/memories/..\\x", "Path /memories/..\\x would escape /memories directory"),
    ],
)
def test_paths_outside_memories_are_refused(sidecar: Running, path: str, expected: str) -> None:
    notes(sidecar, "Repo uses uv")
    for command in (view(path), create(path, "x"), insert(path, 0, "x"), replace(path, "uv", "x")):
        assert refusal(sidecar, command) == (expected, "PATH_OUTSIDE_MEMORIES")


def test_arguments_cannot_name_another_scope_or_command(sidecar: Running) -> None:
    other = pb.Scope(agent_id="victim", user_id="bob")
    notes(sidecar, "the victim's note", scope=other)
    arguments = insert(NOTES, 0, "planted").model_dump() | {"agent_id": "victim"}
    text, is_error, outcome = send(sidecar, arguments)
    assert is_error
    assert outcome["error"]["reason"] == "ARGUMENTS_INVALID"
    assert "set by the connection" in text
    text, is_error, outcome = send(sidecar, {"command": "erase", "path": NOTES})
    assert is_error
    assert "Unknown command 'erase'; the commands are view, create, str_replace" in text
    text, is_error, outcome = send(sidecar, {"command": "view"})
    assert text == "`path` is required here, as a string"
    assert contents(sidecar, other) == ["the victim's note"]
    assert contents(sidecar, SCOPE) == []


def test_a_full_tier_says_what_it_holds_and_saves_none_of_several_lines(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar("defaults: {memory_char_limit: 60}")
    notes(running, "Deploys go through ArgoCD", "CI runs on Debian")
    text, reason = refusal(running, insert(NOTES, 2, "The staging cluster lives in eu-west-1"))
    assert reason == "TIER_BUDGET_EXCEEDED"
    assert text.splitlines() == [
        "Not saved: /memories/notes.md (agent notes) is full [45/60 chars]. This needs 41 "
        "more characters (38 for the text, 3 for the separators between entries) and 15 are "
        "free. Its entries, with their sizes:",
        "     1\t(25 chars) Deploys go through ArgoCD",
        "     2\t(17 chars) CI runs on Debian",
        "Remove entries that are outdated or less useful (str_replace the whole line with an "
        "empty new_str), or shorten some, then try again; or save shorter text.",
    ]
    # Two lines that fit alone but not together: neither is saved.
    text, reason = refusal(running, insert(NOTES, 2, "Uses uv\nLints with ruff"))
    assert reason == "TIER_BUDGET_EXCEEDED"
    assert "This needs 28 more characters (22 for the text, 6 for the separators" in text
    text, reason = refusal(running, replace(NOTES, "Debian", "Debian bookworm, on arm64 runners"))
    assert reason == "TIER_BUDGET_EXCEEDED"
    text, reason = refusal(running, insert(NOTES, 0, "x" * 61))
    assert reason == "ENTRY_TOO_LARGE"
    assert text.startswith("Not saved: this entry is 61 characters and the whole agent notes")


def test_a_similar_entry_is_refused_as_the_agents_policy_says(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("agents: {strict: {similar_writes: refuse}}")
    strict = pb.Scope(agent_id="strict", user_id="bob")
    running.add("Deploys go through ArgoCD", scope=strict)
    arguments = insert(NOTES, 1, "Deploys go via ArgoCD").model_dump()
    text, is_error, outcome = send(running, arguments, scope=strict)
    assert is_error
    assert text == (
        "Not saved: /memories/notes.md already holds a similar entry: 'Deploys go through "
        "ArgoCD'. If the new text corrects it, str_replace the words that changed; if it "
        "says the same, it is already saved."
    )
    assert outcome["error"]["reason"] == "SIMILAR_MEMORY"
    assert contents(running, strict) == ["Deploys go through ArgoCD"]


def test_an_edit_raced_by_another_writer_is_computed_again(make_engine: MakeEngine) -> None:
    # Another writer changes the entry between the tool's read and its write:
    # the write is refused (Edit.expected), the tool reads again, and both
    # changes survive. The read is wrapped only to place the other write.
    engine, _, _ = make_engine()
    scope = Scope("coder")
    engine.add(NewEntry(scope, Tier.MEMORY, "api on port 5433, cache on port 6379"))
    read = engine.list_memories
    raced: list[str] = []

    def list_memories(*args: Any, **kwargs: Any) -> tuple[list[Memory], Any]:
        listed = read(*args, **kwargs)
        if not raced:
            edit = Edit(scope, match="6379", tier=Tier.MEMORY, content=listed[0][0].content + "!")
            raced.append(engine.update(edit)[0].content)
        return listed

    engine.list_memories = list_memories  # type: ignore[method-assign]
    command = replace(NOTES, "5433", "5434").model_dump()
    result = Tools(engine, Config().server.limits()).call(scope, "s1", "memory_20250818", command)
    assert not result.is_error, result.text
    assert raced == ["api on port 5433, cache on port 6379!"]
    memories, _ = read(scope, [Tier.MEMORY], "")
    assert [m.content for m in memories] == ["api on port 5434, cache on port 6379!"]


class _Replies:
    """Stands in for `anthropic.Anthropic()` in docs/API.md's loop: each
    create() answers the next scripted content, built of the SDK's blocks,
    and keeps what it was sent."""

    def __init__(self, replies: list[list[BetaToolUseBlock | BetaTextBlock]]) -> None:
        self.replies = replies
        self.requests: list[dict[str, Any]] = []
        self.beta = SimpleNamespace(messages=SimpleNamespace(create=self.create))

    def create(self, **request: Any) -> SimpleNamespace:
        # A copy: the loop appends to the same list afterwards.
        self.requests.append({**request, "messages": list(request["messages"])})
        return SimpleNamespace(content=self.replies[len(self.requests) - 1])


def test_the_python_loop_in_the_api_docs_runs(
    sidecar: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = (ROOT / "docs" / "API.md").read_text()
    loop = api[api.index("**The loop in Python**") :]
    code = loop[loop.index("```python\n") + len("```python\n") : loop.index("```\n\nWith")]
    code = code.replace("127.0.0.1:50051", sidecar.addresses.api)
    replies = _Replies(
        [
            [
                BetaToolUseBlock(
                    id="toolu_1",
                    type="tool_use",
                    name="memory",
                    input={"command": "view", "path": "/memories/notes.md"},
                )
            ],
            [
                BetaTextBlock(type="text", text="Noted."),
                BetaToolUseBlock(
                    id="toolu_2",
                    type="tool_use",
                    name="memory",
                    input={
                        "command": "insert",
                        "path": "/memories/notes.md",
                        "insert_line": 0,
                        "insert_text": "We deploy to eu-west-1",
                    },
                ),
            ],
            [BetaTextBlock(type="text", text="Saved.")],
        ]
    )
    monkeypatch.setattr(anthropic, "Anthropic", lambda: replies)
    exec(compile(code, "docs/API.md", "exec"), {})
    assert [r["tools"] for r in replies.requests] == [
        [{"type": "memory_20250818", "name": "memory"}]
    ] * 3
    first, second = replies.requests[1]["messages"][-1], replies.requests[2]["messages"][-1]
    assert first == {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": "Here's the content of /memories/notes.md with line numbers:",
                "is_error": False,
            }
        ],
    }
    assert second["content"][0]["content"] == "The file /memories/notes.md has been edited."
    assert contents(sidecar, SCOPE) == ["We deploy to eu-west-1"]
