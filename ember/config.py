"""ModelConfig: the typed, immutable description of a model, derived from GGUF metadata.

Each family reads its own metadata keys in one place (`ember.families.config_from_gguf` dispatches on
the architecture); the engine never looks at raw metadata after this point. This module knows no family.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from ember.errors import GGUFError
from ember.gguf_file import GGUFFile
from ember.phases import ModelFamily


class RopeLayout(Enum):
    """Which head dimensions rope rotates together (docs/families.md §0.3)."""

    NORM = "norm"  # adjacent pairs (x[2i], x[2i+1]): llama.cpp's layout for arch `llama`
    NEOX = "neox"  # split halves (x[i], x[i + n_rot/2]): qwen3, gemma


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What every family has. Family-specific configs subclass this."""

    architecture: str
    family: ModelFamily
    name: str
    layer_count: int
    hidden_size: int
    head_count: int
    head_count_kv: int
    head_dim: int
    feed_forward_length: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    rope_base: float
    rope_dim: int
    rope_layout: RopeLayout
    rope_linear_factor: float  # positions are divided by this (1.0: no scaling)
    has_qk_norm: bool
    tied_embeddings: bool


MAX_LAYERS_WITHOUT_TENSORS = 4096


class MetadataReader:
    """Typed access to one architecture's metadata keys, with errors naming key and file."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        self.arch = gguf.architecture

    def _key(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def has(self, key: str) -> bool:
        return self._key(key) in self.gguf.metadata

    def raw(self, key: str, default: Any = None) -> Any:
        return self.gguf.metadata.get(self._key(key), default)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.raw(key, default)
        if value is None:
            self.gguf.require(self._key(key))
        try:
            return int(self._uniform(key, value))
        except (TypeError, ValueError, OverflowError):  # a string, NaN, inf: a corrupt file
            raise GGUFError(f"{self.gguf.path}: metadata '{self._key(key)}' is {value!r:.80}, not an "
                            "integer") from None

    def float(self, key: str, default: float | None = None) -> float:
        value = self.raw(key, default)
        if value is None:
            self.gguf.require(self._key(key))
        try:
            return float(value)
        except (TypeError, ValueError):
            raise GGUFError(f"{self.gguf.path}: metadata '{self._key(key)}' is {value!r:.80}, not a "
                            "number") from None

    def size(self, key: str) -> int:
        """A count or width (layers, heads, embedding length): at least 1. A corrupt one sizes loops and
        divisions (found by fuzzing: block_count 2**31 hung the load, head_count 0 divided by zero)."""
        value = self.int(key)
        if value < 1:
            raise GGUFError(f"{self.gguf.path}: metadata '{self._key(key)}' is {value}; it must be at "
                            "least 1")
        return value

    def layer_count(self) -> int:
        """`block_count`: at most the file's tensor count (every layer has tensors), or
        MAX_LAYERS_WITHOUT_TENSORS in a file of metadata only."""
        value = self.size("block_count")
        limit = len(self.gguf.tensors) or MAX_LAYERS_WITHOUT_TENSORS
        if value > limit:
            why = "the file's tensor count" if self.gguf.tensors else "for a file without tensors"
            raise GGUFError(f"{self.gguf.path}: metadata '{self._key('block_count')}' is {value}; it must "
                            f"be at most {limit} ({why})")
        return value

    def int_per_layer(self, key: str, layer_count: int, default: int | None = None) -> tuple[int, ...]:
        """A key that is either one scalar or one value per layer."""
        value = self.raw(key, default)
        if value is None:
            self.gguf.require(self._key(key))
        if np.ndim(value) == 0:
            return (int(value),) * layer_count
        values = tuple(int(v) for v in value)
        if len(values) != layer_count:
            raise GGUFError(
                f"{self.gguf.path}: metadata '{self._key(key)}' has {len(values)} entries, "
                f"expected one per layer ({layer_count})"
            )
        return values

    def _uniform(self, key: str, value: Any) -> Any:
        if np.ndim(value) == 0:
            return value
        values = set(int(v) for v in value)
        if len(values) != 1:
            raise GGUFError(
                f"{self.gguf.path}: metadata '{self._key(key)}' varies per layer ({sorted(values)}), "
                f"which the {self.arch} family does not support"
            )
        return values.pop()
