"""What a query asks for: its keyword terms and its semantic scores.

Keywords come by the agent's strategy: local extraction (sidecar.keywords),
or an LLM endpoint (sidecar.llm) that, once it fails, is skipped for a
while and the local terms used instead. Semantic scores are the query's
cosines with a partition's entries (sidecar.semantic), blended into BM25 by
sidecar.ranking.rank.

Owns: strategy choice and the endpoints' back-off. Must not touch: the
partition cache, snapshots or sessions, and the store (semantic vectors are
sidecar.semantic's business).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sidecar.config import AgentSettings
from sidecar.keywords import keywords
from sidecar.llm import KeywordModel, KeywordModelError, Pause
from sidecar.metrics import Metrics
from sidecar.partitions import AnyPartition
from sidecar.ranking import SemanticScores, Weights
from sidecar.semantic import Floats, Semantic

log = logging.getLogger(__name__)


def weights(settings: AgentSettings) -> Weights:
    """The agent's weights of similarity and confidence in a score."""
    return Weights(settings.similarity_weight, settings.confidence_weight)


class Queries:
    """Keyword terms and semantic scores for searches and turns."""

    def __init__(self, metrics: Metrics, semantic: Semantic | None) -> None:
        self._metrics = metrics
        self.semantic = semantic
        # Per keyword endpoint: after it fails, turns skip it for a while.
        self._keyword_pauses: dict[str, Pause] = {}

    def meaning(
        self,
        settings: AgentSettings,
        text: str,
        terms: Sequence[str],
        partitions: Sequence[AnyPartition],
    ) -> SemanticScores | None:
        """The query's cosines with the partitions' entries, for rank(); None
        without semantic retrieval (or with semantic_weight 0: off for this
        agent), for a query without keywords (rank() ranks it by confidence),
        or when the query could not be embedded."""
        if (
            self.semantic is None
            or not settings.semantic_weight
            or not terms
            or not any(p.count for p in partitions)
        ):
            return None
        query: Floats | None = self.semantic.query(text)
        if query is None:
            return None
        return SemanticScores(
            self.semantic.similarities(partitions, query),
            settings.semantic_weight,
            settings.semantic_min_similarity,
        )

    def turn_keywords(
        self,
        settings: AgentSettings,
        strategy: str,
        user_message: str,
        recent: Sequence[str],
        given: Sequence[str],
    ) -> list[str]:
        """A turn's terms, by `strategy` or else the agent's configured one."""
        texts = [t for t in (user_message, *recent) if t.strip()]
        if not texts and not given:
            return []
        if (strategy or settings.inject_memories_strategy) == "llm":
            if given:
                return keywords(given)
            if not settings.keyword_llm_base_url:
                self._metrics.keyword_fallbacks.labels("no_endpoint").inc()
                return keywords(texts)
            model = KeywordModel(
                settings.keyword_llm_base_url,
                settings.keyword_llm_model,
                settings.keyword_llm_api_key,
                settings.keyword_llm_timeout_seconds,
            )
            pause = self._keyword_pauses.setdefault(model.base_url, Pause())
            if pause.remaining():
                self._metrics.keyword_fallbacks.labels("paused").inc()
                return keywords(texts)
            try:
                found = model.keywords("\n".join(texts))
            except KeywordModelError as exc:
                self._metrics.keyword_fallbacks.labels(exc.reason).inc()
                seconds = pause.failed()
                log.warning("keyword endpoint failed: %s; local keywords for %.0f s", exc, seconds)
            else:
                if pause.succeeded():
                    log.info("keyword endpoint answering again")
                return found
        return keywords([*texts, *given])
