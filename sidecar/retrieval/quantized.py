"""The bundled all-MiniLM-L6-v2 with int8 weights, run by onnxruntime.

A short query is a handful of rows against 42 MB of float32 layer weights:
numpy's forward pass spends its time reading them, not multiplying. Here the
six layers become an ONNX graph, built with onnx's helpers from the same
safetensors weights the numpy encoder reads, each dense layer's product
taken in int8 by onnxruntime's MatMulInteger: weights per output column, a
quarter of the bytes (small enough to stay in a shared cache), and each
token's activations per row as it comes, so a text's row does not depend on
the texts batched with it. Both operands are unsigned (codes about 128):
on x86 without VNNI, onnxruntime's unsigned-by-signed kernel adds pairs of
products in 16 bits, which saturate (see `_int8_columns`). Tokenizing, the
embeddings, mean pooling and normalisation stay the numpy encoder's own
(`QuantizedEncoder` is a `LocalEncoder` whose layers run elsewhere), so the
two differ only inside the layers: cosine >= 0.995 per text on a fixed set,
0.997 on average (tests/retrieval/test_quantized.py), and the same name, so
vectors stored by either are compared with the other's.

Most of what error is left comes from the query-key-value products'
activations (run in float32 with int8 weights, the error on the project's
own sets fell from 0.0029 to 0.0011), but keeping those six products in
float32, or their activations in two int8 halves, cost a sixth more CPU a
short query: over the 5 ms a query this encoder is for.

The graph is built on first use (about a second of CPU) and kept
in a cache directory (server.semantic_cache_dir) under a name derived from
the weights' digest, the recipe below and the onnxruntime version; its own
digest is written beside it and checked when it is read. A cache that
cannot be written only costs the build at every start.

Owns: the graph's construction and quantization, its cache files, the
choice between this encoder and numpy's (`local_encoder`), and
runtime_missing (which sidecar.config.settings asks). Must not touch: the
numpy encoder's arithmetic (sidecar.retrieval.embedding), vectors at rest,
the store, metrics, configuration (settings are arguments).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from sidecar.retrieval.embedding import EncoderError, LocalEncoder, Vectors, _Model

if TYPE_CHECKING:
    from onnx import ModelProto

log = logging.getLogger("sidecar.quantized")

# Part of every cache file's name: a change to the graph or to how it is
# quantized must change it, so files of the old recipe are never read.
RECIPE = "minilm-l6-int8-v5"
_HIDDEN = LocalEncoder.dimension
_HEADS = 12
# Graphs built in this process, by cache key: a second encoder (tests, a
# Sidecar restarted in place) without a writable cache does not build again.
_built: dict[str, bytes] = {}
_built_lock = threading.Lock()


def runtime_missing() -> str | None:
    """Why the int8 encoder cannot run here; None if it can."""
    missing = [name for name in ("onnxruntime", "onnx") if importlib.util.find_spec(name) is None]
    if missing:
        return (
            f"the int8 encoder needs {' and '.join(missing)}: "
            "pip install 'memory-sidecar[semantic]'"
        )
    return None


class QuantizedEncoder(LocalEncoder):
    """LocalEncoder's contract and name, its layers run by onnxruntime with
    int8 weights on one thread per call (concurrent calls run in parallel,
    as numpy's do). Raises EncoderError('unavailable') when onnxruntime or
    onnx is missing or the graph cannot be built or loaded."""

    def __init__(
        self,
        model_dir: str | Path | None = None,
        sha256: str | None = None,
        *,
        cache_dir: str | Path | None = None,
        batch_size: int = 32,
        max_batch_tokens: int = 2048,
    ) -> None:
        problem = runtime_missing()
        if problem:
            raise EncoderError("unavailable", problem)
        super().__init__(
            model_dir, sha256, batch_size=batch_size, max_batch_tokens=max_batch_tokens
        )
        try:
            graph = _graph(self._model, Path(cache_dir) if cache_dir else None)
            self._session = _session(graph)
        except EncoderError:
            raise
        except Exception as exc:  # onnx's or onnxruntime's own errors
            raise EncoderError("unavailable", f"cannot build the int8 graph: {exc}") from None

    def _transform(self, x: Vectors, padding: Vectors) -> Vectors:
        (out,) = self._session.run(
            ["output"],
            {"hidden": np.ascontiguousarray(x), "padding": np.ascontiguousarray(padding)},
        )
        result: Vectors = out
        return result


def local_encoder(
    runtime: str = "auto",
    model_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> LocalEncoder:
    """The bundled model as `runtime` says: int8 (onnxruntime), numpy, or
    auto: int8 where it loads, numpy otherwise, saying why in the log."""
    if runtime == "numpy":
        return LocalEncoder(model_dir)
    try:
        return QuantizedEncoder(model_dir, cache_dir=cache_dir)
    except EncoderError as exc:
        if runtime == "int8":
            raise
        log.warning(
            "the local encoder runs in numpy (2 to 3 times the CPU a query), "
            "not with int8 weights: %s",
            exc.detail,
        )
        return LocalEncoder(model_dir)


def _session(graph: bytes) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    # One thread a call, as numpy runs with one BLAS thread (sidecar/__init__.py):
    # concurrent calls, and the batching in front of them, give the parallelism.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only: its warnings are not the operator's
    return onnxruntime.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def _cache_key(model: _Model) -> str:
    import onnxruntime

    text = f"{RECIPE}\0{model.digest}\0{onnxruntime.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _graph(model: _Model, cache_dir: Path | None) -> bytes:
    """The quantized graph's bytes: built this run, read from the cache, or
    built now (and cached where the directory can be written; None: kept in
    this process only)."""
    key = _cache_key(model)
    with _built_lock:
        graph = _built.get(key)
        if graph is None:
            path = cache_dir / f"{RECIPE}-{key}.onnx" if cache_dir else None
            graph = _read_cached(path) if path else None
            if graph is None:
                graph = _build(model)
                if path:
                    _write_cached(path, graph)
            _built[key] = graph
        return graph


def _read_cached(path: Path) -> bytes | None:
    try:
        graph = path.read_bytes()
        expected = path.with_suffix(".sha256").read_text().strip()
    except OSError:
        return None
    if hashlib.sha256(graph).hexdigest() != expected:
        log.warning("%s does not match its digest: building the int8 graph again", path)
        return None
    return graph


def _write_cached(path: Path, graph: bytes) -> None:
    """Written whole or not at all (a temporary file renamed), the digest last."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, data in (
            (path, graph),
            (path.with_suffix(".sha256"), hashlib.sha256(graph).hexdigest().encode()),
        ):
            fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".building-")
            try:
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
                os.replace(temporary, target)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
    except OSError as exc:
        log.info("the int8 graph is not cached (%s): it is built again at every start", exc)


