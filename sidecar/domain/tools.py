"""The model's own memory tools: definitions, and one call run in a scope.

The same code answers the MCP server (sidecar.api.mcp_server) and the gRPC
ListTools/CallTool (sidecar.api.service). Three tools, shaped as the seeds' own
(cagent's `target` memory|user, Hermes' edits by `old_text`):

- `memory`: action add | replace | remove, target memory | user, content,
  old_text, new_text. Replace and remove name the entry by text it contains
  (the frozen block shows no ids); replace changes only that text, as the
  substring edits models are trained on do (`str_replace`).
- `memory_search`: the tiers' entries that match a query, best first.
- `memory_list`: every entry of a tier, with its size.

Every result carries the tier's usage as the frozen block's header shows it
(`[42% — 924/2,200 chars]`). What the model got wrong, or what the store
refused (a full tier, no or several entries holding `old_text`, a similar
entry), comes back as an error result whose text says what to do next; a
full tier lists its entries with their sizes. Errors that are not the
model's to fix (a token's grant, an unavailable database) are raised.

The scope is the caller's, never the model's: no schema has a scope field
and unknown arguments are refused, so a call cannot reach another scope.

Owns: running a call: the argument checks and the texts the model reads
(the names, descriptions and schemas are sidecar.domain.tool_definitions').
Must not touch: grpc or the MCP SDK (the edges render),
the store (everything goes through the engine), access checks (the edges
authorize the scope before calling).
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sidecar.core.errors import (
    AlreadyExists,
    AmbiguousMatch,
    BudgetExceeded,
    EditConflict,
    EntryTooLarge,
    FailedPrecondition,
    InvalidArgument,
    MatchNotFound,
    NotFound,
    Reason,
    SidecarError,
    SimilarExists,
    StoreError,
)
from sidecar.core.limits import Limits, caller_json, checked
from sidecar.core.memory import Memory, Scope, Tier, Usage, clean_content
from sidecar.domain.memory_files import MemoryFiles
from sidecar.domain.receipts import receipt, recording
from sidecar.domain.tool_definitions import (
    ACTIONS,
    DEFAULT_SEARCH_LIMIT,
    LIST,
    MAX_SEARCH_LIMIT,
    MEMORY,
    MEMORY_FILES,
    SCHEMAS,
    SEARCH,
    TARGETS,
    ToolDef,
    ToolResult,
    claude_memory_tool,
    definitions,
)
from sidecar.retrieval import blocks, scanner
from sidecar.storage.writes import Edit, NewEntry

if TYPE_CHECKING:
    # Annotations only: `memory-sidecar mcp` (a bridge to a daemon over gRPC)
    # uses these tools' definitions and need not load the engine.
    from sidecar.domain.engine import MemoryEngine

# A substring edit read again after another writer changed its entry meanwhile.
_EDIT_ATTEMPTS = 3
# The session of the call running on this thread (Tools.call sets it).
_SESSION: contextvars.ContextVar[str] = contextvars.ContextVar("tool_session", default="")
# Errors of these kinds are the model's to act on: returned as tool errors.
_MODELS_TO_FIX = (InvalidArgument, NotFound, FailedPrecondition, AlreadyExists)
_TIER_NAMES = {Tier.MEMORY: "agent notes (target=memory)", Tier.USER: "user profile (target=user)"}


class _ArgumentError(Exception):
    """A model's argument that does not fit the schema."""


def _text(arguments: Mapping[str, Any], name: str, *, required: bool) -> str:
    value = arguments.get(name)
    if value is None:
        if required:
            raise _ArgumentError(f"`{name}` is required here")
        return ""
    if not isinstance(value, str):
        raise _ArgumentError(f"`{name}` must be a string")
    return value


def _separated(exc: BudgetExceeded) -> str:
    """What of a new entry's `requested` characters is its separator."""
    if not exc.separator:
        return ""
    text = exc.requested - exc.separator
    return f" ({text:,} for the entry, {exc.separator} for the separator between entries)"


