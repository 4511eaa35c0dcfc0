"""Claude's own memory tool (`memory_20250818`) over a scope's two tiers.

A runtime that declares Anthropic's memory tool (`{"type": "memory_20250818",
"name": "memory"}`) hands each of Claude's `tool_use` inputs to CallTool as
it is (name `memory_20250818`), and returns the text as the `tool_result`.
The model sees a directory, `/memories`, of two files: `notes.md` is the
agent-notes tier, `user.md` the user profile, each entry on its own line in
the order saved. `view`, `create` (an empty file), `str_replace` (in one
entry) and `insert` (at the end) act on the tiers; `delete`, `rename`, any
other path and any path outside /memories are refused, with a text naming
the two files. docs/API.md says what each command does, exactly.

The output and error texts follow Anthropic's reference implementation of
this tool for implementers, the Python SDK's `BetaLocalFilesystemMemoryTool`
(anthropic-sdk-python, `src/anthropic/lib/tools/_beta_builtin_memory_tool.py`):
its view header and six-wide line numbers, "The path ... does not exist.
Please provide a valid path.", "No replacement was performed, old_str `...`
did not appear verbatim in ...", "Multiple occurrences of old_str ... in
lines: ...", "Invalid `insert_line` parameter", "File ... already exists",
"Cannot delete the /memories directory itself", so what the model learnt
of that tool applies. What that implementation cannot meet (a full tier, an
edit across entries) says what to do next.

Every write goes through the engine's add, update and delete, as the
`memory` tool's (sidecar.domain.tools): budgets, the content scanner,
duplicates and similar entries, expiry, replicas, erasure and the frozen
block apply alike; an edit is computed from the entry as read and written
only if the entry still says that (`Edit.expected`), read again after a
race.

Owns: the `memory_20250818` commands: paths, the files' text and line
numbers, what each command does to the tiers, and the texts the model
reads. Must not touch: grpc or the MCP SDK, the store (everything goes
through the engine), the scope (the caller's, authorized by the edge).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.core.errors import (
    AlreadyExists,
    BudgetExceeded,
    EditConflict,
    EntryTooLarge,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
    SidecarError,
    SimilarExists,
    StoreError,
)
from sidecar.core.limits import Limits, checked
from sidecar.core.memory import SEPARATOR_CHARS, Memory, Scope, Tier, clean_content
from sidecar.domain.tool_definitions import MEMORY_FILE_ARGUMENTS, ToolResult
from sidecar.retrieval import scanner
from sidecar.storage.writes import Edit, NewEntry, check_budget

if TYPE_CHECKING:
    from sidecar.domain.engine import MemoryEngine

ROOT = "/memories"
FILES = {f"{ROOT}/notes.md": Tier.MEMORY, f"{ROOT}/user.md": Tier.USER}
_PATHS = {tier: path for path, tier in FILES.items()}
_THE_FILES = (
    f"{ROOT} holds two files: {ROOT}/notes.md (your notes: the environment, conventions, "
    f"lessons learned) and {ROOT}/user.md (what you learn about the user)"
)
# The reference's line numbers: right-aligned in six columns, then a tab.
_NUMBER_WIDTH = 6
# An edit read again after another writer changed its entry meanwhile.
_EDIT_ATTEMPTS = 3
_MODELS_TO_FIX = (InvalidArgument, NotFound, FailedPrecondition, AlreadyExists)
# What a path may not hold: a way out (`..`, `.`), an escape the model might
# expect decoded (`%2e`), another separator, a control character.
_UNSAFE = re.compile(r"[%\\\x00-\x1f\x7f]")


class _Refused(Exception):
    """A command refused, with the text the model reads and its reason."""

    def __init__(self, text: str, reason: Reason, **details: object) -> None:
        super().__init__(text)
        self.text = text
        self.reason = reason
        self.details = details


@dataclass(frozen=True, slots=True)
class _File:
    """A tier as the model sees it: its entries, one after another. Edits
    find their text in `text`, as stored; the model reads (and numbers the
    lines of) `shown`, each entry as the blocks show it (scanner.shown)."""

    path: str
    tier: Tier
    memories: list[Memory]
    shown: list[str]

    @property
    def text(self) -> str:
        return "\n".join(m.content for m in self.memories)

    def lines(self) -> list[str]:
        return "\n".join(self.shown).split("\n") if self.memories else []

    def line_at(self, at: int) -> int:
        """The line, as `lines` numbers them from 1, of offset `at` of `text`
        (an entry shown otherwise than stored: its first line)."""
        line = 1
        spans = zip(self.memories, self.shown, self.spans(), strict=True)
        for memory, shown, (start, end) in spans:
            if at <= end:
                inside = memory.content[: max(at - start, 0)] if shown == memory.content else ""
                return line + inside.count("\n")
            line += shown.count("\n") + 1
        return line

    def spans(self) -> list[tuple[int, int]]:
        """Each entry's [start, end) in `text`."""
        spans, start = [], 0
        for memory in self.memories:
            spans.append((start, start + len(memory.content)))
            start += len(memory.content) + 1
        return spans


