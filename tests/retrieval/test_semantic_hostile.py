"""Semantic retrieval against an endpoint that changes under us (sidecar.retrieval.semantic,
sidecar.retrieval.embedding): a model swapped behind the same name, and a reply of far
too many dimensions. Neither fails a call: keywords keep answering.

The endpoints are real HTTP servers started here (tests/endpoint.py); the one
that switches dimension serves the real model's vectors, padded with zeros
(the same cosines in another dimension).
"""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.api import server
from sidecar.config import settings
from sidecar.retrieval.embedding import EncoderError, EndpointEncoder, LocalEncoder
from tests.conftest import (
    CALL_SECONDS,
    MakeSidecar,
    Running,
    eventually,
)
from tests.endpoint import JsonEndpoint
from tests.retrieval.test_semantic import (
    NOTES,
    SCOPE,
    ModelEndpoint,
    add_notes,
    fallbacks,
    ids,
    search,
)

pytestmark = pytest.mark.contract


@pytest.fixture(scope="module", autouse=True)
def encoder() -> LocalEncoder:
    """The model, loaded once: while this holds it, every daemon's
    LocalEncoder on the same files shares it instead of loading it again."""
    return LocalEncoder()


@pytest.fixture(scope="module")
def known_vectors() -> dict[str, list[float]]:
    """Vectors the endpoints below computed, shared by them (ModelEndpoint)."""
    return {}


@dataclass
class SwappedModel(ModelEndpoint):
    """/v1/embeddings of the real model, its vectors padded with zeros to
    `dimension` (384 or more): a model swapped behind the same name."""

    dimension: int = 384

    def answer(self, body: dict[str, Any]) -> bytes:
        vectors = np.array(self.vectors(body["input"]), dtype=np.float32)
        padded = np.zeros((len(vectors), self.dimension), dtype=np.float32)
        padded[:, : vectors.shape[1]] = vectors
        data = [
            {"object": "embedding", "index": i, "embedding": v.tolist()}
            for i, v in enumerate(padded)
        ]
        return json.dumps({"object": "list", "data": data}).encode()


# A deadline no busy machine misses where it is not what a test checks: at 5 s
# a loaded machine missed it (a backfill failed, a fallback was counted).
def _yaml(url: str, timeout: float = 30.0) -> str:
    return (
        f"server: {{semantic_encoder: endpoint, semantic_base_url: '{url}',"
        f" semantic_model: minilm, semantic_timeout_seconds: {timeout}}}"
    )


def _vector_sizes(running: Running) -> dict[int, int]:
    """How many stored vectors have each size in bytes."""
    cursor = running.store._db.execute_sql(
        "SELECT length(vector), COUNT(*) FROM memory_vectors GROUP BY length(vector)"
    )
    return {int(size): int(count) for size, count in cursor.fetchall()}


def _wait_embedded(running: Running, dimension: int, count: int) -> None:
    """Until the backfill has stored `count` vectors of that dimension."""
    eventually(
        lambda: _vector_sizes(running) == {2 * dimension: count},
        lambda: f"{count} vectors of {dimension} dimensions, not {_vector_sizes(running)}",
        pause=0.05,
    )


def test_a_model_of_another_dimension_under_the_same_name_fails_no_call(
    make_sidecar: MakeSidecar, encoder: LocalEncoder, known_vectors: dict[str, list[float]]
) -> None:
    endpoint = SwappedModel(encoder=encoder, known=known_vectors)
    with endpoint.serving():
        running = make_sidecar(_yaml(endpoint.url), name="swap.db")
        notes = add_notes(running)
        _wait_embedded(running, 384, len(NOTES))  # (a write that missed: backfilled)
        assert ids(search(running, "which musical instrument")) == [notes[4].id]

        # The model behind "minilm" now answers in 512 dimensions: a write
        # stores one vector of those beside the 384-dimension ones.
        endpoint.dimension = 512
        printer = running.add("The printer on floor 2 is broken", scope=SCOPE).memory
        for query, expected in [("sushi", notes[0].id), ("printer broken", printer.id)]:
            assert ids(search(running, query))[0] == expected
        turn = running.turn("s", "what about the sushi?", scope=SCOPE)
        assert "sushi" in turn.system_block + turn.turn_context
        # The stale vectors are embedded again; then semantic matches are back.
        _wait_embedded(running, 512, len(NOTES) + 1)
        assert ids(search(running, "when is the daily meeting")) == [notes[2].id]

        # Swapped again, and the daemon restarted: the same.
        running.sidecar.stop(grace=1)
        endpoint.dimension = 640
        again = make_sidecar(_yaml(endpoint.url), name="swap.db")
        again.add("Tea is served at four", scope=SCOPE)
        assert ids(search(again, "sushi"))[0] == notes[0].id
        turn = again.turn("s", "clarinet", scope=SCOPE)
        assert "clarinet" in turn.system_block + turn.turn_context
        _wait_embedded(again, 640, len(NOTES) + 2)
        assert ids(search(again, "what does she like to eat")) == [notes[0].id]
    assert not any(reason == "bad_reply" for _, reason in fallbacks(again))


