"""The generations one tool call's writes took: CallTool answers the highest.

A tool call writes through the engine's add, update and delete, some of
Claude's memory tool's commands several times (`create` and `insert` add a
line each), and a call that fails midway may have written before it
failed. Rather than thread each write's generation back out of every
command, the tools hold the engine wrapped in `Recording`, whose three
writing methods note what each answers on the receipt that `receipt()`
opens for the length of one call (a context variable: each gRPC worker
thread, and each call on it, has its own). A write with no receipt open
notes nothing.

A write's generation is what the engine answers: the one it took, or, for
an add of an entry already saved, the tier's current one (as AddMemory's),
so a read with it sees that entry too.

Owns: noting the generations the engine's writes answer during one tool
call. Must not touch: grpc or the MCP SDK, the store (the engine writes),
what the tools do or say (sidecar.domain.tools, sidecar.domain.memory_files).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    # Annotations only, as the tools': the MCP bridge need not load the engine.
    from sidecar.core.memory import Memory, Scope, Usage
    from sidecar.domain.engine import Added, MemoryEngine
    from sidecar.storage.writes import Edit, NewEntry


class Receipt:
    """The highest generation the writes of one call answered (0: none)."""

    __slots__ = ("highest",)

    def __init__(self) -> None:
        self.highest = 0

    def noted(self, generation: int) -> None:
        self.highest = max(self.highest, generation)


_RECEIPT: contextvars.ContextVar[Receipt | None] = contextvars.ContextVar(
    "tool_receipt", default=None
)


@contextmanager
def receipt() -> Iterator[Receipt]:
    """A receipt the writes made until the block ends are noted on."""
    opened = Receipt()
    token = _RECEIPT.set(opened)
    try:
        yield opened
    finally:
        _RECEIPT.reset(token)


def _noted(generation: int) -> None:
    current = _RECEIPT.get()
    if current is not None:
        current.noted(generation)


class Recording:
    """The engine, its add, update and delete noting their generations;
    everything else is the engine's own."""

    def __init__(self, engine: MemoryEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add(self, entry: NewEntry, **options: Any) -> Added:
        added = self._engine.add(entry, **options)
        _noted(added.generation)
        return added

    def update(self, edit: Edit, **options: Any) -> tuple[Memory, Usage, int]:
        memory, usage, generation = self._engine.update(edit, **options)
        _noted(generation)
        return memory, usage, generation

    def delete(self, scope: Scope, memory_id: str, **options: Any) -> tuple[Memory, Usage, int]:
        memory, usage, generation = self._engine.delete(scope, memory_id, **options)
        _noted(generation)
        return memory, usage, generation


def recording(engine: MemoryEngine) -> MemoryEngine:
    """`engine` as the tools use it: its writes noted on the open receipt.
    Typed as the engine it stands in for (its other methods are the engine's)."""
    return cast("MemoryEngine", Recording(engine))
