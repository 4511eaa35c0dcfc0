"""Semantic retrieval end to end: the real shipped model (all-MiniLM-L6-v2)
on small data, through a real daemon, on both backends.

The paraphrase questions below share no keyword with their answer, so
lexical ranking cannot find it; the cosines (measured with the model) are
0.61, 0.44 and 0.42 against at most 0.2 for every other entry, well apart
from the default floor of 0.35.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.retrieval.embedding import LocalEncoder
from tests.conftest import (
    CALL_SECONDS,
    MakeSidecar,
    Running,
    eventually,
)
from tests.endpoint import JsonEndpoint

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="companion", user_id="caroline")
LOCAL = "server: {semantic_encoder: local}"

NOTES = [
    "Her favourite food is sushi",
    "The deploy script lives in ops/release.sh",
    "Standup is at 9:30 on weekdays",
    "The staging database runs PostgreSQL 16",
    "Melanie plays the clarinet",
    "Caroline moved from Sweden four years ago",
]
# (question, the note that answers it): no keyword in common.
PARAPHRASES = [
    ("what does she like to eat", 0),
    ("which musical instrument", 4),
    ("when is the daily meeting", 2),
]


@pytest.fixture(scope="module", autouse=True)
def encoder() -> LocalEncoder:
    """The model, loaded once: while this holds it, every daemon's
    LocalEncoder on the same files shares it instead of loading it again."""
    return LocalEncoder()


def add_notes(running: Running) -> list[pb.Memory]:
    return [running.add(text, scope=SCOPE).memory for text in NOTES]


def search(running: Running, query: str, **fields: Any) -> list[pb.SearchHit]:
    fields.setdefault("scope", SCOPE)
    request = pb.SearchMemoriesRequest(query=query, **fields)
    return list(running.stub.SearchMemories(request, timeout=CALL_SECONDS).hits)


def ids(hits: list[pb.SearchHit]) -> list[str]:
    return [h.memory.id for h in hits]


def vector_rows(running: Running) -> int:
    cursor = running.store._db.execute_sql("SELECT COUNT(*) FROM memory_vectors")
    return int(cursor.fetchone()[0])


def fallbacks(running: Running) -> dict[tuple[str, str], float]:
    families = text_string_to_metric_families(
        generate_latest(running.sidecar.metrics.registry).decode()
    )
    return {
        (s.labels["operation"], s.labels["reason"]): s.value
        for family in families
        if family.name == "memory_semantic_fallbacks"
        for s in family.samples
        if s.name == "memory_semantic_fallbacks_total"
    }


@pytest.mark.parametrize(("question", "answer"), PARAPHRASES, ids=[q for q, _ in PARAPHRASES])
def test_a_paraphrase_finds_what_no_keyword_does(
    make_sidecar: MakeSidecar, question: str, answer: int
) -> None:
    lexical = make_sidecar(name="lexical.db")
    add_notes(lexical)
    assert search(lexical, question) == []

    running = make_sidecar(LOCAL)
    notes = add_notes(running)
    # Exactly the answer: every other note is below the floor.
    assert ids(search(running, question)) == [notes[answer].id]


def test_keywords_still_rank_first_when_both_match(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(LOCAL)
    notes = add_notes(running)
    hits = search(running, "sushi")
    assert ids(hits)[0] == notes[0].id
    # Blended: below 1 only through the semantic half and confidence.
    assert 0 < hits[0].score <= 1


def test_match_all_stays_lexical(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(LOCAL)
    notes = add_notes(running)
    assert search(running, "what does she like to eat", match_all=True) == []
    assert ids(search(running, "sushi", match_all=True)) == [notes[0].id]


def test_the_turn_block_holds_the_paraphrase_match(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(LOCAL + "\ndefaults: {inject_system_block: false}")
    notes = add_notes(running)
    turn = running.turn("s", "I'm hungry, what does she like to eat?", scope=SCOPE)
    assert notes[0].id in list(turn.injected_memory_ids)
    assert "Her favourite food is sushi" in turn.turn_context


def test_weight_zero_turns_it_off_for_one_agent(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(LOCAL + "\nagents: {other: {semantic_weight: 0.0}}")
    add_notes(running)
    other = pb.Scope(agent_id="other", user_id="caroline")
    for text in NOTES:
        running.add(text, scope=other)
    assert search(running, "what does she like to eat")
    assert search(running, "what does she like to eat", scope=other) == []
    assert [h.memory.content for h in search(running, "sushi", scope=other)] == [NOTES[0]]


def test_a_query_of_stop_words_finds_nothing_as_without(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(LOCAL)
    add_notes(running)
    assert search(running, "what is it?") == []
    assert len(search(running, "")) == len(NOTES)


def test_vectors_follow_writes_and_go_with_their_entry(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(LOCAL)
    notes = add_notes(running)
    assert vector_rows(running) == len(NOTES)
    model = running.sidecar.engine.inside().semantic.model  # type: ignore[union-attr]
    assert running.store.vectors.unembedded(model, 0, 100) == []

    # New content, new vector: the old paraphrase no longer finds it, the
    # new one does, on this replica (held vectors) and in the store.
    running.stub.UpdateMemory(
        pb.UpdateMemoryRequest(
            scope=SCOPE, id=notes[0].id, content="The office wifi password rotates monthly"
        ),
        timeout=CALL_SECONDS,
    )
    assert search(running, "what does she like to eat") == []
    assert ids(search(running, "network credentials change")) == [notes[0].id]
    assert running.store.vectors.unembedded(model, 0, 100) == []
    assert vector_rows(running) == len(NOTES)

    # Only the confidence changes: the vector stays.
    running.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=SCOPE, id=notes[4].id, confidence=0.3), timeout=CALL_SECONDS
    )
    assert ids(search(running, "which musical instrument")) == [notes[4].id]

    running.stub.DeleteMemory(
        pb.DeleteMemoryRequest(scope=SCOPE, id=notes[4].id), timeout=CALL_SECONDS
    )
    assert search(running, "which musical instrument") == []
    assert vector_rows(running) == len(NOTES) - 1


def test_another_replica_finds_what_one_wrote(make_sidecar: MakeSidecar) -> None:
    one = make_sidecar(LOCAL)
    two = make_sidecar(LOCAL, db=one.db)
    two_before = search(two, "what does she like to eat")
    assert two_before == []
    notes = add_notes(one)
    # The other replica sees the write on its next read.
    eventually(lambda: search(two, "what does she like to eat"), "two finds it", pause=0.05)
    assert ids(search(two, "what does she like to eat")) == [notes[0].id]


def test_entries_written_before_semantic_was_on_are_backfilled(
    make_sidecar: MakeSidecar,
) -> None:
    before = make_sidecar()
    notes = add_notes(before)
    assert vector_rows(before) == 0

    after = make_sidecar(LOCAL, db=before.db)
    semantic = after.sidecar.engine.inside().semantic
    assert semantic is not None
    # The background backfill starts with the daemon.
    eventually(
        lambda: after.store.vectors.unembedded(semantic.model, 0, 1) == [],
        "the backfill embeds every entry",
        pause=0.05,
    )
    assert vector_rows(after) == len(NOTES)
    assert ids(search(after, "when is the daily meeting")) == [notes[2].id]


# ------------------------------------------------------------------ endpoint


@dataclass
class ModelEndpoint(JsonEndpoint):
    """An OpenAI-compatible /v1/embeddings in front of the real model."""

    encoder: LocalEncoder | None = None
    # Each text's vector once computed: the same few notes are asked for in
    # test after test (the model is deterministic, so this changes no reply).
    known: dict[str, list[float]] = field(default_factory=dict)

    def vectors(self, texts: list[str]) -> list[list[float]]:
        assert self.encoder is not None
        new = [text for text in dict.fromkeys(texts) if text not in self.known]
        if new:
            self.known.update(zip(new, self.encoder.encode(new).tolist(), strict=True))
        return [self.known[text] for text in texts]

    def answer(self, body: dict[str, Any]) -> bytes:
        data = [
            {"object": "embedding", "index": i, "embedding": vector}
            for i, vector in enumerate(self.vectors(body["input"]))
        ]
        return json.dumps({"object": "list", "data": data}).encode()


@pytest.fixture(scope="module")
def known_vectors() -> dict[str, list[float]]:
    return {}


@pytest.fixture
def model_endpoint(encoder: LocalEncoder, known_vectors: dict[str, list[float]]) -> ModelEndpoint:
    """Not serving yet (`serving()`), on a port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return ModelEndpoint(encoder=encoder, known=known_vectors, port=probe.getsockname()[1])