def _replaced_once(content: str, old_text: str, new_text: str, shown: str) -> str:
    """`content` with its one `old_text` made `new_text`; refused where the
    entry (`shown`, as the model reads it) holds it more than once (which of
    them is meant?)."""
    count = content.count(old_text)
    if count > 1:
        raise _ArgumentError(
            f"`old_text` occurs {count} times in the entry {shown!r}; quote more of the "
            "text around the one you mean (nothing was changed)"
        )
    return content.replace(old_text, new_text, 1)


def _choice(arguments: Mapping[str, Any], name: str, allowed: Sequence[str], default: str) -> str:
    value = arguments.get(name, default)
    if value not in allowed:
        raise _ArgumentError(f"`{name}` must be one of {', '.join(allowed)}; got {value!r}")
    return str(value)


def _tiers(target: str) -> tuple[Tier, ...]:
    return tuple(TARGETS.values()) if target == "both" else (TARGETS[target],)


def _usage_text(usage: Usage, limit_chars: int) -> str:
    if limit_chars:
        return f"[{blocks.budget_summary(usage, limit_chars)}]"
    count = usage.entry_count
    return f"[{count:,} {'entry' if count == 1 else 'entries'}, no budget]"


def _usage_entry(usage: Usage, limit_chars: int) -> dict[str, int]:
    """A tier's usage in a structured result."""
    return {
        "used_chars": usage.used_chars,
        "limit_chars": limit_chars,
        "entry_count": usage.entry_count,
    }


# An entry's content as the blocks show it (see Tools._shown).
Shown = Callable[[Memory], str]


def _memory_data(memory: Memory, shown: Shown) -> dict[str, Any]:
    """An entry in a structured result: its content as shown, its size as
    stored (what the budget counts)."""
    return {
        "id": memory.id,
        "target": memory.tier.value,
        "content": shown(memory),
        "chars": len(memory.content),
    }