def _numbered(lines: Sequence[str], first: int = 1) -> str:
    return "\n".join(f"{n:>{_NUMBER_WIDTH}}\t{line}" for n, line in enumerate(lines, first))


def _size(text: str) -> str:
    """A file's size as the reference's directory view shows it."""
    size = len(text.encode())
    if size < 1024:
        return f"{size}B"
    scaled = size / 1024
    return f"{scaled:.0f}K" if scaled == int(scaled) else f"{scaled:.1f}K"


def _string(arguments: Mapping[str, Any], name: str) -> str:
    value = arguments.get(name)
    if not isinstance(value, str):
        raise _Refused(
            f"`{name}` is required here, as a string", Reason.ARGUMENTS_INVALID, argument=name
        )
    return value


def _integer(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Refused(f"`{name}` must be an integer", Reason.ARGUMENTS_INVALID, argument=name)
    return value


def _memory_path(value: object, name: str = "path") -> str:
    """`value` as a path under /memories, normalised ("/memories/" is the
    directory, "//" one "/"); refused when it leads anywhere else."""
    if not isinstance(value, str):
        raise _Refused(
            f"`{name}` is required here, as a string", Reason.ARGUMENTS_INVALID, argument=name
        )
    if value != ROOT and not value.startswith(ROOT + "/"):
        raise _Refused(f"Path must start with {ROOT}, got: {value}", Reason.PATH_OUTSIDE_MEMORIES)
    parts = [part for part in value[len(ROOT) :].split("/") if part]
    if _UNSAFE.search(value) or any(part in (".", "..") for part in parts):
        raise _Refused(f"Path {value} would escape {ROOT} directory", Reason.PATH_OUTSIDE_MEMORIES)
    return "/".join([ROOT, *parts])


def _missing(path: str) -> _Refused:
    return _Refused(
        f"The path {path} does not exist. Please provide a valid path. {_THE_FILES}.",
        Reason.PATH_NOT_FOUND,
        path=path,
    )


class MemoryFiles:
    """The `memory_20250818` commands over one engine.

    >>> files = MemoryFiles(engine, config.server.limits())
    >>> notes = {"path": "/memories/notes.md"}
    >>> files.call(scope, {"command": "create", **notes, "file_text": "uses uv"}).text
    'File created successfully at: /memories/notes.md'
    >>> files.call(scope, {"command": "view", **notes}).text.splitlines()
    ["Here's the content of /memories/notes.md with line numbers:", '     1\\tuses uv']
    """

    def __init__(self, engine: MemoryEngine, limits: Limits) -> None:
        self._engine = engine
        self._limits = limits
        self._commands: dict[str, Callable[[Scope, Mapping[str, Any]], str]] = {
            "view": self._view,
            "create": self._create,
            "str_replace": self._str_replace,
            "insert": self._insert,
            "delete": self._delete,
            "rename": self._rename,
        }

    def call(self, scope: Scope, arguments: Mapping[str, Any]) -> ToolResult:
        """Run one command (a `tool_use` block's input) in `scope`."""
        command = arguments.get("command")
        try:
            run = self._commands.get(command) if isinstance(command, str) else None
            if run is None:
                raise _Refused(
                    f"Unknown command {command!r}; the commands are {', '.join(self._commands)}",
                    Reason.ARGUMENTS_INVALID,
                    argument="command",
                )
            self._known(str(command), arguments)
            return ToolResult(run(scope, arguments), {"ok": True, "command": command})
        except _Refused as exc:
            return _error(exc.text, str(exc.reason), exc.text, exc.details)
        except BudgetExceeded as exc:
            return self._full(scope, exc)
        except StoreError:
            raise  # the operator's to mend, not the model's
        except _MODELS_TO_FIX as exc:
            return _error(self._not_done(scope, exc), exc.reason, exc.message, exc.details)

    @staticmethod
    def _known(command: str, arguments: Mapping[str, Any]) -> None:
        allowed = {"command", *MEMORY_FILE_ARGUMENTS[command]}
        unknown = sorted(set(arguments) - allowed)
        if unknown:
            raise _Refused(
                f"Unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"{command} takes {', '.join(sorted(allowed))} (the memories you reach are set "
                "by the connection, not by arguments)",
                Reason.ARGUMENTS_INVALID,
            )

    # --- the commands -------------------------------------------------------

    def _view(self, scope: Scope, arguments: Mapping[str, Any]) -> str:
        path = _memory_path(arguments.get("path"))
        if path == ROOT:
            files = [self._file(scope, tier) for tier in Tier]
            lines = [f"{_size(''.join(f.text for f in files))}\t{ROOT}"]
            lines += [f"{_size(f.text)}\t{f.path}" for f in files]
            return (
                f"Here're the files and directories up to 2 levels deep in {ROOT}, "
                "excluding hidden items:\n" + "\n".join(lines)
            )
        lines = self._file(scope, self._tier(path)).lines()
        first = 1
        window = arguments.get("view_range")
        if window is not None:
            first, last = _view_range(window, len(lines))
            lines = lines[first - 1 : last]
        head = f"Here's the content of {path} with line numbers:"
        return f"{head}\n{_numbered(lines, first)}" if lines else head

    def _create(self, scope: Scope, arguments: Mapping[str, Any]) -> str:
        path = _memory_path(arguments.get("path"))
        text = _string(arguments, "file_text")
        if path == ROOT:
            raise _Refused(f"{ROOT} is a directory. {_THE_FILES}.", Reason.NOT_A_FILE, path=path)
        if path not in FILES:
            raise _Refused(
                f"Cannot create {path}: {_THE_FILES}; write to one of them.",
                Reason.FILE_FIXED,
                path=path,
            )
        file = self._file(scope, FILES[path])
        if file.memories:
            raise _Refused(
                f"File {path} already exists. It holds {len(file.memories)} "
                f"{'entry' if len(file.memories) == 1 else 'entries'}, one per line: view it, "
                "then add lines with insert or change them with str_replace.",
                Reason.FILE_EXISTS,
                path=path,
            )
        self._add_lines(scope, file, text, "file_text")
        return f"File created successfully at: {path}"

    def _insert(self, scope: Scope, arguments: Mapping[str, Any]) -> str:
        file = self._file(scope, self._tier(_memory_path(arguments.get("path"))))
        line = _integer(arguments.get("insert_line"), "insert_line")
        text = _string(arguments, "insert_text")
        count = len(file.lines())
        if not 0 <= line <= count:
            raise _Refused(
                f"Invalid `insert_line` parameter: {line}. It should be within the range "
                f"[0, {count}].",
                Reason.LINE_OUT_OF_RANGE,
                insert_line=line,
                lines=count,
            )
        added = self._add_lines(scope, file, text, "insert_text")
        answer = f"The file {file.path} has been edited."
        if line != count and added:
            # Where the model asked is not where the text is: say so, or its
            # idea of the line numbers drifts from the file's.
            named = f"line {added[0]}" if len(added) == 1 else f"lines {', '.join(map(str, added))}"
            answer += (
                f" Entries stay in the order they were saved, so the new text is at the "
                f"end: {named}."
            )
        return answer

    def _str_replace(self, scope: Scope, arguments: Mapping[str, Any]) -> str:
        path = _memory_path(arguments.get("path"))
        tier = self._tier(path)
        old, new = _string(arguments, "old_str"), _string(arguments, "new_str")
        if not old:
            raise _Refused(
                "`old_str` is empty; quote the text to replace, exactly as view shows it",
                Reason.ARGUMENTS_INVALID,
                argument="old_str",
            )
        checked("old_str", old, self._limits.content_chars, multiline=True)
        checked("new_str", new, self._limits.content_chars, multiline=True)
        for attempt in range(1, _EDIT_ATTEMPTS + 1):
            file = self._file(scope, tier)
            index, start, end, made = self._located(scope, file, old, new)
            try:
                after = self._edited(scope, file, index, start, end, made)
                break
            except EditConflict:
                if attempt == _EDIT_ATTEMPTS:
                    raise
        if not after.memories:
            return f"The memory file has been edited. {path} is now empty."
        # The changed line, and two either side, as the file is now.
        line = file.line_at(file.spans()[index][0] + start) - 1
        first = max(0, line - 2)
        return (
            "The memory file has been edited. Here is the snippet showing the change (with "
            "line numbers):\n" + _numbered(after.lines()[first : line + 3], first + 1)
        )

    def _delete(self, scope: Scope, arguments: Mapping[str, Any]) -> str:
        path = _memory_path(arguments.get("path"))
        if path == ROOT:
            raise _Refused(
                f"Cannot delete the {ROOT} directory itself", Reason.FILE_FIXED, path=path
            )
        if path in FILES:
            raise _Refused(
                f"Cannot delete {path}: the two memory files always exist. To remove an "
                "entry, str_replace its whole line with an empty new_str.",
                Reason.FILE_FIXED,
                path=path,
            )
        raise _Refused(
            f"The path {path} does not exist. {_THE_FILES}.", Reason.PATH_NOT_FOUND, path=path
        )

    def _rename(self, scope: Scope, arguments: Mapping[str, Any]) -> str:
        old = _memory_path(arguments.get("old_path"), "old_path")
        _memory_path(arguments.get("new_path"), "new_path")
        if old == ROOT or old in FILES:
            raise _Refused(
                f"Cannot rename {old}: the memory files have fixed names. {_THE_FILES}.",
                Reason.FILE_FIXED,
                path=old,
            )
        raise _Refused(
            f"The path {old} does not exist. {_THE_FILES}.", Reason.PATH_NOT_FOUND, path=old
        )

    # --- str_replace's steps --------------------------------------------------

    def _located(self, scope: Scope, file: _File, old: str, new: str) -> tuple[int, int, int, str]:
        """The entry `old` changes, once in the whole file; where in it, and
        to what. What `old` and `new` share at either end is not a change
        ("a\\nb" to "a\\nB" edits the second entry alone)."""
        text = file.text
        count = text.count(old)
        if count == 0:
            raise self._not_there(scope, file, old)
        if count > 1:
            lines, at = [], text.find(old)
            while at != -1:
                lines.append(file.line_at(at))
                at = text.find(old, at + 1)
            raise _Refused(
                f"No replacement was performed. Multiple occurrences of old_str `{old}` in "
                f"lines: {', '.join(map(str, lines))}. Please ensure it is unique",
                Reason.AMBIGUOUS_MATCH,
                lines=lines,
            )
        found = text.find(old)
        shared, old, new = _changed(old, new)
        at = found + shared
        for index, (start, end) in enumerate(file.spans()):
            if start <= at and at + len(old) <= end:
                return index, at - start, at - start + len(old), new
            whole = (at, at + len(old)) in ((start, end + 1), (start - 1, end))
            if whole and not new:
                # A whole line and its line break, to nothing: the entry goes.
                return index, 0, end - start, new
        first, last = file.line_at(at), file.line_at(at + len(old))
        raise _Refused(
            f"No replacement was performed: old_str spans lines {first}-{last} of {file.path}, "
            "which belong to different entries (each entry is its own line, or lines). "
            "Replace within one entry at a time; to remove an entry, replace its whole line "
            "with an empty new_str.",
            Reason.SPANS_ENTRIES,
            lines=[first, last],
        )

    def _not_there(self, scope: Scope, file: _File, old: str) -> _Refused:
        text = (
            f"No replacement was performed, old_str `{old}` did not appear verbatim in {file.path}."
        )
        other = Tier.USER if file.tier is Tier.MEMORY else Tier.MEMORY
        try:
            elsewhere = old in self._file(scope, other).text
        except SidecarError:
            elsewhere = False  # not readable there: nothing to add
        if elsewhere:
            text += f" It is in {_PATHS[other]}: call str_replace with that path."
        return _Refused(text, Reason.MATCH_NOT_FOUND, path=file.path)

    def _edited(
        self, scope: Scope, file: _File, index: int, start: int, end: int, new: str
    ) -> _File:
        """`file` with [start, end) of entry `index` made `new`: written only
        if the entry still says what it said (EditConflict otherwise), and
        removed when nothing is left of it."""
        before = file.memories[index]
        content = before.content[:start] + new + before.content[end:]
        memories = list(file.memories)
        if content.strip():
            edit = Edit(scope, before.id, content=clean_content(content), expected=before.content)
            memories[index], _usage, _ = self._engine.update(edit)
        else:
            self._engine.delete(scope, before.id)
            del memories[index]
        return self._file(scope, file.tier, memories)

    # --- helpers ------------------------------------------------------------

    def _tier(self, path: str) -> Tier:
        if path == ROOT:
            raise _Refused(f"The path {path} is not a file.", Reason.NOT_A_FILE, path=path)
        if path not in FILES:
            raise _missing(path)
        return FILES[path]

    def _file(self, scope: Scope, tier: Tier, memories: list[Memory] | None = None) -> _File:
        """The tier's file (of `memories`, or as read now), as the agent's
        content_scanning shows it."""
        if memories is None:
            memories, _ = self._engine.list_memories(scope, [tier], "")
        mode = self._engine.settings(scope).content_scanning
        shown = [scanner.shown(mode, memory).content for memory in memories]
        return _File(_PATHS[tier], tier, memories, shown)

    def _add_lines(self, scope: Scope, file: _File, text: str, name: str) -> list[int]:
        """Each non-blank line of `text` added as an entry, in order; the
        lines of the file they are on. Several lines are checked against
        the budget together first, so a full tier saves none of them."""
        lines = [clean_content(line) for line in text.split("\n") if line.strip()]
        if not lines:
            raise _Refused(
                f"`{name}` is empty; give the text to save, one entry per line",
                Reason.ARGUMENTS_INVALID,
                argument=name,
            )
        for line in lines:
            checked(name, line, self._limits.content_chars, multiline=True)
        if len(lines) > 1:
            self._check_budget(scope, file.tier, lines)
        for line in lines:
            self._engine.add(NewEntry(scope, file.tier, line))
        # Where they are now (an identical entry was there already, or a
        # concurrent write came first).
        after = self._file(scope, file.tier)
        saved = set(lines)
        return [
            after.line_at(start)
            for memory, (start, _end) in zip(after.memories, after.spans(), strict=True)
            if memory.content in saved
        ]

    def _not_done(self, scope: Scope, exc: SidecarError) -> str:
        if not isinstance(exc, SimilarExists):
            return f"Not done: {exc.message}."
        mode = self._engine.settings(scope).content_scanning
        return (
            f"Not saved: {_PATHS[Tier(exc.tier)]} already holds a similar entry: "
            f"{scanner.shown_text(mode, exc.content, exc.category)!r}. If the new text "
            "corrects it, str_replace the words that changed; if it says the same, it is "
            "already saved."
        )

    def _check_budget(self, scope: Scope, tier: Tier, lines: Sequence[str]) -> None:
        """Refuse new entries `lines` that do not fit the tier together (each
        add checks itself alone)."""
        usage = self._engine.usage(scope, [tier])[tier]
        policy = self._engine.settings(scope).policy(tier)
        separators = SEPARATOR_CHARS * (len(lines) - (0 if usage.entry_count else 1))
        needed = sum(map(len, lines)) + separators
        if not policy.limit_chars or usage.used_chars + needed <= policy.limit_chars:
            return
        longest = max(map(len, lines))
        if longest > policy.limit_chars:
            # One line longer than the whole budget: EntryTooLarge says so.
            check_budget(tier, policy, usage.used_chars, longest, longest)
        raise BudgetExceeded(
            tier=tier.value,
            label=tier.label,
            used=usage.used_chars,
            limit=policy.limit_chars,
            requested=needed,
            separator=separators,
        )

    def _full(self, scope: Scope, exc: BudgetExceeded) -> ToolResult:
        """A full tier: its lines with their sizes, and what to do."""
        file = self._file(scope, Tier(exc.tier))
        if isinstance(exc, EntryTooLarge):
            text = f"Not saved: {exc.message}."
        else:
            free = max(exc.limit - exc.used, 0)
            separator = (
                f" ({exc.requested - exc.separator:,} for the text, {exc.separator} for the "
                "separators between entries)"
                if exc.separator
                else ""
            )
            sizes = (len(m.content) for m in file.memories)
            sized = [f"({n:,} chars) {text}" for n, text in zip(sizes, file.shown, strict=True)]
            text = "\n".join(
                [
                    f"Not saved: {file.path} ({file.tier.label}) is full "
                    f"[{exc.used:,}/{exc.limit:,} chars]. This needs {exc.requested:,} more "
                    f"characters{separator} and {free:,} are free. Its entries, with their "
                    "sizes:",
                    *([_numbered(sized)] if sized else []),
                    "Remove entries that are outdated or less useful (str_replace the whole "
                    "line with an empty new_str), or shorten some, then try again; or save "
                    "shorter text.",
                ]
            )
        return _error(text, exc.reason, exc.message, exc.details)


def _view_range(window: object, count: int) -> tuple[int, int]:
    """`view_range` [first, last] (last -1: to the end) checked against a
    file of `count` lines; a `last` past the end is the end."""
    if (
        not isinstance(window, list)
        or len(window) != 2
        or any(isinstance(n, bool) or not isinstance(n, int) for n in window)
    ):
        raise _Refused(
            "`view_range` must be two line numbers, [first, last] (last -1: to the end)",
            Reason.ARGUMENTS_INVALID,
            argument="view_range",
        )
    first, last = window
    if not 1 <= first <= count:
        raise _Refused(
            f"Invalid `view_range` parameter: {window}. Its first element `{first}` should be "
            f"within the range of lines of the file: [1, {count}].",
            Reason.LINE_OUT_OF_RANGE,
            lines=count,
        )
    if last != -1 and last < first:
        raise _Refused(
            f"Invalid `view_range` parameter: {window}. Its second element `{last}` should be "
            f"-1 or at least its first element `{first}`.",
            Reason.LINE_OUT_OF_RANGE,
            lines=count,
        )
    return first, count if last == -1 else min(last, count)


def _error(text: str, reason: str, message: str, details: Mapping[str, object]) -> ToolResult:
    return ToolResult(
        text,
        {"ok": False, "error": {"reason": reason, "message": message, **details}},
        is_error=True,
    )


def _changed(old: str, new: str) -> tuple[int, str, str]:
    """`old` -> `new` less what they share at either end: how many leading
    characters were shared, and what is left of each."""
    shortest = min(len(old), len(new))
    head = 0
    while head < shortest and old[head] == new[head]:
        head += 1
    tail = 0
    while tail < shortest - head and old[-1 - tail] == new[-1 - tail]:
        tail += 1
    return head, old[head : len(old) - tail], new[head : len(new) - tail]
