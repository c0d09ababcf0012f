"""Gemma 2 (GGUF architecture `gemma2`), docs/families.md §11.

Gemma 3's block (`ember.families.gemma3`: sandwich norms stored as 1 + w, GELU-tanh MLP, √H embedding
scale, tied LM head, sliding and full layers) without QK-norm, with one rope for every layer and with a
softcap on the attention logits. What the file means is what it means to llama.cpp (`src/models/
gemma2.cpp`), which fixes some choices in code rather than metadata:

* layer l slides iff l is even (`attention.sliding_window_pattern`, default period 2; transformers'
  `layer_types` alternate the same way), over `attention.sliding_window` positions (default 4096);
* one rope base for all layers (`rope.freq_base`, default 10000; `rope.freq_base_swa` if the file has
  one), no rope scaling (the converter writes none; a file with a factor is refused);
* the attention scale 1/√head_dim, head_dim = `attention.key_length` (HF: query_pre_attn_scalar^−½,
  256 = head_dim for 2B and 9B), except for 46 layers (27B): 1/√(H / n_head) (HF 144); the converter
  does not write `query_pre_attn_scalar`;
* `attn_logit_softcapping` (default 50) and `final_logit_softcapping` (default 30) always apply;
* the LM head is `token_embd` (llama.cpp reads no `output.weight` for gemma2).

Input rows: h = E[token] · √H (the scale in float32). Per layer l, on rows h [T, H]:
    x = RMSNorm(h, attn_norm)
    q, k, v = x Wqᵀ, x Wkᵀ, x Wvᵀ;  q, k = NEOX rope
    s = scale · q·k;  s = c_attn · tanh(s / c_attn)             (before the causal / sliding mask)
    o = softmax(s masked) v Woᵀ                                 → attention_pattern: softmax(s masked)
    a = RMSNorm(o, post_attention_norm)                         → after_attention (before the residual add)
    h = h + a
    y = RMSNorm(h, ffn_norm)
    m = RMSNorm((gelu_tanh(y Wgᵀ) ⊙ y Wuᵀ) Wdᵀ, post_ffw_norm)  → after_mlp (before the residual add)
    h = h + m                                                   → after_layer
z = RMSNorm(h[last], output_norm)                               → before_logits
logits = c_final · tanh(z Eᵀ / c_final)                         → after_logits
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ember.config import MetadataReader, RopeLayout
from ember.errors import GGUFError
from ember.families import gemma3, llama
from ember.families.gemma3 import Gemma3Config, Gemma3Forward
from ember.families.inside import show_inputs
from ember.families.workspace import Workspace
from ember.gguf_file import GGUFFile
from ember.ops import apply_rope, linear
from ember.phases import ModelFamily
from ember.rows import Rows
from ember.weights import WeightStore

DEFAULT_SLIDING_WINDOW = 4096  # llama.cpp's n_swa for gemma2 when the file has no window
DEFAULT_SLIDING_PATTERN = 2  # every other layer slides, the first one included
DEFAULT_ATTENTION_SOFTCAP = 50.0  # llama.cpp's f_attn_logit_softcapping
DEFAULT_FINAL_SOFTCAP = 30.0  # llama.cpp's f_final_logit_softcapping
LAYER_COUNT_27B = 46  # llama.cpp scales Gemma 2 27B's queries by 1/√(H / n_head) instead of 1/√head_dim


@dataclass(frozen=True, slots=True)
class Gemma2Config(Gemma3Config):
    """Gemma 3's config; `rope_base_swa` is `rope_base` unless the file says otherwise, and
    `has_qk_norm` is False."""

    attention_softcap: float  # c of c·tanh(s / c) on every attention score


def read_softcap(meta: MetadataReader, key: str, default: float) -> float:
    """A softcap: a finite number above 0 (c·tanh(s/c) divides by it)."""
    value = meta.float(key, default)
    if not (math.isfinite(value) and value > 0):
        raise GGUFError(f"{meta.gguf.path}: metadata '{meta.arch}.{key}' is {value}; a softcap must be a "
                        "finite number above 0")
    return value


def build_config(gguf: GGUFFile) -> Gemma2Config:
    meta = MetadataReader(gguf)
    hidden_size = meta.size("embedding_length")
    layer_count = meta.layer_count()
    head_count = meta.size("attention.head_count")
    head_dim = meta.int("attention.key_length", hidden_size // head_count)
    value_dim = meta.int("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"{gguf.path}: key_length {head_dim} != value_length {value_dim} is not supported")
    scaling = "rope.scaling.factor" if meta.has("rope.scaling.factor") else "rope.scale_linear"
    factor = meta.raw(scaling)
    if factor is not None and factor != 1.0:
        raise GGUFError(f"{gguf.path}: metadata '{meta.arch}.{scaling}' is {factor!r:.40}: rope scaling is "
                        "not supported for gemma2 (its converter writes none)")
    sliding_layers = gemma3.read_pattern(meta, layer_count, DEFAULT_SLIDING_PATTERN)
    window = meta.int("attention.sliding_window", DEFAULT_SLIDING_WINDOW)
    if any(sliding_layers) and window < 1:
        raise GGUFError(f"{gguf.path}: metadata '{meta.arch}.attention.sliding_window' is {window}, but "
                        f"{sum(sliding_layers)} layers slide; the window must be at least 1")
    query_scalar = hidden_size // head_count if layer_count == LAYER_COUNT_27B else head_dim
    rope_base = meta.float("rope.freq_base", 10000.0)
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    return Gemma2Config(
        architecture=gguf.architecture,
        family=ModelFamily.GEMMA2,
        name=str(gguf.metadata.get("general.name", gguf.path.stem)),
        layer_count=layer_count,
        hidden_size=hidden_size,
        head_count=head_count,
        head_count_kv=meta.int("attention.head_count_kv", head_count),
        head_dim=head_dim,
        feed_forward_length=meta.int("feed_forward_length"),
        vocab_size=meta.int("vocab_size", len(tokens) if tokens is not None else None),
        context_length=meta.int("context_length"),
        rms_norm_eps=meta.float("attention.layer_norm_rms_epsilon"),
        rope_base=rope_base,
        rope_dim=meta.int("rope.dimension_count", head_dim),
        rope_layout=RopeLayout.NEOX,
        rope_linear_factor=1.0,
        has_qk_norm=False,
        tied_embeddings=True,
        sliding_window=window if any(sliding_layers) else 0,
        sliding_layers=sliding_layers,
        rope_base_swa=meta.float("rope.freq_base_swa", rope_base),
        attention_scale=1.0 / math.sqrt(query_scalar),
        embedding_scale=float(np.float32(math.sqrt(hidden_size))),
        final_logit_softcap=read_softcap(meta, "final_logit_softcapping", DEFAULT_FINAL_SOFTCAP),
        attention_softcap=read_softcap(meta, "attn_logit_softcapping", DEFAULT_ATTENTION_SOFTCAP),
    )


cache_specs = gemma3.cache_specs


@dataclass(slots=True)
class LayerWeights:
    """Gemma 3's layer without the QK-norm weights."""

    attn_norm: np.ndarray
    qkv: Any  # [q rows; k rows; v rows] stacked into one (out, H) weight
    attn_output: Any
    post_attention_norm: np.ndarray
    ffn_norm: np.ndarray
    gate_up: Any  # [gate rows; up rows] stacked
    ffn_down: Any
    post_ffw_norm: np.ndarray