def _build(model: _Model) -> bytes:
    proto = _int8_graph(model)
    result: bytes = proto.SerializeToString()
    return result


def _int8_columns(weight: Vectors) -> tuple[npt.NDArray[np.uint8], Vectors]:
    """weight (out, in) as codes (in, out) and a scale per output column:
    symmetric, the column's largest magnitude at 127, held as uint8 about
    128 (the zero point given to MatMulInteger).

    Not int8: with uint8 activations and int8 weights, onnxruntime's kernel
    for AVX2 without VNNI (vpmaddubsw) adds each pair of products in 16
    bits, and two products of 128 * 127 already overflow them; the sum
    saturates, silently. Unsigned by unsigned widens to 16 bits first and
    is exact, at the same speed. On this project's own sets (the agent
    notes and conv1-6, against numpy's vectors) it took the mean cosine
    error from 0.0036 to 0.0029 and the top-10 overlap from 0.941 to 0.946."""
    columns = weight.T.astype(np.float64)
    scales = np.maximum(np.abs(columns).max(axis=0), 1e-12) / 127
    codes = np.clip(np.rint(columns / scales), -127, 127) + 128
    return codes.astype(np.uint8), scales.astype(np.float32)


class _Graph:
    """Nodes and initialisers, appended in order."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._names: set[str] = set()

    def constant(self, name: str, value: Any) -> str:
        from onnx import numpy_helper

        if name in self._names:  # shared, as the per-width shapes are
            return name
        self._names.add(name)
        # np.array, not ascontiguousarray: that turns a scalar into shape (1,).
        self.initializers.append(numpy_helper.from_array(np.array(value, order="C"), name))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attributes: Any) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output

    def dense(
        self,
        x: str,
        weight: Vectors,
        bias: Vectors,
        name: str,
        norm: tuple[Vectors, Vectors] | None = None,
    ) -> str:
        """x @ weight.T + bias; the MatMul is one the quantizer converts.

        With `norm`, the layer norm x comes out of: its channels are scaled
        down and the weights' columns up by as much (the same product in
        exact arithmetic). A layer norm's output is about gain * N(0, 1) +
        bias per channel, and a few of BERT's gains are many times the rest:
        quantized per tensor, those channels would leave the others a few
        levels. Balancing the two ranges (the square root of their ratio)
        halved the int8 encoder's error against numpy's."""
        onnx_uint8, onnx_float = 2, 1  # TensorProto.UINT8, FLOAT
        if norm is not None:
            gain, shift = norm
            activation = 4 * np.abs(gain) + np.abs(shift)
            scale = np.sqrt(activation / np.maximum(np.abs(weight).max(axis=0), 1e-8))
            scale = (scale / scale.mean()).astype(np.float32)
            x = self.node(
                "Mul", [x, self.constant(name + ".smooth", 1 / scale)], name + ".smoothed"
            )
            weight = weight * scale
        # Each row (token) quantized on its own, symmetric, its largest
        # magnitude at 127: a row's codes do not depend on the other texts
        # of its batch. Held as uint8 about 128, as the weights are (see
        # _int8_columns), the zero point given to MatMulInteger.
        largest = self.node(
            "ReduceMax",
            [self.node("Abs", [x], name + ".abs")],
            name + ".max",
            axes=[-1],
            keepdims=1,
        )
        scale = self.node("Div", [largest, "level"], name + ".scale")
        scale = self.node("Max", [scale, "tiny"], name + ".scale.floor")
        codes = self.node(
            "Round", [self.node("Div", [x, scale], name + ".levels")], name + ".round"
        )
        codes = self.node("Add", [codes, "offset"], name + ".offset")
        codes = self.node("Cast", [codes], name + ".codes", to=onnx_uint8)
        weights, columns = _int8_columns(weight)
        product = self.node(
            "MatMulInteger",
            [codes, self.constant(name + ".weight", weights), "zero", "zero"],
            name + ".mm",
        )
        out = self.node("Cast", [product], name + ".float", to=onnx_float)
        out = self.node("Mul", [out, scale], name + ".rescaled")
        out = self.node("Mul", [out, self.constant(name + ".columns", columns)], name + ".product")
        return self.node("Add", [out, self.constant(name + ".bias", bias)], name)

    def norm(self, x: str, weights: tuple[Vectors, Vectors], name: str) -> str:
        gain, bias = (
            self.constant(f"{name}.{part}", w) for part, w in zip("gb", weights, strict=True)
        )
        return self.node("LayerNormalization", [x, gain, bias], name, axis=-1, epsilon=1e-12)


def _int8_graph(model: _Model) -> ModelProto:
    """The six layers as LocalEncoder._transform computes them, but each
    dense layer's product in int8: inputs `hidden` (batch, tokens, 384) and
    `padding` (batch, 1, 1, tokens), output `output` like `hidden`."""
    import onnx
    from onnx import TensorProto, helper

    graph = _Graph()
    width = _HIDDEN // _HEADS
    _quantizing_constants(graph)
    graph.constant("qkv_shape", np.array([0, 0, 3, _HEADS, width], np.int64))
    graph.constant("context_shape", np.array([0, 0, _HIDDEN], np.int64))
    graph.constant("scale", np.float32(1 / math.sqrt(width)))
    graph.constant("sqrt2", np.float32(math.sqrt(2)))
    graph.constant("one", np.float32(1))
    graph.constant("half", np.float32(0.5))
    for part in range(3):
        graph.constant(f"part{part}", np.int64(part))
    x = "hidden"
    norm = model.embedding_norm
    for index, layer in enumerate(model.layers):
        x = _layer(graph, x, layer, norm, f"layer{index}")
        norm = layer.output_norm
    graph.node("Identity", [x], "output")
    dims: list[str | int] = ["batch", "tokens", _HIDDEN]
    body = helper.make_graph(
        graph.nodes,
        "all-MiniLM-L6-v2",
        [
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, dims),
            helper.make_tensor_value_info("padding", TensorProto.FLOAT, ["batch", 1, 1, "tokens"]),
        ],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, dims)],
        graph.initializers,
    )
    proto = helper.make_model(body, opset_imports=[helper.make_opsetid("", 17)])
    # The IR version of opset 17, which any onnxruntime of the extra reads.
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    return proto


def _quantizing_constants(graph: _Graph) -> None:
    """What every dense layer's quantization shares: the code range."""
    graph.constant("level", np.float32(127))
    graph.constant("tiny", np.float32(1e-12))
    graph.constant("offset", np.float32(128))
    graph.constant("zero", np.uint8(128))