# Where the deadline is not what a test checks, one a loaded machine cannot
# miss: a write or backfill that missed 2 s made them fail.
def endpoint_yaml(endpoint: ModelEndpoint, timeout: float = 30.0) -> str:
    return (
        f"server: {{semantic_encoder: endpoint, semantic_base_url: '{endpoint.url}',"
        f" semantic_model: minilm, semantic_timeout_seconds: {timeout}}}"
    )


def test_the_endpoint_embeds_writes_and_queries(
    make_sidecar: MakeSidecar, model_endpoint: ModelEndpoint
) -> None:
    with model_endpoint.serving():
        running = make_sidecar(endpoint_yaml(model_endpoint))
        notes = add_notes(running)
        assert ids(search(running, "which musical instrument")) == [notes[4].id]
    assert len(model_endpoint.requests) == len(NOTES) + 1
    assert model_endpoint.requests[0]["body"] == {"model": "minilm", "input": [NOTES[0]]}
    assert fallbacks(running) == {}


def test_prefixes_go_before_queries_and_entries_and_name_the_vectors(
    make_sidecar: MakeSidecar, model_endpoint: ModelEndpoint
) -> None:
    # e5, bge and nomic-embed want an instruction before a query and
    # another before a passage.
    prefixes = ", semantic_query_prefix: 'query: ', semantic_document_prefix: 'passage: '}"
    with model_endpoint.serving():
        running = make_sidecar(endpoint_yaml(model_endpoint)[:-1] + prefixes)
        add_notes(running)
        search(running, "which musical instrument")  # (MiniLM wants no prefixes)
        sent = [r["body"]["input"] for r in model_endpoint.requests]
        assert sent[: len(NOTES)] == [[f"passage: {note}"] for note in NOTES]
        assert sent[-1] == ["query: which musical instrument"]
        semantic = running.sidecar.engine.inside().semantic
        assert semantic is not None
        assert semantic.model.startswith("endpoint:minilm+prefixes:")
        assert running.store.vectors.unembedded(semantic.model, 0, 100) == []

        # Without the prefixes these vectors are another model's: embedded
        # again, without them, by the backfill.
        running.sidecar.stop(grace=1)
        asked = len(model_endpoint.requests)
        plain = make_sidecar(endpoint_yaml(model_endpoint), db=running.db)
        semantic = plain.sidecar.engine.inside().semantic
        assert semantic is not None
        assert semantic.model == "endpoint:minilm"
        eventually(
            lambda: plain.store.vectors.unembedded(semantic.model, 0, 1) == [],
            "the backfill embeds every entry again",
            pause=0.05,
        )
        again = [r["body"]["input"] for r in model_endpoint.requests[asked:]]
    assert sorted(text for batch in again for text in batch) == sorted(NOTES)


