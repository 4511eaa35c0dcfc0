"""The model's memory tools as the model is told of them: their names,
descriptions (which state the calling agent's budgets) and argument schemas,
in shapes OpenAI's and Anthropic's APIs take as they are; and Claude's own
memory tool (`memory_20250818`, sidecar.domain.memory_files), which Anthropic's
API defines: a runtime declares it by type, and passes its inputs on.

The schemas are the same for every scope, built once; sidecar.domain.tools
checks a call's arguments against them and runs it. The MCP server and its
stdio bridge (sidecar.api.mcp_server, sidecar.ops.mcp_stdio) list them too.

Owns: the tools' names, descriptions, JSON Schemas, ToolDef, and ToolResult
(what a call of any of them gives back). Must not touch:
running a call (sidecar.domain.tools), the store, grpc or the MCP SDK; the
engine only for an agent's budgets (read, never written).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.core.memory import Scope, Tier

if TYPE_CHECKING:
    # Annotations only: `memory-sidecar mcp` (a bridge to a daemon over gRPC)
    # uses these definitions and need not load the engine.
    from sidecar.domain.engine import MemoryEngine

MEMORY, SEARCH, LIST = "memory", "memory_search", "memory_list"
# Claude's memory tool, by its type: CallTool's name for its tool_use inputs.
MEMORY_FILES = "memory_20250818"
# Its commands' arguments besides `command`, as Anthropic's SDKs define them
# (BetaMemoryTool20250818ViewCommand and its siblings).
MEMORY_FILE_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "view": ("path", "view_range"),
    "create": ("path", "file_text"),
    "str_replace": ("path", "old_str", "new_str"),
    "insert": ("path", "insert_line", "insert_text"),
    "delete": ("path",),
    "rename": ("old_path", "new_path"),
}
ACTIONS = ("add", "replace", "remove")
TARGETS = {"memory": Tier.MEMORY, "user": Tier.USER}
DEFAULT_SEARCH_LIMIT = 10
MAX_SEARCH_LIMIT = 50


@dataclass(frozen=True, slots=True)
class ToolDef:
    """One tool: its name, its description for the model, its arguments' JSON Schema."""

    name: str
    description: str
    input_schema: dict[str, Any]
    # How Anthropic's API is told of a tool it defines itself (by type),
    # instead of by description and schema.
    declaration: dict[str, Any] | None = None

    def openai(self) -> dict[str, Any]:
        """As an OpenAI function tool (Chat Completions' `tools` entry)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.input_schema,
            },
        }

    def anthropic(self) -> dict[str, Any]:
        """As an Anthropic Messages API tool."""
        if self.declaration is not None:
            return dict(self.declaration)
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
        }


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a call gives back: text for the model, the outcome as data, and
    the highest generation its writes took (0: none; for CallTool's answer,
    never shown to the model)."""

    text: str
    structured: dict[str, Any]
    is_error: bool = False
    generation: int = 0


def _target_schema(both: bool) -> dict[str, Any]:
    values = [*TARGETS, "both"] if both else list(TARGETS)
    return {
        "type": "string",
        "enum": values,
        "default": "both" if both else "memory",
        "description": "memory: your own notes; user: the user's profile"
        + ("; both: either" if both else ""),
    }


