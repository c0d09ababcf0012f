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


ROPE_SCALING_TYPES = ("none", "linear", "yarn")  # llama.cpp also knows "longrope" (its own tensors)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """The `<arch>.rope.scaling.*` keys, with llama.cpp's defaults (docs/families.md §0.3, "YaRN").

    `kind` "none" ignores `factor`; "linear" divides every frequency by it; "yarn" ramps each frequency
    between interpolation (divided by `factor`) and extrapolation (as is) and multiplies cos/sin by
    `mscale`. llama.cpp reads `yarn_beta_*` and `yarn_log_multiplier` only for some architectures
    (mistral3, grok, deepseek2); converters write the transformers values, the same as its defaults.
    """

    kind: str
    factor: float  # 1.0: none
    original_context_length: int  # the pretraining context; where the YaRN ramp is measured
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ext_factor: float = 0.0  # llama.cpp: 1 for yarn, 0 otherwise, unless the file says
    attn_factor: float = 1.0  # `rope.scaling.attn_factor`: multiplies cos/sin for every type
    yarn_attn_factor: float = 1.0  # used only when ext_factor is 0 (llama.cpp replaces it otherwise)
    yarn_log_multiplier: float = 0.0  # transformers' `mscale_all_dim` (0: absent)

    @property
    def frequency_scale(self) -> float:
        """What llama.cpp multiplies the interpolated angles by: 1/factor (1 for "none")."""
        return 1.0 if self.kind in ("none", "longrope") or self.factor == 0.0 else 1.0 / self.factor

    @property
    def mscale(self) -> float:
        """The factor cos and sin are multiplied by, as llama.cpp's context setup and rope kernel give it:
        with ext_factor ≠ 0, get_mscale(s, 1) / get_mscale(s, log_mul) (only the numerator without a
        log multiplier), get_mscale(s, m) = 1 + 0.1·m·ln s for s > 1 else 1 (transformers' YaRN
        `attention_factor` with mscale = 1); otherwise `yarn_attn_factor`. Times `attn_factor`."""
        if self.ext_factor != 0.0:
            scale = 1.0 / self.frequency_scale

            def get_mscale(m: float) -> float:
                return 1.0 if scale <= 1.0 else 0.1 * m * float(np.log(scale)) + 1.0

            value = get_mscale(1.0)
            if self.yarn_log_multiplier != 0.0:
                value /= get_mscale(self.yarn_log_multiplier)
        else:
            value = self.yarn_attn_factor
        return value * self.attn_factor


def read_rope_scaling(meta: MetadataReader, context_length: int, *,
                      kinds: tuple[str, ...] = ROPE_SCALING_TYPES) -> RopeScaling:
    """The rope-scaling keys as llama.cpp reads them: `rope.scaling.type` (default "linear"), `.factor`
    (or the older `rope.scale_linear`; absent or 0: none), `.original_context_length` (default the
    training context), `.yarn_beta_fast`/`_slow`, `.yarn_ext_factor` (default 1 for yarn, else 0),
    `.yarn_attn_factor`, `.attn_factor`, `.yarn_log_multiplier`. A type ember cannot compute is one line
    naming the key. `kinds`: the types the caller computes (a family with its own tables may add
    "longrope"; the tables of `ember.ops.rope_tables` then apply only its factor and `attn_factor`)."""
    kind = meta.raw("rope.scaling.type", "linear")
    if kind not in kinds:
        raise GGUFError(f"{meta.gguf.path}: metadata '{meta._key('rope.scaling.type')}' is {kind!r:.40}, "
                        f"which ember does not support here (only {', '.join(kinds)})")
    factor_key = "rope.scaling.factor" if meta.has("rope.scaling.factor") else "rope.scale_linear"
    factor = meta.float(factor_key, 0.0)
    if not np.isfinite(factor) or factor < 0:
        raise GGUFError(f"{meta.gguf.path}: metadata '{meta._key(factor_key)}' is {factor}; it must be a "
                        "positive number (or 0 / absent: none)")
    original = meta.int("rope.scaling.original_context_length", context_length)
    if original < 1:
        raise GGUFError(f"{meta.gguf.path}: metadata '{meta._key('rope.scaling.original_context_length')}' "
                        f"is {original}; it must be at least 1")
    values = {}
    for name, key, default in (
        ("beta_fast", "rope.scaling.yarn_beta_fast", 32.0),
        ("beta_slow", "rope.scaling.yarn_beta_slow", 1.0),
        ("ext_factor", "rope.scaling.yarn_ext_factor", 1.0 if kind == "yarn" else 0.0),
        ("attn_factor", "rope.scaling.attn_factor", 1.0),
        ("yarn_attn_factor", "rope.scaling.yarn_attn_factor", 1.0),
        ("yarn_log_multiplier", "rope.scaling.yarn_log_multiplier", 0.0),
    ):
        values[name] = meta.float(key, default)
        if not np.isfinite(values[name]):
            raise GGUFError(f"{meta.gguf.path}: metadata '{meta._key(key)}' is {values[name]}, not a finite "
                            "number")
    if values["ext_factor"] < 0:  # llama.cpp: negative means "not set"
        values["ext_factor"] = 1.0 if kind == "yarn" else 0.0
    return RopeScaling(kind=kind, factor=factor or 1.0, original_context_length=original, **values)


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