class Tools:
    """The memory tools over one engine.

    >>> tools = Tools(engine, config.server.limits())
    >>> tools.call(Scope("coder"), "s1", "memory", {"action": "add", "content": "uses uv"}).text
    'Saved to agent notes (target=memory) [0% — 7/2,200 chars]: uses uv'
    """

    def __init__(self, engine: MemoryEngine, limits: Limits) -> None:
        # Every write a call makes is noted on its receipt (its generation,
        # for CallTool's read-your-writes), the memory_20250818 commands' too.
        self._engine = recording(engine)
        self._limits = limits
        self._files = MemoryFiles(self._engine, limits)
        self._runs: dict[str, Callable[[Scope, Mapping[str, Any]], ToolResult]] = {
            MEMORY: self._memory,
            SEARCH: self._search,
            LIST: self._list,
        }

    def definitions(self, scope: Scope) -> list[ToolDef]:
        return definitions(self._engine, scope)

    def claude_memory_tool(self) -> ToolDef:
        """Claude's own memory tool, run by `call` as MEMORY_FILES."""
        return claude_memory_tool()

    def call(
        self, scope: Scope, session_id: str, name: str, arguments: Mapping[str, Any] | None
    ) -> ToolResult:
        """Run one call in `scope` (authorized by the caller). `arguments`
        None: what the model sent is not a JSON object (see arguments_of).
        The result's generation is the highest its writes took (0: none),
        an error's too: a call refused midway may have written before."""
        with receipt() as written:
            result = self._call(scope, session_id, name, arguments)
        return dataclasses.replace(result, generation=written.highest)

    def _call(
        self, scope: Scope, session_id: str, name: str, arguments: Mapping[str, Any] | None
    ) -> ToolResult:
        if not isinstance(arguments, Mapping):
            # The model wrote them: it is told, and may try again.
            return self._refused(
                name,
                "the arguments are not a JSON object; call it again with valid JSON",
                Reason.ARGUMENTS_INVALID,
            )
        if name == MEMORY_FILES:
            return self._files.call(scope, arguments)
        run = self._runs.get(name)
        if run is None:
            raise InvalidArgument(
                f"no tool named {name!r}; the tools are {', '.join([*self._runs, MEMORY_FILES])}",
                reason=Reason.TOOL_UNKNOWN,
                metadata={"name": name},
            )
        allowed = set(SCHEMAS[name]["properties"])
        unknown = sorted(set(arguments) - allowed)
        if unknown:
            return self._refused(
                name,
                f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"{name} takes {', '.join(sorted(allowed))} (the memories you reach are "
                "set by the connection, not by arguments)",
                Reason.ARGUMENTS_INVALID,
            )
        # The call's session, recorded on what it adds (NewEntry.session_id)
        # without threading it through every action's signature.
        token = _SESSION.set(session_id)
        try:
            return run(scope, arguments)
        except _ArgumentError as exc:
            return self._refused(name, str(exc), Reason.ARGUMENTS_INVALID)
        except EntryTooLarge as exc:
            return self._error(scope, name, exc)
        except BudgetExceeded as exc:
            return self._full(scope, name, exc)
        except StoreError:
            raise  # a FailedPrecondition, but the operator's to mend, not the model's
        except _MODELS_TO_FIX as exc:
            return self._error(scope, name, exc)
        finally:
            _SESSION.reset(token)

    # --- the tools ----------------------------------------------------------

    def _memory(self, scope: Scope, arguments: Mapping[str, Any]) -> ToolResult:
        """The `memory` tool: the action's arguments checked, then run."""
        action = _choice(arguments, "action", ACTIONS, "")
        tier = TARGETS[_choice(arguments, "target", list(TARGETS), "memory")]
        limit = self._engine.settings(scope).policy(tier).limit_chars
        if action == "add":
            return self._add(scope, tier, limit, arguments)
        if arguments.get("old_text") is None:
            raise _ArgumentError(
                f"`old_text` is required here: quote the text of the entry to {action}. "
                + self._listing(scope, tier, action)
            )
        old_text = self._old_text(_text(arguments, "old_text", required=True))
        try:
            if action == "replace":
                return self._replace(scope, tier, limit, old_text, arguments)
            return self._remove(scope, tier, limit, old_text, arguments)
        except MatchNotFound as exc:
            raise self._elsewhere(scope, tier, old_text, exc) from None

    def _listing(self, scope: Scope, tier: Tier, action: str) -> str:
        """The tier's entries, numbered, to choose the text to quote from."""
        memories, _ = self._engine.list_memories(scope, [tier], "")
        if not memories:
            return f"{_TIER_NAMES[tier].capitalize()} has no entries to {action}"
        shown = self._shown(scope)
        lines = (f"{n}. {shown(m)}" for n, m in enumerate(memories, 1))
        return (
            f"The entries of {_TIER_NAMES[tier]}:\n"
            + "\n".join(lines)
            + "\nQuote part of one of them as old_text"
        )

    def _elsewhere(
        self, scope: Scope, tier: Tier, old_text: str, exc: MatchNotFound
    ) -> MatchNotFound:
        """`exc`, saying so when the text is in the other target."""
        other = Tier.USER if tier is Tier.MEMORY else Tier.MEMORY
        try:
            self._engine.holding(scope, other, old_text)
        except AmbiguousMatch:
            pass  # there too, in several entries
        except SidecarError:
            return exc  # not there (or not readable there): nothing to add
        return MatchNotFound(
            f"{exc.message}; it is in {_TIER_NAMES[other]}: call again with target={other.value}",
            metadata={**exc.details, "other_target": other.value},
        )

    def _add(
        self, scope: Scope, tier: Tier, limit: int, arguments: Mapping[str, Any]
    ) -> ToolResult:
        content = self._content(_text(arguments, "content", required=True))
        if arguments.get("old_text"):
            raise _ArgumentError("`old_text` is for replace and remove; add takes content")
        added = self._engine.add(NewEntry(scope, tier, content, session_id=_SESSION.get()))
        memory, usage, shown = added.memory, added.usage, self._shown(scope)
        verb = "Saved to" if added.created else "Already saved (an identical entry) in"
        text = f"{verb} {_TIER_NAMES[tier]} {_usage_text(usage, limit)}: {shown(memory)}"
        if added.similar:
            text += (
                "\nIt nearly repeats "
                + "; ".join(repr(shown(s.memory)) for s in added.similar)
                + ". If they say the same, keep one (action=remove with old_text)."
            )
        outcome = self._outcome("add", memory, usage, limit, shown, created=added.created)
        outcome["similar"] = [
            _memory_data(s.memory, shown) | {"score": round(s.score, 4)} for s in added.similar
        ]
        return ToolResult(text, outcome)

    def _replace(
        self, scope: Scope, tier: Tier, limit: int, old_text: str, arguments: Mapping[str, Any]
    ) -> ToolResult:
        """Change `old_text` to `new_text` in the one entry holding it: the
        edit is computed from the entry as read, and written only if the
        entry still says that (another writer in between: read it again)."""
        if "content" in arguments:
            raise _ArgumentError(
                "replace takes `old_text` and `new_text` (only the quoted text changes); "
                "`content` is for add"
            )
        new_text = _text(arguments, "new_text", required=True)
        shown = self._shown(scope)
        for attempt in range(1, _EDIT_ATTEMPTS + 1):
            before = self._engine.holding(scope, tier, old_text)
            edited = _replaced_once(before.content, old_text, new_text, shown(before))
            content = self._content(edited)
            edit = Edit(scope, match=old_text, tier=tier, content=content, expected=before.content)
            try:
                memory, usage, _ = self._engine.update(edit)
                break
            except EditConflict:
                if attempt == _EDIT_ATTEMPTS:
                    raise
        outcome = self._outcome("replace", memory, usage, limit, shown)
        outcome["previous"] = shown(before)
        return ToolResult(
            f"Replaced in {_TIER_NAMES[tier]} {_usage_text(usage, limit)}: now "
            f"{shown(memory)!r} (was {shown(before)!r})",
            outcome,
        )

    def _remove(
        self, scope: Scope, tier: Tier, limit: int, old_text: str, arguments: Mapping[str, Any]
    ) -> ToolResult:
        if arguments.get("content"):
            raise _ArgumentError("`content` is for add and replace; remove takes old_text")
        memory, usage, _ = self._engine.delete(scope, "", match=old_text, tier=tier)
        shown = self._shown(scope)
        return ToolResult(
            f"Removed from {_TIER_NAMES[tier]} {_usage_text(usage, limit)}: {shown(memory)!r}",
            self._outcome("remove", memory, usage, limit, shown),
        )

    def _search(self, scope: Scope, arguments: Mapping[str, Any]) -> ToolResult:
        query = checked(
            "query",
            _text(arguments, "query", required=True),
            self._limits.query_chars,
            multiline=True,
        )
        tiers = _tiers(_choice(arguments, "target", [*TARGETS, "both"], "both"))
        limit = arguments.get("limit", DEFAULT_SEARCH_LIMIT)
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise _ArgumentError("`limit` must be an integer")
        if not 1 <= limit <= MAX_SEARCH_LIMIT:
            raise _ArgumentError(f"`limit` must be between 1 and {MAX_SEARCH_LIMIT}")
        hits = self._engine.search(scope, query, tiers, limit=limit)
        usage, shown = self._engine.usage(scope, tiers), self._shown(scope)
        head = f"{len(hits)} match{'es' if len(hits) != 1 else ''}" if hits else "No matches"
        lines = [f"{head} ({self._usages(scope, usage)})" + (":" if hits else ".")]
        lines.extend(f"{n}. [{m.tier.value}] {shown(m)}" for n, (m, _s) in enumerate(hits, 1))
        return ToolResult(
            "\n".join(lines),
            {
                "ok": True,
                "hits": [_memory_data(m, shown) | {"score": round(s, 4)} for m, s in hits],
                "usage": self._usage_data(scope, usage),
            },
        )

    def _list(self, scope: Scope, arguments: Mapping[str, Any]) -> ToolResult:
        tiers = _tiers(_choice(arguments, "target", [*TARGETS, "both"], "both"))
        memories, usage = self._engine.list_memories(scope, tiers, "")
        settings, shown = self._engine.settings(scope), self._shown(scope)
        lines: list[str] = []
        for tier in tiers:
            limit = settings.policy(tier).limit_chars
            own = [m for m in memories if m.tier is tier]
            lines.append(f"{_TIER_NAMES[tier]} {_usage_text(usage[tier], limit)}:")
            lines.extend(
                f"{n}. ({len(m.content):,} chars) {shown(m)}" for n, m in enumerate(own, 1)
            )
            if not own:
                lines.append("(empty)")
        return ToolResult(
            "\n".join(lines),
            {
                "ok": True,
                "memories": [_memory_data(m, shown) for m in memories],
                "usage": self._usage_data(scope, usage),
            },
        )

    # --- helpers ------------------------------------------------------------

    def _shown(self, scope: Scope) -> Shown:
        """An entry's content as the frozen and turn blocks show it under the
        agent's `content_scanning` (sidecar.retrieval.scanner.shown): quoted,
        withheld, or its forged layout bracketed. Every text and result of
        these tools that holds an entry's content shows it so."""
        mode = self._engine.settings(scope).content_scanning
        return lambda memory: scanner.shown(mode, memory).content

    def _content(self, value: str) -> str:
        return clean_content(checked("content", value, self._limits.content_chars, multiline=True))

    def _old_text(self, value: str) -> str:
        if not value.strip():
            raise _ArgumentError("`old_text` is empty; quote text from the entry to change")
        return checked("old_text", value, self._limits.content_chars, multiline=True)

    def _usages(self, scope: Scope, usage: Mapping[Tier, Usage]) -> str:
        settings = self._engine.settings(scope)
        return ", ".join(
            f"{tier.value} {_usage_text(u, settings.policy(tier).limit_chars)}"
            for tier, u in usage.items()
        )

    def _usage_data(self, scope: Scope, usage: Mapping[Tier, Usage]) -> dict[str, Any]:
        settings = self._engine.settings(scope)
        return {
            tier.value: _usage_entry(u, settings.policy(tier).limit_chars)
            for tier, u in usage.items()
        }

    @staticmethod
    def _outcome(
        action: str, memory: Memory, usage: Usage, limit: int, shown: Shown, *, created: bool = True
    ) -> dict[str, Any]:
        return {
            "ok": True,
            "action": action,
            "created": created,
            "memory": _memory_data(memory, shown),
            "usage": {memory.tier.value: _usage_entry(usage, limit)},
        }

    @staticmethod
    def _refused(name: str, message: str, reason: Reason) -> ToolResult:
        return ToolResult(
            f"{name}: {message}.",
            {"ok": False, "error": {"reason": str(reason), "message": message}},
            is_error=True,
        )

    def _error(self, scope: Scope, name: str, exc: SidecarError) -> ToolResult:
        details = dict(exc.details)
        if isinstance(exc, AmbiguousMatch):
            previews = self._previews(scope, exc)
            quoted = "\n".join(f"- {text!r}" for text in previews.values())
            count = f"more than {len(exc.candidates)}" if exc.more else len(exc.candidates)
            text = (
                f"Not changed: old_text occurs in {count} entries:\n{quoted}"
                f"{chr(10) + '- ...' if exc.more else ''}\n"
                "Quote more of the one you mean as old_text."
            )
            for n, (memory_id, preview) in enumerate(previews.items(), 1):
                details[f"candidate_{n}"] = f"{memory_id} {preview}"
        elif isinstance(exc, SimilarExists):
            similar = self._previews(scope, exc)[exc.memory_id]
            text = (
                f"Not saved: the {exc.tier} target already holds a similar entry: "
                f"{similar!r}. If the new text corrects it, use action=replace with "
                "old_text (the words to change) and new_text; if it says the same, it is "
                "already saved."
            )
        elif isinstance(exc, MatchNotFound):
            text = (
                f"Not changed: {exc.message}. Use memory_list or memory_search to find the "
                "entry's exact text."
            )
        else:
            text = f"Not done: {exc.message}."
        return ToolResult(
            text,
            {"ok": False, "error": {"reason": exc.reason, "message": exc.message, **details}},
            is_error=True,
        )

    def _previews(self, scope: Scope, exc: AmbiguousMatch | SimilarExists) -> dict[str, str]:
        """The entries an error names, by id, as the blocks show them: the
        start of each candidate, the whole of a similar entry."""
        mode = self._engine.settings(scope).content_scanning
        if isinstance(exc, SimilarExists):
            return {exc.memory_id: scanner.shown_text(mode, exc.content, exc.category)}
        previews = {}
        for memory_id, content, category in exc.entries:
            text = scanner.shown_text(mode, content, category)
            # A quote's header takes room: a quoted entry shows as much of
            # its own text as a plain one.
            extra = max(len(text) - len(content), 0)
            previews[memory_id] = text[: AmbiguousMatch.PREVIEW_CHARS + extra]
        return previews

    def _full(self, scope: Scope, name: str, exc: BudgetExceeded) -> ToolResult:
        """A full tier: its entries with their sizes, and what to do."""
        tier = Tier(exc.tier)
        memories, _ = self._engine.list_memories(scope, [tier], "")
        shown = self._shown(scope)
        free = max(exc.limit - exc.used, 0)
        lines = [
            f"Not saved: {_TIER_NAMES[tier]} is full [{exc.used:,}/{exc.limit:,} chars]. "
            f"This needs {exc.requested:,} more characters{_separated(exc)} and {free:,} "
            "are free. "
            "Current entries, with their sizes:",
            *(f"{n}. ({len(m.content):,} chars) {shown(m)}" for n, m in enumerate(memories, 1)),
            "Remove entries that are outdated or less useful (action=remove with old_text), "
            "or shorten some (action=replace), then try again; or save a shorter entry.",
        ]
        return ToolResult(
            "\n".join(lines),
            {
                "ok": False,
                "error": {"reason": exc.reason, "message": exc.message, **exc.details},
                "memories": [_memory_data(m, shown) for m in memories],
            },
            is_error=True,
        )

    # --- what the MCP server offers besides tools ------------------------------

    def frozen_block(self, scope: Scope, session_id: str) -> str:
        """The session's frozen block, as InjectForTurn gives it."""
        return self._engine.inject(scope, session_id).system_block

    def turn_context(self, scope: Scope, session_id: str, user_message: str) -> str:
        """The turn block for `user_message`, as InjectForTurn gives it."""
        message = checked("user_message", user_message, self._limits.message_chars, multiline=True)
        return self._engine.inject(scope, session_id, user_message=message).turn_context


def arguments_of(text: str) -> Mapping[str, Any] | None:
    """A call's JSON arguments ("" is no arguments), or None if not JSON.
    JSON nested too deep, or with half a surrogate pair in a string, is
    refused (InvalidArgument, see caller_json): not the model's to retry."""
    if not text.strip():
        return {}
    try:
        parsed = caller_json("arguments_json", text)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
