"""Rendering what InjectForTurn returns: the frozen block and the turn block.

The system block follows seed 003 exactly:

    ════════════════════════════════════════════════
    MEMORY (agent notes) [42% — 924/2,200 chars]
    ════════════════════════════════════════════════
    <entry 1>
    §
    <entry 2>

then a blank line and the USER PROFILE block the same way. The turn block
follows seed 000: <memories> with one <memory id category tier> per entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from sidecar.memory import SEPARATOR, Memory, Tier, Usage

RULE = "═" * 48
_HEADERS = {Tier.MEMORY: "MEMORY (agent notes)", Tier.USER: "USER PROFILE (who the user is)"}


@dataclass(frozen=True, slots=True)
class TierBlock:
    """One tier's part of the system block."""

    text: str
    shown: tuple[Memory, ...]


def tier_block(
    tier: Tier,
    memories: Sequence[Memory],
    usage: Usage,
    limit_chars: int,
    *,
    costs: Sequence[int],
    order: Sequence[int],
    separator_cost: int,
    max_tokens: int,
) -> TierBlock | None:
    """A tier's block, or None when the tier is empty.

    A budgeted tier shows every entry in insertion order (the budget keeps it
    small). An unlimited tier shows its highest-ranked entries (confidence,
    then recency) that fit in `max_tokens`, so the block does not depend on
    the prompt and stays byte-identical between writes. `costs` holds each
    entry's token count, in the order of `memories`; `order` lists the
    entries' positions by confidence, then recency, then insertion.
    """
    if not memories:
        return None
    if limit_chars:
        shown = tuple(memories)
        percent = usage.used_chars * 100 // limit_chars
        summary = f"{percent}% — {usage.used_chars:,}/{limit_chars:,} chars"
    else:
        picked: list[Memory] = []
        spent = 0
        for position in order:
            memory = memories[position]
            cost = costs[position] + (separator_cost if picked else 0)
            if spent + cost > max_tokens:
                continue
            picked.append(memory)
            spent += cost
        shown = tuple(picked)
        count = len(memories)
        summary = f"{count:,} {'entry' if count == 1 else 'entries'}"
        if len(shown) < count:
            summary += f", {len(shown):,} shown"
    body = SEPARATOR.join(m.content for m in shown)
    return TierBlock(f"{RULE}\n{_HEADERS[tier]} [{summary}]\n{RULE}\n{body}", shown)


def system_block(blocks: Sequence[TierBlock | None]) -> str:
    return "\n\n".join(block.text for block in blocks if block is not None)


_ATTR = {'"': "&quot;", "\n": "&#10;", "\r": "&#13;", "\t": "&#9;"}


def _attr(value: str) -> str:
    return '"' + escape(value, _ATTR) + '"'


def memory_element(memory: Memory) -> str:
    """One <memory>; content and attributes escaped so nothing breaks out."""
    return (
        f"<memory id={_attr(memory.id)} category={_attr(memory.category)}"
        f" tier={_attr(memory.tier.value)}>{escape(memory.content)}</memory>"
    )


def turn_context(elements: Sequence[str]) -> str:
    if not elements:
        return ""
    return "<memories>\n" + "".join(f"  {e}\n" for e in elements) + "</memories>"
