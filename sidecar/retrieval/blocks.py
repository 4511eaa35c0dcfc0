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

Owns: the exact text of both blocks (rules, headers and their usage summary, the
separator, <memory> escaping) and `pick`, what an unlimited tier shows within its
budget. Must not touch: token counting or scanning (callers pass costs and
screened entries), the store, snapshots, sessions, gRPC: pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from sidecar.core.memory import SEPARATOR, Memory, Tier, Usage

RULE = "═" * 48
_HEADERS = {Tier.MEMORY: "MEMORY (agent notes)", Tier.USER: "USER PROFILE (who the user is)"}


@dataclass(frozen=True, slots=True)
class TierBlock:
    """One tier's part of the system block."""

    text: str
    shown: tuple[Memory, ...]


def budget_summary(usage: Usage, limit_chars: int) -> str:
    """A budgeted tier's usage as its header shows it: "42% — 924/2,200 chars"."""
    percent = usage.used_chars * 100 // limit_chars
    return f"{percent}% — {usage.used_chars:,}/{limit_chars:,} chars"


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
    count: int | None = None,
) -> TierBlock | None:
    """A tier's block, or None when the tier is empty.

    A budgeted tier shows every entry in insertion order (the budget keeps it
    small). An unlimited tier shows its highest-ranked entries (confidence,
    then recency, then insertion) that fit in `max_tokens` (see `pick`), so
    the block does not depend on the prompt and stays byte-identical between
    writes. `costs`
    holds each entry's token count, in the order of `memories`; `order`
    lists the entries' positions by rank. `count` is the tier's number of
    entries when `memories` holds only those that may be shown.
    """
    if not memories and not count:
        return None
    if limit_chars:
        shown = tuple(memories)
        summary = budget_summary(usage, limit_chars)
    else:
        picked = pick(((memories[p], costs[p]) for p in order), separator_cost, max_tokens)
        shown = tuple(memory for memory, _cost in picked)
        count = len(memories) if count is None else count
        summary = f"{count:,} {'entry' if count == 1 else 'entries'}"
        if len(shown) < count:
            summary += f", {len(shown):,} shown"
    body = SEPARATOR.join(m.content for m in shown)
    return TierBlock(f"{RULE}\n{_HEADERS[tier]} [{summary}]\n{RULE}\n{body}", shown)


# How many entries that do not fit an unlimited tier's block passes over
# before it is closed: a large entry near the top does not empty the block,
# and a tier of a million entries is not read to the end looking for one
# small enough (a compact tier reads them from the database).
MAX_SKIPPED = 64


def pick(
    ranked: Iterable[tuple[Memory, int]], separator_cost: int, max_tokens: int
) -> list[tuple[Memory, int]]:
    """From (memory, token cost) pairs in rank order, the pairs of the entries
    an unlimited tier's block shows: each that still fits in `max_tokens`,
    passing over those that do not, until nothing more can fit or MAX_SKIPPED
    were passed."""
    picked: list[tuple[Memory, int]] = []
    spent = skipped = 0
    for memory, cost in ranked:
        spend = cost + (separator_cost if picked else 0)
        if spent + spend > max_tokens:
            skipped += 1
            if skipped >= MAX_SKIPPED:
                break
            continue
        picked.append((memory, cost))
        spent += spend
        if separator_cost and max_tokens - spent < separator_cost:
            break  # every further entry costs at least the separator
    return picked


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
