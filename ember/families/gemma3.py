"""Gemma 3 (GGUF architecture `gemma3`), docs/families.md §4 (the block skeleton of §3.6).

The file's norm weights already hold 1 + w (llama.cpp's converter adds 1), so every norm multiplies by
the stored value. Layer l is sliding or full (`attention.sliding_window_pattern`, default 6: layer l
slides iff l % 6 < 5); sliding layers see the last `sliding_window` positions and use rope base
`rope.freq_base_swa` (default 10000) without scaling, full layers use `rope.freq_base` and the linear
rope factor if the file has one.

Input rows: h = E[token] · √H (the scale in float32). Per layer l, on rows h [T, H]:
    x = RMSNorm(h, attn_norm)
    q, k, v = x Wqᵀ, x Wkᵀ, x Wvᵀ
    q, k = RMSNorm per head (attn_q_norm, attn_k_norm), then NEOX rope (base of l's layer type)
    o = attention(q, k, v; scale 1/√head_dim, causal, window on sliding layers) Woᵀ
    a = RMSNorm(o, post_attention_norm)                          → after_attention (before the residual add)
    h = h + a
    y = RMSNorm(h, ffn_norm)
    m = RMSNorm((gelu_tanh(y Wgᵀ) ⊙ y Wuᵀ) Wdᵀ, post_ffw_norm)   → after_mlp (before the residual add)
    h = h + m                                                    → after_layer
z = RMSNorm(h[last], output_norm)                                → before_logits
logits = z Eᵀ (tied); c·tanh(logits / c) only if the file has final_logit_softcapping c   → after_logits
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ember import stages
from ember.config import MetadataReader, ModelConfig, RopeLayout
from ember.errors import GGUFError
from ember.families import llama
from ember.families.head import Readouts, final_norm_and_logits
from ember.families.inside import show_inputs
from ember.families.workspace import Workspace
from ember.gguf_file import GGUFFile
from ember.kv_cache import LayeredKVCache
from ember.ops import (
    apply_rope,
    gather_rows,
    gelu_tanh_inplace,
    linear,
    linear_at,
    rms_norm,
    rope_tables,
)
from ember.phases import ExecutionPhase, ModelFamily
from ember.rows import Rows, SequenceRows
from ember.weights import WeightStore

DEFAULT_SLIDING_PATTERN = 6  # llama.cpp's default for gemma3: five sliding layers, then one full
DEFAULT_ROPE_BASE_SWA = 10000.0
LAYER_COUNT_27B = 62  # llama.cpp scales Gemma 3 27B's queries by 1/√(H / n_head) instead of 1/√head_dim


@dataclass(frozen=True, slots=True)
class Gemma3Config(ModelConfig):
    """`rope_base`/`rope_linear_factor` of the base class apply to full-attention layers only."""

    sliding_window: int  # positions a sliding layer sees, the current one included; 0: no sliding layers
    sliding_layers: tuple[bool, ...]  # per layer: True if it uses the sliding window
    rope_base_swa: float  # rope base of the sliding layers (never scaled)
    attention_scale: float  # multiplies q·k (HF: query_pre_attn_scalar^−½)
    embedding_scale: float  # √H, as a float32 value
    final_logit_softcap: float  # 0.0: no softcap


def sliding_pattern(meta: MetadataReader, layer_count: int, window: int) -> tuple[bool, ...]:
    """Which layers slide: none without a window, else the file's pattern (`read_pattern`)."""
    if window <= 0:
        return (False,) * layer_count
    return read_pattern(meta, layer_count, DEFAULT_SLIDING_PATTERN)


def read_pattern(meta: MetadataReader, layer_count: int, default: int) -> tuple[bool, ...]:
    """Which layers the file's pattern makes sliding, the way llama.cpp reads it (`load_swa_pattern`,
    `set_swa_pattern`): a per-layer array, or a period n (`default` when the file has no pattern)."""
    pattern = meta.raw("attention.sliding_window_pattern", default)
    if np.ndim(pattern) == 1:
        flags = tuple(bool(v) for v in pattern)
        if len(flags) != layer_count:
            raise GGUFError(
                f"{meta.gguf.path}: metadata '{meta.arch}.attention.sliding_window_pattern' has {len(flags)} "
                f"entries, expected one per layer ({layer_count})"
            )
        return flags
    period = int(pattern)
    # period n: layer l slides iff l % n < n − 1 (the last of every n layers is full); 0: all slide
    return tuple(period == 0 or layer % period < period - 1 for layer in range(layer_count))