@dataclass
class Enormous(JsonEndpoint):
    """Answers every request with one vector of `dimension` numbers: a
    valid reply of ~28 MB, under the byte cap."""

    dimension: int = 2_000_000
    payload: bytes = b""

    def answer(self, body: dict[str, Any]) -> bytes:
        if not self.payload:
            numbers = b",".join([b"0.12345678901"] * self.dimension)
            self.payload = (
                b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":['
                + numbers
                + b"]}]}"
            )
        return self.payload


def test_a_reply_of_two_million_dimensions_is_refused_before_it_is_parsed() -> None:
    endpoint = Enormous()
    endpoint.answer({})
    assert 20_000_000 < len(endpoint.payload) < 32 * 1024 * 1024
    with endpoint.serving():
        tracemalloc.start()
        try:
            with pytest.raises(EncoderError) as refused:
                EndpointEncoder(endpoint.url, "m", timeout_seconds=30).encode(["sushi"])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert refused.value.reason == "bad_reply"
    assert "dimensions" in refused.value.detail
    # Refused as it arrived: not the 28 MB reply, nor millions of floats.
    assert peak < 16 * 1024 * 1024


def test_a_lower_dimension_cap_refuses_what_the_default_takes(
    encoder: LocalEncoder, known_vectors: dict[str, list[float]]
) -> None:
    endpoint = SwappedModel(encoder=encoder, known=known_vectors, dimension=512)
    with endpoint.serving():
        # Deadlines a loaded machine does not miss: the refusal is checked.
        uncapped = EndpointEncoder(endpoint.url, "m", timeout_seconds=30)
        assert uncapped.encode(["x", "y"]).shape == (2, 512)
        flags = {"db": ":memory:"}
        loaded = settings.load(None, environ={}, flags=flags).server
        capped = dataclasses.replace(
            loaded, semantic_encoder="endpoint", semantic_base_url=endpoint.url,
            semantic_model="m", semantic_max_dimensions=500, semantic_timeout_seconds=30.0,
        )  # fmt: skip
        encoder_of_settings = server.encoder_for(capped)
        assert encoder_of_settings is not None
        with pytest.raises(EncoderError, match="dimensions") as refused:
            encoder_of_settings.encode(["x", "y"])
    assert refused.value.reason == "bad_reply"


def test_a_daemon_asking_an_enormous_endpoint_answers_with_keywords(
    make_sidecar: MakeSidecar,
) -> None:
    lexical = make_sidecar(name="lexical.db")
    add_notes(lexical)
    endpoint = Enormous()
    endpoint.answer({})  # built before any call waits for it
    with endpoint.serving():
        # A deadline no busy machine misses: each failure is the reply's.
        running = make_sidecar(_yaml(endpoint.url, timeout=10.0))
        add_notes(running)
        # A generous deadline: the outcome is asserted, not the time taken.
        request = pb.SearchMemoriesRequest(query="PostgreSQL staging", scope=SCOPE)
        hits = running.stub.SearchMemories(request, timeout=CALL_SECONDS).hits
        turn = running.stub.InjectForTurn(
            pb.InjectForTurnRequest(session_id="s", user_message="sushi", scope=SCOPE),
            timeout=CALL_SECONDS,
        )
    assert [h.memory.content for h in hits] == [
        h.memory.content for h in search(lexical, "PostgreSQL staging")
    ]
    assert "sushi" in turn.turn_context + turn.system_block
    counted = fallbacks(running)
    assert counted[("write", "bad_reply")] >= 1
    assert counted.get(("query", "bad_reply"), 0) + counted.get(("query", "paused"), 0) >= 1
    assert _vector_sizes(running) == {}


def test_the_pass_that_learns_a_new_dimension_replaces_the_old_one_s_vectors(
    make_sidecar: MakeSidecar, encoder: LocalEncoder, known_vectors: dict[str, list[float]]
) -> None:
    """A start's first backfill pass, knowing no dimension yet, looks for
    entries without any vector: the one it finds (written last) tells it
    the new dimension. The old-dimension vectors before it are replaced
    at once too, without a call, not at the next periodic pass."""
    endpoint = SwappedModel(encoder=encoder, known=known_vectors)
    with endpoint.serving():
        first = make_sidecar(_yaml(endpoint.url), name="learnt.db")
        add_notes(first)
        _wait_embedded(first, 384, len(NOTES))
        first.sidecar.stop(grace=1)
        # Written by a daemon without the encoder: stored without a vector.
        lexical = make_sidecar(name="learnt.db")
        lexical.add("Tea is served at four", scope=SCOPE)
        lexical.sidecar.stop(grace=1)

        endpoint.dimension = 512
        second = make_sidecar(_yaml(endpoint.url), name="learnt.db")
        _wait_embedded(second, 512, len(NOTES) + 1)
        semantic = second.sidecar.engine.inside().semantic
        assert semantic is not None
        assert semantic.dimension == 512
    assert fallbacks(second) == {}
