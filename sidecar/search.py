"""Finding memories that match a query.

For now a case-insensitive substring match per query term; ranked retrieval
(BM25 blended with confidence) replaces it in the InjectForTurn work.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.memory import Memory


def substring_search(
    memories: Sequence[Memory], query: str, *, match_all: bool = False
) -> list[tuple[Memory, float]]:
    """Memories containing the query's terms, best first.

    The score is the share of distinct terms found (1.0 for an empty query,
    which matches everything). With match_all, a hit must contain every term.
    Ties keep the input order (insertion order), so results are deterministic.
    """
    terms = list(dict.fromkeys(query.casefold().split()))
    if not terms:
        return [(memory, 1.0) for memory in memories]
    hits = []
    for memory in memories:
        text = memory.content.casefold()
        found = sum(1 for term in terms if term in text)
        if found and (found == len(terms) or not match_all):
            hits.append((memory, found / len(terms)))
    hits.sort(key=lambda hit: -hit[1])
    return hits