def build_config(gguf: GGUFFile) -> Gemma3Config:
    meta = MetadataReader(gguf)
    hidden_size = meta.size("embedding_length")
    layer_count = meta.layer_count()
    head_count = meta.size("attention.head_count")
    head_dim = meta.int("attention.key_length", hidden_size // head_count)
    value_dim = meta.int("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"{gguf.path}: key_length {head_dim} != value_length {value_dim} is not supported")
    linear_factor = 1.0
    scaling_type = meta.raw("rope.scaling.type", "linear")
    factor = meta.raw("rope.scaling.factor", meta.raw("rope.scale_linear"))
    if factor and float(factor) != 1.0:
        if scaling_type != "linear":
            raise GGUFError(f"{gguf.path}: rope scaling type '{scaling_type}' is not supported (only linear)")
        linear_factor = float(factor)
    window = meta.int("attention.sliding_window", 0)
    if layer_count == LAYER_COUNT_27B:
        query_scalar = hidden_size // head_count
    else:
        query_scalar = head_dim
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    return Gemma3Config(
        architecture=gguf.architecture,
        family=ModelFamily.GEMMA3,
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
        rope_base=meta.float("rope.freq_base", 10000.0),
        rope_dim=meta.int("rope.dimension_count", head_dim),
        rope_layout=RopeLayout.NEOX,
        rope_linear_factor=linear_factor,
        has_qk_norm=True,
        tied_embeddings="output.weight" not in gguf.tensors,
        sliding_window=max(window, 0),
        sliding_layers=sliding_pattern(meta, layer_count, window),
        rope_base_swa=meta.float("rope.freq_base_swa", DEFAULT_ROPE_BASE_SWA),
        attention_scale=1.0 / math.sqrt(query_scalar),
        embedding_scale=float(np.float32(math.sqrt(hidden_size))),
        final_logit_softcap=meta.float("final_logit_softcapping", 0.0),
    )


def cache_specs(config: Gemma3Config) -> list[tuple[int, int, int]]:
    """(kv heads, head dim, window; 0 = full) of every layer's KV cache."""
    return [(config.head_count_kv, config.head_dim, config.sliding_window if slides else 0)
            for slides in config.sliding_layers]


@dataclass(slots=True)
class LayerWeights:
    """Norm weights are float32 vectors; matrices are whatever `WeightStore` holds."""

    attn_norm: np.ndarray
    qkv: Any  # [q rows; k rows; v rows] stacked into one (out, H) weight
    q_norm: np.ndarray
    k_norm: np.ndarray
    attn_output: Any
    post_attention_norm: np.ndarray
    ffn_norm: np.ndarray
    gate_up: Any  # [gate rows; up rows] stacked
    ffn_down: Any
    post_ffw_norm: np.ndarray


@dataclass(slots=True)
class Weights:
    token_embd: Any  # [V, H], rows read on demand; also the LM head when tied
    output_norm: np.ndarray
    output: Any
    layers: list[LayerWeights]


def load_weights(store: WeightStore, config: Gemma3Config) -> Weights:
    shapes = llama.tensor_shapes(config)
    for i in range(config.layer_count):
        shapes[f"blk.{i}.post_attention_norm.weight"] = shapes[f"blk.{i}.post_ffw_norm.weight"] = (
            config.hidden_size,)
    store.check_shapes(shapes, llama.SHAPES_SOURCE)

    def fused(*names: str) -> Any:
        return store.stacked(names)

    layers = []
    for i in range(config.layer_count):
        block = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=store.vector(block + "attn_norm.weight"),
            qkv=fused(block + "attn_q.weight", block + "attn_k.weight", block + "attn_v.weight"),
            q_norm=store.vector(block + "attn_q_norm.weight"),
            k_norm=store.vector(block + "attn_k_norm.weight"),
            attn_output=store.matrix(block + "attn_output.weight"),
            post_attention_norm=store.vector(block + "post_attention_norm.weight"),
            ffn_norm=store.vector(block + "ffn_norm.weight"),
            gate_up=fused(block + "ffn_gate.weight", block + "ffn_up.weight"),
            ffn_down=store.matrix(block + "ffn_down.weight"),
            post_ffw_norm=store.vector(block + "post_ffw_norm.weight"),
        ))
    tied = config.tied_embeddings
    embedding = store.matrix("token_embd.weight") if tied else store.table("token_embd.weight")
    return Weights(
        token_embd=embedding,
        output_norm=store.vector("output_norm.weight"),
        output=embedding if config.tied_embeddings else store.matrix("output.weight"),
        layers=layers,
    )