def _strict(properties: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def _budgets(engine: MemoryEngine, scope: Scope) -> str:
    settings = engine.settings(scope)
    parts = []
    for tier, name in ((Tier.MEMORY, "memory"), (Tier.USER, "user")):
        policy = settings.policy(tier)
        if not policy.enabled:
            parts.append(f"{name}: switched off")
        elif policy.limit_chars:
            parts.append(f"{name}: {policy.limit_chars:,} characters")
        else:
            parts.append(f"{name}: unlimited")
    return "; ".join(parts)


# The arguments' schemas, the same for every scope (only the descriptions
# state a scope's budgets): built once, and what `call` checks names against.
SCHEMAS: dict[str, dict[str, Any]] = {
    MEMORY: _strict(
        {
            "action": {"type": "string", "enum": list(ACTIONS)},
            "target": _target_schema(both=False),
            "content": {
                "type": "string",
                "description": "The new entry's text (add).",
            },
            "old_text": {
                "type": "string",
                "description": "Text that occurs exactly once in the target (replace, "
                "remove): replace changes just this text, remove deletes the entry "
                "holding it. Quote it exactly, with enough context to be unique.",
            },
            "new_text": {
                "type": "string",
                "description": "What old_text becomes (replace); the rest of the entry "
                "stays. To rewrite a whole entry, quote all of it as old_text.",
            },
        },
        ["action"],
    ),
    SEARCH: _strict(
        {
            "query": {"type": "string", "description": "What to look for."},
            "target": _target_schema(both=True),
            "limit": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_SEARCH_LIMIT,
                "default": DEFAULT_SEARCH_LIMIT,
            },
        },
        ["query"],
    ),
    LIST: _strict({"target": _target_schema(both=True)}, []),
}


def definitions(engine: MemoryEngine, scope: Scope) -> list[ToolDef]:
    """The tools, with descriptions that state this scope's budgets."""
    budgets = _budgets(engine, scope)
    memory = ToolDef(
        MEMORY,
        "Save, correct or remove one of your long-term memories. They are shown to you "
        "at the start of every conversation, in the MEMORY (agent notes) and USER PROFILE "
        "blocks of your system prompt. target=memory is for your own notes: facts about "
        "the environment, project conventions, lessons learned. target=user is for what "
        "you learn about the user: name, role, preferences. action=add saves `content` as "
        "a new entry; action=replace changes the text `old_text` (which must occur exactly "
        "once in the target) to `new_text`, leaving the rest of its entry as it is; "
        "action=remove deletes the one entry containing `old_text`. Keep each entry "
        "short, one fact per entry, and correct an entry instead of adding a "
        "contradicting one. Each target has a character budget "
        f"({budgets}); every result shows its usage, and when a target is full, shorten "
        "or remove entries first.",
        SCHEMAS[MEMORY],
    )
    search = ToolDef(
        SEARCH,
        "Search your long-term memories (agent notes and user profile) for entries "
        "relevant to a query, best first. Use it before adding, to avoid repeating an "
        "entry, and to find the exact text to pass as old_text.",
        SCHEMAS[SEARCH],
    )
    listing = ToolDef(
        LIST,
        "List every entry of your long-term memories with its size in characters, and "
        f"each target's usage of its budget ({budgets}).",
        SCHEMAS[LIST],
    )
    return [memory, search, listing]


def _memory_files_schema() -> dict[str, Any]:
    text = {"type": "string"}
    properties: dict[str, Any] = {
        "command": {"type": "string", "enum": list(MEMORY_FILE_ARGUMENTS)},
        "path": {
            "type": "string",
            "description": "/memories, /memories/notes.md or /memories/user.md",
        },
        "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
        "file_text": text,
        "old_str": text,
        "new_str": text,
        "insert_line": {"type": "integer", "minimum": 0},
        "insert_text": text,
        "old_path": text,
        "new_path": text,
    }
    return _strict(properties, ["command"])


def claude_memory_tool() -> ToolDef:
    """Claude's memory tool: declared to Anthropic's API by its type (the
    model knows its commands); as a function tool elsewhere, with the
    commands' arguments as its schema."""
    return ToolDef(
        MEMORY_FILES,
        "Your long-term memory as a directory, /memories, of two files: notes.md (your "
        "notes: the environment, conventions, lessons learned) and user.md (what you learn "
        "about the user), one entry per line. Commands: view (a path; view_range [first, "
        "last]), create (an empty file, from file_text), str_replace (old_str, unique in "
        "the file, becomes new_str; an empty result removes the entry), insert (insert_text "
        "as new entries, at the end; insert_line is checked, not kept), delete and rename "
        "(refused: the two files always exist). Both files have a character budget.",
        _memory_files_schema(),
        declaration={"type": MEMORY_FILES, "name": MEMORY},
    )