def test_an_endpoint_that_is_down_loses_nothing_and_is_backfilled(
    make_sidecar: MakeSidecar, model_endpoint: ModelEndpoint
) -> None:
    lexical = make_sidecar(name="lexical.db")
    add_notes(lexical)
    running = make_sidecar(endpoint_yaml(model_endpoint))

    # Down: every write is stored (without a vector), every search ranks
    # lexically, exactly as without semantic retrieval; each is counted.
    notes = add_notes(running)
    assert [m.content for m in notes] == NOTES
    assert vector_rows(running) == 0
    for query in ("sushi", "what does she like to eat", "PostgreSQL staging"):
        assert [h.memory.content for h in search(running, query)] == [
            h.memory.content for h in search(lexical, query)
        ]
    # After the first failure the encoder is skipped for a while ("paused").
    counted = fallbacks(running)
    assert counted[("write", "unreachable")] >= 1
    assert counted[("write", "unreachable")] + counted[("write", "paused")] == len(NOTES)
    assert sum(n for (operation, _), n in counted.items() if operation == "query") == 3

    # Up again: the backfill embeds what was stored without a vector.
    semantic = running.sidecar.engine.inside().semantic
    assert semantic is not None
    with model_endpoint.serving():
        semantic.backfill()
        assert vector_rows(running) == len(NOTES)
        # Its success ends the pause; the query's earlier failure is not
        # remembered as "no vector".
        assert ids(search(running, "what does she like to eat")) == [notes[0].id]


def test_an_endpoint_that_hangs_costs_one_deadline_not_one_per_call(
    make_sidecar: MakeSidecar, model_endpoint: ModelEndpoint
) -> None:
    with model_endpoint.serving():
        # Embedded by a daemon whose deadline no busy machine misses, so the
        # one under test has nothing to backfill: only its queries ask.
        writer = make_sidecar(endpoint_yaml(model_endpoint))
        add_notes(writer)
        writer.sidecar.stop(grace=1)
        running = make_sidecar(endpoint_yaml(model_endpoint, timeout=0.3), db=writer.db)
        semantic = running.sidecar.engine.inside().semantic
        assert semantic is not None
        assert running.store.vectors.unembedded(semantic.model, 0, 10) == []
        before, asked = fallbacks(running), len(model_endpoint.requests)
        model_endpoint.delay = 5.0
        for _ in range(3):
            assert search(running, "what does she like to eat") == []
    # The first waited out the deadline; the next two did not ask.
    after = fallbacks(running)
    added = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert added == {("query", "timeout"): 1, ("query", "paused"): 2}
    assert len(model_endpoint.requests) == asked + 1


def test_tiers_held_compactly_are_neither_embedded_nor_backfilled(
    make_sidecar: MakeSidecar,
) -> None:
    before = make_sidecar("server: {compact_tier_entries: 4}")
    add_notes(before)  # six: held compactly from four
    small = pb.Scope(agent_id="small", user_id="caroline")
    kept = [before.add(text, scope=small).memory for text in NOTES[:2]]

    after = make_sidecar("server: {compact_tier_entries: 4, semantic_encoder: local}", db=before.db)
    semantic = after.sidecar.engine.inside().semantic
    assert semantic is not None
    eventually(
        lambda: after.store.vectors.unembedded(semantic.model, 0, 10, below=4) == [],
        "the backfill embeds the small tier",
        pause=0.05,
    )
    # Only the small tier's two entries were embedded; the compact tier is
    # ranked lexically, and a write to it once held compactly is not embedded.
    assert vector_rows(after) == 2
    assert search(after, "what does she like to eat") == []
    after.add("The printer on floor 2 is broken", scope=SCOPE)
    assert vector_rows(after) == 2
    request = pb.SearchMemoriesRequest(scope=small, query="what does she like to eat")
    assert [h.memory.id for h in after.stub.SearchMemories(request).hits] == [kept[0].id]