class Gemma3Forward(Readouts):
    """The forward pass of one loaded gemma3 model."""

    def __init__(self, config: Gemma3Config, weights: Weights, context_length: int) -> None:
        self.config = config
        self.weights = weights
        full = rope_tables(config.rope_dim, config.rope_base, context_length,
                           linear_factor=config.rope_linear_factor)
        sliding = rope_tables(config.rope_dim, config.rope_base_swa, context_length)
        # per layer: (cos, sin) of its layer type, and the window it attends over (0: everything)
        self.layer_rope = [sliding if slides else full for slides in config.sliding_layers]
        self.layer_window = [config.sliding_window if slides else 0 for slides in config.sliding_layers]

    def new_cache(self, context_length: int) -> LayeredKVCache:
        return LayeredKVCache.build(context_length, cache_specs(self.config))

    def new_workspace(self, rows: int, max_keys: int) -> Workspace:
        return Workspace(self.config, rows, max_keys)

    def forward(self, token_ids: np.ndarray, start_position: int, cache: LayeredKVCache, ws: Workspace,
                hooks, phase: ExecutionPhase, *, all_logits: bool = False) -> np.ndarray:
        """Evaluate token_ids at positions start_position…; return logits of the last row
        ([1, V], a workspace view) or of every row ([T, V], new) when all_logits."""
        return self.evaluate(SequenceRows(token_ids, start_position, cache, ws), hooks, phase,
                             all_logits=all_logits)

    def evaluate(self, rows: Rows, hooks, phase: ExecutionPhase, *, all_logits: bool = False) -> np.ndarray:
        """Evaluate `rows` (one sequence over a cache, or a batch: `ember.rows`); the logits of each
        sequence's last row, or of every row when all_logits."""
        c, w = self.config, self.weights
        rows.begin(hooks, phase)
        listened = stages.listened(hooks)  # the on-demand stages inside attention that hooks listen at

        self.embed(rows.token_ids, rows.hidden)
        for i, layer in enumerate(w.layers):
            h, ws = rows.enter(i)
            hooks.before_layer(i, h)
            x = self.norm(h, layer.attn_norm, ws)
            o = self.attention(i, layer, x, rows, ws, hooks, listened)
            a = self.post_norm(o, layer.post_attention_norm, ws)
            hooks.after_attention(i, a)
            h += a
            y = self.norm(h, layer.ffn_norm, ws)
            m = self.post_norm(self.mlp(layer, y, ws), layer.post_ffw_norm, ws)
            hooks.after_mlp(i, m)
            h += m
            hooks.after_layer(i, h)

        rows.finish()
        return final_norm_and_logits(h, w.output_norm, c.rms_norm_eps, rows, hooks, self.lm_head,
                                     c.vocab_size, all_logits)

    def embed(self, token_ids: np.ndarray, out: np.ndarray) -> None:
        """out = E[t] · √H, decoding only the rows of these tokens."""
        gather_rows(self.weights.token_embd, token_ids, out)
        out *= np.float32(self.config.embedding_scale)

    def norm(self, h: np.ndarray, weight: np.ndarray, ws: Workspace) -> np.ndarray:
        """RMSNorm(h, weight) into ws.normed."""
        return rms_norm(h, weight, self.config.rms_norm_eps, ws.normed, ws.row_scratch)

    def post_norm(self, o: np.ndarray, weight: np.ndarray, ws: Workspace) -> np.ndarray:
        """RMSNorm(o, weight) in place (the sandwich norm after attention and MLP)."""
        return rms_norm(o, weight, self.config.rms_norm_eps, o, ws.row_scratch)

    def attention(self, i: int, layer: LayerWeights, x: np.ndarray, rows: Rows, ws: Workspace,
                  hooks: Any, listened: frozenset[str]) -> np.ndarray:
        """o = attention(q, k, v) Woᵀ, q, k, v = x Wqᵀ, x Wkᵀ, x Wvᵀ with q, k RMSNorm-ed per head then
        rotated with layer i's rope; each row attends over its own sequence's keys, within the window on
        a sliding layer (k, v go to layer i's cache). Returns ws.attention_output."""
        c = self.config
        T, hd, n_head, n_kv, eps = len(x), c.head_dim, c.head_count, c.head_count_kv, c.rms_norm_eps
        q_width, kv_width = n_head * hd, n_kv * hd
        linear(x, layer.qkv, ws.qkv)
        q = ws.qkv[:, :q_width].reshape(T, n_head, hd)
        k = ws.qkv[:, q_width:q_width + kv_width].reshape(T, n_kv, hd)
        v = ws.qkv[:, q_width + kv_width:].reshape(T, n_kv, hd)
        k_spread = ws.head_spread[:, :n_kv] if ws.head_spread is not None else None
        rms_norm(q, layer.q_norm, eps, q, ws.head_scratch, ws.head_spread)
        rms_norm(k, layer.k_norm, eps, k, ws.head_scratch[:, :n_kv], k_spread)
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
                    ws=ws, pattern=pattern)
        hooks.attention_heads(i, ws.attention_heads)
        return linear(ws.attention_heads, layer.attn_output, ws.attention_output)

    def mlp(self, layer: LayerWeights, y: np.ndarray, ws: Workspace) -> np.ndarray:
        """(gelu_tanh(y Wgᵀ) ⊙ y Wuᵀ) Wdᵀ. Returns ws.mlp_output."""
        F = self.config.feed_forward_length
        linear(y, layer.gate_up, ws.gate_up)
        gate, up = ws.gate_up[:, :F], ws.gate_up[:, F:]
        gelu_tanh_inplace(gate, ws.mlp_scratch)
        gate *= up
        return linear(gate, layer.ffn_down, ws.mlp_output)

    def lm_head(self, z: np.ndarray, out: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
        """logits = z Eᵀ, soft-capped when the model has a final logit softcap; with `columns` those
        vocabulary entries' alone."""
        linear_at(z, self.weights.output, out, columns)
        cap = self.config.final_logit_softcap
        if cap:
            out *= 1.0 / cap
            np.tanh(out, out=out)
            out *= cap
        return out


def build_forward(config: Gemma3Config, store: WeightStore, context_length: int) -> Gemma3Forward:
    return Gemma3Forward(config, load_weights(store, config), context_length)
