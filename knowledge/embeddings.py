"""Offline embeddings for the knowledge base: signed feature hashing of code tokens and op n-grams.

No model is ever downloaded. A text (a recipe's pattern and replacement, an intent's evidence:
kernel names, ATen op names, source lines) is turned into tokens that mean the same thing whichever
way they were written (`x.pow(2)`, `x ** 2`, `aten::pow`, the `pow` inside
`cpp_fused_add_mean_mul_pow_rsqrt_0` all give the op token ``pow``), then into features
(identifiers, their parts, bigrams and trigrams of the op sequence), each hashed with BLAKE2b (not
Python's salted ``hash()``) into a signed slot of a fixed-size vector, which is L2-normalised.
The same text gives the same vector in every process, on every machine.

The class implements chromadb's ``EmbeddingFunction`` protocol (name / get_config /
build_from_config), so a persistent collection records which function built it and re-opens with
it. Chroma looks the name up in its registry when it reads a collection's configuration, so call
:func:`register` before opening a client (``knowledge.store`` does).
"""

from __future__ import annotations

import hashlib
import math
import re
from functools import lru_cache
from typing import Any

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings, Space

NAME = "trainbridge-hashed-code"
DEFAULT_DIMS = 256
FEATURE_VERSION = 1

_TOKEN_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\*\*|[*+\-/@]")
_OPERATOR_OPS = {"**": "pow", "*": "mul", "+": "add", "-": "sub", "/": "div", "@": "matmul"}
# Different spellings of the same op, so code and profiler/compiler names meet.
_ALIASES = {
    "square": "pow",
    "multiply": "mul",
    "divide": "div",
    "true_divide": "div",
    "subtract": "sub",
    "mm": "matmul",
    "bmm": "matmul",
    "addmm": "matmul",
    "linear": "linear",
    "reciprocal": "reciprocal",
    "sigmoid": "sigmoid",
    "rmsnorm": "rms_norm",
    "layernorm": "layer_norm",
    "log_softmax": "log_softmax",
}
# Words that carry no signal about what a region computes.
_STOP = frozenset(
    {
        "aten", "torch", "nn", "functional", "f", "self", "x", "y", "the", "a", "an", "of", "and", "or",
        "to", "in", "on", "for", "with", "is", "be", "it", "as", "by", "default", "dim", "keepdim",
        "true", "false", "none", "return", "def", "import", "from", "tensor", "input", "out",
        "backward", "forward",
    }
)
# Parts of generated kernel names that describe the code generator, not the computation.
_KERNEL_NOISE = frozenset({"cpp", "triton", "fused", "poi", "red", "per", "kernel", "graph"})

_W_IDENT = 1.0
_W_PART = 0.5
_W_BIGRAM = 0.5
_W_TRIGRAM = 0.35


def _normalise(word: str) -> str:
    word = word.lower().strip("_")
    return _ALIASES.get(word, word)


def tokens(text: str) -> list[tuple[str, list[str]]]:
    """(identifier, its op-like parts) for each meaningful token of ``text``, in order."""
    out: list[tuple[str, list[str]]] = []
    for raw in _TOKEN_RE.findall(text):
        if raw in _OPERATOR_OPS:
            op = _OPERATOR_OPS[raw]
            out.append((op, [op]))
            continue
        ident = _normalise(raw)
        if not ident or ident in _STOP or ident.isdigit():
            continue
        parts = [_normalise(p) for p in ident.split("_")]
        parts = [p for p in parts if p and not p.isdigit() and p not in _KERNEL_NOISE and p not in _STOP]
        if ident.startswith(("cpp_", "triton_")) and not parts:
            continue
        out.append((ident, parts or [ident]))
    return out


def features(text: str) -> dict[str, float]:
    """Weighted features of ``text``: identifiers, identifier parts, op bigrams and trigrams."""
    feats: dict[str, float] = {}

    def add(key: str, weight: float) -> None:
        feats[key] = feats.get(key, 0.0) + weight

    sequence: list[str] = []
    for ident, parts in tokens(text):
        add("u:" + ident, _W_IDENT)
        if len(parts) > 1 or parts[0] != ident:
            for part in parts:
                add("u:" + part, _W_PART)
        sequence.extend(parts)
    for a, b in zip(sequence, sequence[1:]):
        add(f"b:{a} {b}", _W_BIGRAM)
    for a, b, c in zip(sequence, sequence[1:], sequence[2:]):
        add(f"t:{a} {b} {c}", _W_TRIGRAM)
    if not feats:
        add("u:<empty>", 1.0)
    return feats


@lru_cache(maxsize=1 << 17)
def _slot(feature: str, dims: int) -> tuple[int, float]:
    h = int.from_bytes(hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest(), "little")
    return h % dims, (1.0 if (h >> 63) & 1 else -1.0)


def embed_text(text: str, dims: int = DEFAULT_DIMS) -> np.ndarray:
    """The L2-normalised hashed feature vector of one text (float32, shape ``(dims,)``)."""
    vec = np.zeros(dims, dtype=np.float64)
    for feat, weight in features(text).items():
        idx, sign = _slot(feat, dims)
        vec[idx] += sign * (1.0 + math.log(weight)) if weight >= 1.0 else sign * weight
    norm = float(np.linalg.norm(vec))
    if norm == 0.0:  # every feature cancelled out: keep a valid, deterministic unit vector
        vec[_slot("u:<empty>", dims)[0]] = 1.0
        norm = 1.0
    return (vec / norm).astype(np.float32)


class HashedCodeEmbedding(EmbeddingFunction[Documents]):
    """Deterministic, offline embedding of code and op-sequence text for Chroma."""

    def __init__(self, dims: int = DEFAULT_DIMS) -> None:
        if not isinstance(dims, int) or dims < 16:
            raise ValueError(f"dims must be an integer >= 16, got {dims!r}")
        self.dims = dims

    def __call__(self, input: Documents) -> Embeddings:
        return [embed_text(text, self.dims) for text in input]

    def embed_query(self, input: Documents) -> Embeddings:
        return self(input)

    @staticmethod
    def name() -> str:
        return NAME

    def get_config(self) -> dict[str, Any]:
        return {"dims": self.dims, "feature_version": FEATURE_VERSION}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> "HashedCodeEmbedding":
        HashedCodeEmbedding.validate_config(config)
        return HashedCodeEmbedding(dims=int(config.get("dims", DEFAULT_DIMS)))

    @staticmethod
    def validate_config(config: dict[str, Any]) -> None:
        version = config.get("feature_version", FEATURE_VERSION)
        if version != FEATURE_VERSION:
            raise ValueError(
                f"collection was embedded with {NAME} feature version {version}, this TrainBridge "
                f"computes version {FEATURE_VERSION}: export the knowledge base with the old version "
                "and import it into a new one"
            )

    def validate_config_update(self, old_config: dict[str, Any], new_config: dict[str, Any]) -> None:
        if old_config.get("dims") != new_config.get("dims"):
            raise ValueError("the embedding size of an existing collection cannot change")

    def default_space(self) -> Space:
        return "cosine"

    def supported_spaces(self) -> list[Space]:
        return ["cosine", "l2", "ip"]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashedCodeEmbedding) and other.dims == self.dims

    def __hash__(self) -> int:
        return hash((NAME, self.dims))


def register() -> None:
    """Make Chroma able to rebuild this function from a stored collection configuration."""
    from chromadb.utils.embedding_functions import known_embedding_functions, register_embedding_function

    if known_embedding_functions.get(NAME) is not HashedCodeEmbedding:
        register_embedding_function(HashedCodeEmbedding)
