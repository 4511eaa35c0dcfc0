"""What a query asks for: its keyword terms, its semantic scores, and the
entries new content nearly repeats.

Keywords come by the agent's strategy: local extraction (sidecar.retrieval.keywords),
or an LLM endpoint (sidecar.retrieval.llm) that, once it fails, is skipped for a
while and the local terms used instead. Semantic scores are the query's
cosines with a partition's entries (sidecar.retrieval.semantic), blended into BM25 by
sidecar.retrieval.ranking.rank. Near-duplicates score new content against its tier as
of now (sidecar.retrieval.similarity), before a write takes any lock.

Owns: strategy choice, the endpoints' back-off, and when near-duplicates are
looked for. Must not touch: snapshots or sessions, the store (semantic
vectors are sidecar.retrieval.semantic's business), and the partition cache except
through the Partitions it is handed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sidecar.config.settings import AgentSettings
from sidecar.core.metrics import Metrics
from sidecar.domain.partition import AnyPartition, PartitionKey, Partitions
from sidecar.retrieval import similarity
from sidecar.retrieval.compact import CompactPartition
from sidecar.retrieval.keywords import keywords
from sidecar.retrieval.llm import KeywordModel, KeywordModelError, Pause
from sidecar.retrieval.ranking import SemanticScores, Weights
from sidecar.retrieval.semantic import Floats, Semantic
from sidecar.retrieval.similarity import Similar

log = logging.getLogger("sidecar.queries")


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

    def near_duplicates(
        self,
        settings: AgentSettings,
        partitions: Partitions,
        key: PartitionKey,
        content: str,
        vector: Floats | None,
    ) -> tuple[Similar, ...]:
        """The entries of the tier the new content nearly repeats, against
        the tier as of now (loaded if not cached: the next turn needs it
        anyway, and the write then updates it in place). Advisory: taken
        before the partition lock, so two adds of one restatement at once
        may both pass.

        Nothing is computed under similar_writes: allow, for a disabled tier
        (the store refuses the write), or for a tier held compactly
        (compact_tier_entries and up): finding candidates there and reading
        them from the database costs a few times what the write does, and
        such a tier is unlimited, not one that restatements crowd."""
        tier = key[0]
        if settings.similar_writes == "allow" or not settings.policy(tier).enabled:
            return ()
        partitions.verify([key])
        if partitions.held_compactly(key):
            return ()
        partition = partitions.get(key)
        if isinstance(partition, CompactPartition):  # grew past the threshold meanwhile
            return ()
        cosines = None
        if vector is not None and self.semantic is not None and settings.semantic_weight:
            cosines = self.semantic.similarities([partition], vector)
        found = similarity.similar(partition, content, settings.similar_threshold, cosines=cosines)
        if found and settings.similar_writes == "refuse" and similarity.holds(partition, content):
            return ()  # identical content: the store returns the existing entry
        return found

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
