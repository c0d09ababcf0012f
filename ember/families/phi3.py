"""Phi-3 / Phi-3.5 / Phi-4-mini (GGUF architecture `phi3`), docs/families.md §12.

The llama block (`ember.families.llama`, its forward unchanged) read from phi3's file, as llama.cpp reads it
(`src/models/phi3.cpp`, `llama_model::get_rope_factors`):

* fused tensors: `attn_qkv` is [q rows; k rows; v rows] and `ffn_up` is [gate rows; up rows] (2·F rows),
  which is the layout the llama block multiplies by already: they are used as they are in the file, still
  quantized (a file with separate `attn_q`/`attn_k`/`attn_v` is read too, as llama.cpp allows);
* NEOX rope over the first `rope.dimension_count` dims of each head (partial rotary: Phi-4-mini rotates
  96 of 128); the rest pass through;
* LongRoPE: `rope_factors_long.weight` / `rope_factors_short.weight` ([rope_dim/2] each) divide the
  rope frequencies, the long ones when the context ember holds is longer than
  `rope.scaling.original_context_length` (llama.cpp's rule: by the context size, once per load;
  transformers picks by the longest position in each call instead, which agrees whenever the prompt
  and context are on the same side of the original length), the short ones otherwise; cos and sin are
  multiplied by `rope.scaling.attn_factor` (the converter's √(1 + ln s / ln L_orig), s = context /
  original), so q·k by its square;
* `attention.sliding_window` is ignored: llama.cpp switches phi3's sliding window off.

Per layer l, on rows h [T, H]:
    x = RMSNorm(h, attn_norm)
    q, k, v = rows of x Wqkvᵀ
    q, k = rope(q), rope(k)            (NEOX, first rope_dim dims; θ / factors; cos, sin · attn_factor)
    a = attention(q, k, v; 1/√head_dim) Woᵀ               → after_attention (before the residual add)
    h = h + a
    m = (silu(g) ⊙ u) Wdᵀ, [g | u] = RMSNorm(h, ffn_norm) Wupᵀ   → after_mlp (before the residual add)
    h = h + m                                              → after_layer
z = RMSNorm(h[last], output_norm)                          → before_logits
logits = z Woutᵀ (Eᵀ when tied: Phi-4-mini)                → after_logits
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ember.config import MetadataReader
from ember.errors import GGUFError
from ember.families import llama
from ember.families.llama import LlamaConfig
from ember.gguf_file import GGUFFile
from ember.ops import rope_tables
from ember.weights import WeightStore

SCALING_TYPES = ("none", "linear", "longrope")  # llama.cpp's types but yarn (which phi3 files never carry)
LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"


@dataclass(frozen=True, slots=True)
class Phi3Config(LlamaConfig):
    rope_attention_factor: float  # multiplies cos and sin (`rope.scaling.attn_factor`; 1.0)
    rope_original_context: int  # longer contexts: long factors (`rope.scaling.original_context_length`)


def build_config(gguf: GGUFFile) -> Phi3Config:
    """llama's config of the file, after phi3's own keys are checked: the rotated dims, the scaling type,
    the attention factor and the original context."""
    meta = MetadataReader(gguf)
    where = f"{gguf.path}: metadata '{meta.arch}."
    hidden_size = meta.size("embedding_length")
    head_count = meta.size("attention.head_count")
    head_dim = meta.int("attention.key_length", hidden_size // head_count)
    rope_dim = meta.int("rope.dimension_count", head_dim)
    if not 2 <= rope_dim <= head_dim or rope_dim % 2:
        raise GGUFError(f"{where}rope.dimension_count' is {rope_dim}; it must be an even number of dims "
                        f"from 2 to the head dim {head_dim} (partial rotary {rope_dim / head_dim:.3g})")
    scaling_type = meta.raw("rope.scaling.type")
    if scaling_type is not None and scaling_type not in SCALING_TYPES:
        raise GGUFError(f"{where}rope.scaling.type' is {scaling_type!r:.40}; ember reads phi3 files with "
                        f"{', '.join(SCALING_TYPES)} (LongRoPE from the rope_factors tensors)")
    attention_factor = meta.float("rope.scaling.attn_factor", 1.0)
    if not np.isfinite(attention_factor) or attention_factor <= 0:
        raise GGUFError(f"{where}rope.scaling.attn_factor' is {attention_factor}; it multiplies cos and sin, "
                        "so it must be a positive number")
    context_length = meta.int("context_length")
    original = meta.int("rope.scaling.original_context_length", context_length)
    if original < 1:
        raise GGUFError(f"{where}rope.scaling.original_context_length' is {original}; it must be at least 1")
    base = llama.build_config(gguf)
    return Phi3Config(**{f.name: getattr(base, f.name) for f in fields(base)},
                      rope_attention_factor=attention_factor, rope_original_context=original)


cache_specs = llama.cache_specs


def tensor_shapes(config: Phi3Config) -> dict[str, tuple[int, ...]]:
    """llama's shapes with phi3's fused tensors and the LongRoPE factors."""
    shapes = llama.tensor_shapes(config)
    H, F = config.hidden_size, config.feed_forward_length
    qkv = (config.head_count + 2 * config.head_count_kv) * config.head_dim
    shapes.update({LONG_FACTORS: (config.rope_dim // 2,), SHORT_FACTORS: (config.rope_dim // 2,)})
    for i in range(config.layer_count):
        shapes.update({f"blk.{i}.attn_qkv.weight": (qkv, H), f"blk.{i}.ffn_up.weight": (2 * F, H)})
    return shapes


def load_weights(store: WeightStore, config: Phi3Config) -> llama.Weights:
    store.check_shapes(tensor_shapes(config), llama.SHAPES_SOURCE)
    for name in store.gguf.tensors:
        if name.endswith(".bias"):
            raise GGUFError(f"{store.gguf.path}: tensor {name!r} is a bias ember's phi3 block does not "
                            "implement")
    layers = []
    for i in range(config.layer_count):
        block = f"blk.{i}."
        if store.has(block + "attn_qkv.weight"):
            qkv = store.matrix(block + "attn_qkv.weight")  # [q; k; v] rows: the block's fused layout
        else:
            qkv = store.stacked([block + "attn_q.weight", block + "attn_k.weight", block + "attn_v.weight"])
        layers.append(llama.LayerWeights(
            attn_norm=store.vector(block + "attn_norm.weight"),
            qkv=qkv, qkv_bias=None, q_norm=None, k_norm=None,
            attn_output=store.matrix(block + "attn_output.weight"),
            ffn_norm=store.vector(block + "ffn_norm.weight"),
            gate_up=store.matrix(block + "ffn_up.weight"),  # [gate; up] rows (llama.cpp's fused SwiGLU)
            ffn_down=store.matrix(block + "ffn_down.weight"),
        ))
    tied = config.tied_embeddings  # Phi-4-mini: token_embd is the LM head too
    embedding = store.matrix("token_embd.weight") if tied else store.table("token_embd.weight")
    return llama.Weights(token_embd=embedding, output_norm=store.vector("output_norm.weight"),
                         output=embedding if config.tied_embeddings else store.matrix("output.weight"),
                         layers=layers)


def rope_factors(store: WeightStore, config: Phi3Config, context_length: int) -> np.ndarray | None:
    """The LongRoPE factors llama.cpp picks for a context of `context_length` (None: the file has none)."""
    name = LONG_FACTORS if context_length > config.rope_original_context else SHORT_FACTORS
    if not store.has(name):
        return None
    factors = store.vector(name)
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise GGUFError(f"{store.gguf.path}: tensor {name!r} has a factor that is not a positive number; the "
                        "rope frequencies are divided by them")
    return factors


class Phi3Forward(llama.LlamaForward):
    """llama's forward with phi3's rope tables (LongRoPE factors and attention factor)."""

    def __init__(self, config: Phi3Config, weights: llama.Weights, store: WeightStore,
                 context_length: int) -> None:
        super().__init__(config, weights, store, context_length)
        self.rope_factors = rope_factors(store, config, context_length)
        cos, sin = rope_tables(config.rope_dim, config.rope_base, context_length,
                               linear_factor=config.rope_linear_factor, frequency_factors=self.rope_factors)
        if config.rope_attention_factor != 1.0:
            cos *= np.float32(config.rope_attention_factor)
            sin *= np.float32(config.rope_attention_factor)
        self.rope_cos, self.rope_sin = cos, sin


def build_forward(config: Phi3Config, store: WeightStore, context_length: int) -> Any:
    return Phi3Forward(config, load_weights(store, config), store, context_length)