def _layer(graph: _Graph, x: str, layer: Any, norm: tuple[Vectors, Vectors], p: str) -> str:
    """One BERT layer: self-attention, then the feed-forward block, each
    added back and normalised (embedding._transform, op for op)."""
    qkv = graph.dense(x, layer.qkv, layer.qkv_bias, p + ".qkv", norm)
    qkv = graph.node("Reshape", [qkv, "qkv_shape"], p + ".qkv.heads")
    # (batch, tokens, 3, heads, width) -> (3, batch, heads, tokens, width)
    qkv = graph.node("Transpose", [qkv], p + ".qkv.split", perm=[2, 0, 3, 1, 4])
    q, k, v = (
        graph.node("Gather", [qkv, f"part{i}"], f"{p}.{name}", axis=0)
        for i, name in enumerate("qkv")
    )
    k = graph.node("Transpose", [k], p + ".kt", perm=[0, 1, 3, 2])
    scores = graph.node("MatMul", [q, k], p + ".scores")
    scores = graph.node("Mul", [scores, "scale"], p + ".scaled")
    scores = graph.node("Add", [scores, "padding"], p + ".masked")
    scores = graph.node("Softmax", [scores], p + ".weights", axis=-1)
    context = graph.node("MatMul", [scores, v], p + ".context")
    context = graph.node("Transpose", [context], p + ".context.tokens", perm=[0, 2, 1, 3])
    context = graph.node("Reshape", [context, "context_shape"], p + ".context.joined")
    attended = graph.dense(context, layer.attention_out, layer.attention_out_bias, p + ".ao")
    attended = graph.node("Add", [attended, x], p + ".ao.residual")
    x = graph.norm(attended, layer.attention_norm, p + ".ao.norm")
    inner = graph.dense(
        x, layer.intermediate, layer.intermediate_bias, p + ".inner", layer.attention_norm
    )
    # GELU with the exact erf: x * (1 + erf(x / sqrt 2)) / 2 (onnxruntime fuses it).
    gelu = graph.node("Div", [inner, "sqrt2"], p + ".gelu.scaled")
    gelu = graph.node("Erf", [gelu], p + ".gelu.erf")
    gelu = graph.node("Add", [gelu, "one"], p + ".gelu.shifted")
    gelu = graph.node("Mul", [inner, gelu], p + ".gelu.product")
    gelu = graph.node("Mul", [gelu, "half"], p + ".gelu")
    output = graph.dense(gelu, layer.output, layer.output_bias, p + ".out")
    output = graph.node("Add", [output, x], p + ".out.residual")
    return graph.norm(output, layer.output_norm, p + ".out.norm")