def load_weights(store: WeightStore, config: Gemma2Config) -> gemma3.Weights:
    if store.has("output.weight"):
        raise GGUFError(f"{store.gguf.path}: tensor 'output.weight': a gemma2 file's LM head is token_embd "
                        "(llama.cpp reads no other)")
    shapes = llama.tensor_shapes(config)
    for i in range(config.layer_count):
        shapes[f"blk.{i}.post_attention_norm.weight"] = shapes[f"blk.{i}.post_ffw_norm.weight"] = (
            config.hidden_size,)
    store.check_shapes(shapes, llama.SHAPES_SOURCE)
    layers = []
    for i in range(config.layer_count):
        block = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=store.vector(block + "attn_norm.weight"),
            qkv=store.stacked([block + "attn_q.weight", block + "attn_k.weight", block + "attn_v.weight"]),
            attn_output=store.matrix(block + "attn_output.weight"),
            post_attention_norm=store.vector(block + "post_attention_norm.weight"),
            ffn_norm=store.vector(block + "ffn_norm.weight"),
            gate_up=store.stacked([block + "ffn_gate.weight", block + "ffn_up.weight"]),
            ffn_down=store.matrix(block + "ffn_down.weight"),
            post_ffw_norm=store.vector(block + "post_ffw_norm.weight"),
        ))
    embedding = store.matrix("token_embd.weight")  # also the LM head
    return gemma3.Weights(token_embd=embedding, output_norm=store.vector("output_norm.weight"),
                          output=embedding, layers=layers)


class Gemma2Forward(Gemma3Forward):
    """The forward pass of one loaded gemma2 model: Gemma 3's layer loop, embedding, norms, MLP and
    soft-capped LM head; its own attention (no QK-norm, soft-capped logits)."""

    config: Gemma2Config

    def attention(self, i: int, layer: LayerWeights, x: np.ndarray, rows: Rows, ws: Workspace,
                  hooks: Any, listened: frozenset[str]) -> np.ndarray:
        """o = softmax(c·tanh(scale·q·kᵀ / c) masked) v Woᵀ with q, k, v = x Wqᵀ, x Wkᵀ, x Wvᵀ, q and k
        rotated; each row attends over its own sequence's keys, within the window on a sliding layer
        (k, v go to layer i's cache). Returns ws.attention_output."""
        c = self.config
        T, hd, n_head, n_kv = len(x), c.head_dim, c.head_count, c.head_count_kv
        q_width, kv_width = n_head * hd, n_kv * hd
        linear(x, layer.qkv, ws.qkv)
        q = ws.qkv[:, :q_width].reshape(T, n_head, hd)
        k = ws.qkv[:, q_width:q_width + kv_width].reshape(T, n_kv, hd)
        v = ws.qkv[:, q_width + kv_width:].reshape(T, n_kv, hd)
        cos_table, sin_table = self.layer_rope[i]
        cos, sin = rows.take(cos_table, T), rows.take(sin_table, T)
        k_scratch = ws.rope_scratch[:, :, :n_kv] if ws.rope_scratch is not None else None
        apply_rope(q, cos, sin, c.rope_layout, c.rope_dim, ws.rope_a, ws.rope_b, ws.rope_scratch)
        apply_rope(k, cos, sin, c.rope_layout, c.rope_dim, ws.rope_a[:, :n_kv], ws.rope_b[:, :n_kv],
                   k_scratch)
        pattern = None
        if listened:
            show_inputs(hooks, i, listened, q, k, v)
            if "attention_pattern" in listened:
                pattern = partial(hooks.attention_pattern, i)
        rows.attend(i, q, k, v, scale=c.attention_scale, window=self.layer_window[i], out=ws.attention_heads,
                    ws=ws, pattern=pattern, softcap=c.attention_softcap)
        hooks.attention_heads(i, ws.attention_heads)
        return linear(ws.attention_heads, layer.attn_output, ws.attention_output)


def build_forward(config: Gemma2Config, store: WeightStore, context_length: int) -> Gemma2Forward:
    return Gemma2Forward(config, load_weights(store, config), context_length)
