"""Turn composition: the transient block of an InjectForTurn.

Given the session's snapshot (sidecar.domain.snapshots) and the current partitions
of the scope's enabled tiers, pick the memories relevant to this turn's
messages that the frozen block does not already show: terms by the agent's
strategy (sidecar.domain.queries), ranked by sidecar.retrieval.ranking, within the turn's
count and token budget, each scanned before it may enter a prompt.

Owns: `Injection` (what a turn answers) and the turn block. Must not touch:
sessions, the partition cache or snapshots (it is handed what it reads),
the store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from sidecar.config.settings import AgentSettings
from sidecar.core.memory import Memory, Tier, Usage
from sidecar.core.tokens import TokenCounter
from sidecar.domain.partition import AnyPartition
from sidecar.domain.queries import Queries, weights
from sidecar.domain.snapshots import View
from sidecar.retrieval import blocks, scanner
from sidecar.retrieval.compact import CompactPartition
from sidecar.retrieval.ranking import rank


@dataclass(frozen=True, slots=True)
class Injection:
    """What InjectForTurn answers."""

    system_block: str
    turn_context: str
    generation: int
    sha256: str
    cache_hit: bool
    system_memory_ids: tuple[str, ...]
    turn_memory_ids: tuple[str, ...]
    system_tokens: int
    turn_tokens: int
    token_counter: str
    usage: dict[Tier, Usage]
    # The snapshot the frozen block came from: the same object on every
    # cached turn, so callers may cache what they derive from it.
    snapshot: View


@functools.cache
def enabled_tiers(settings: AgentSettings) -> tuple[Tier, ...]:
    return tuple(t for t in Tier if settings.policy(t).enabled)


def _covers(view: View, enabled: list[AnyPartition]) -> bool:
    """Whether the frozen block shows exactly the entries of `enabled`."""
    return all(p in view.partitions for p in enabled)


class Turns:
    """Composes turn blocks."""

    def __init__(self, queries: Queries, tokens: TokenCounter) -> None:
        self._queries = queries
        self._tokens = tokens

    def context(
        self,
        settings: AgentSettings,
        view: View,
        enabled: list[AnyPartition],
        *,
        user_message: str,
        recent_messages: Sequence[str],
        given_keywords: Sequence[str],
        strategy: str,
        max_memories: int,
        max_tokens: int,
    ) -> tuple[str, tuple[str, ...]]:
        """The turn block and the ids of the memories it shows."""
        # When the frozen block already shows every memory there is (the usual
        # case with budgeted tiers), nothing is left to rank: skip keyword
        # extraction and ranking altogether.
        left = sum(p.count for p in enabled) - len(view.shown_ids)
        if not settings.inject_memories or (left <= 0 and _covers(view, enabled)):
            return blocks.turn_context([]), ()
        terms = self._queries.turn_keywords(
            settings, strategy, user_message, recent_messages, given_keywords
        )
        shown = set(view.shown_ids)
        cap = max_memories or settings.max_inject_memories
        budget = max_tokens or settings.max_injection_tokens
        element = _screening(enabled, settings.content_scanning)
        # Rank only as deep as the turn can use (the cap; what the frozen
        # block shows is left out), deeper only if the budget passed over
        # some, and then over at most MAX_SKIPPED more, as the frozen
        # block does: a compact tier reads every entry ranked.
        depth = cap
        deepest = cap + blocks.MAX_SKIPPED
        meaning = self._queries.meaning(settings, user_message, terms, enabled)
        while True:
            ranked = rank(
                enabled,
                terms,
                weights(settings),
                limit=depth,
                leave_out=view.shown_seqs,
                semantic=meaning,
            )
            elements, turn_ids = self._fitted(ranked, shown, cap, budget, element)
            if len(elements) >= cap or len(ranked) < depth or depth >= deepest:
                break
            depth = min(depth * 4, deepest)
        return blocks.turn_context(elements), tuple(turn_ids)

    def _fitted(
        self,
        ranked: Sequence[tuple[Memory, float]],
        shown: Container[str],
        cap: int,
        budget: int,
        element: Callable[[Memory], str],
    ) -> tuple[list[str], list[str]]:
        """The elements of the first `cap` ranked memories not `shown` that
        fit together within `budget` tokens, and their ids."""
        elements: list[str] = []
        turn_ids: list[str] = []
        spent = self._tokens.count(blocks.turn_context([""]))
        for memory, _score in ranked:
            if len(elements) >= cap:
                break
            if memory.id in shown:
                continue
            text = element(memory)
            cost = self._tokens.count(text)
            if spent + cost > budget:
                continue
            elements.append(text)
            turn_ids.append(memory.id)
            spent += cost
        return elements, turn_ids


def _screening(enabled: Sequence[AnyPartition], mode: str) -> Callable[[Memory], str]:
    """A ranked memory's element as it may enter a prompt under scanning
    `mode`, with the finding its partition keeps for it."""
    findings = {k: v for p in enabled for k, v in p.flagged.items()}
    # Entries of a compact tier are scanned when read, not at load.
    rescan = any(isinstance(p, CompactPartition) for p in enabled)

    def element(memory: Memory) -> str:
        finding = findings.get(memory.id)
        if finding is None and rescan:
            finding = scanner.finding(memory)
        return blocks.memory_element(scanner.injectable(mode, memory, finding))

    return element
