"""OLMo 2 (GGUF architecture `olmo2`), docs/families.md §8.

A llama block with its norms moved: none before attention or the MLP, one after each (on the branch's
output, before the residual add), and QK-norm over all heads at once (`attn_q_norm` has heads·head_dim
weights: one RMS over the whole query vector, not one per head). NEOX rope; the LM head is never tied
(llama.cpp requires `output.weight`). The config is llama's (`llama.build_config`); OLMo 3's sliding
layers (`olmo2.attention.sliding_window`) are refused.

Per layer l, on rows h [T, H]:
    q, k, v = h Wqᵀ, h Wkᵀ, h Wvᵀ
    q = RMSNorm(q [T, heads·hd], attn_q_norm),  k = RMSNorm(k [T, kv_heads·hd], attn_k_norm)
    q, k = rope(q), rope(k)                                     (NEOX, per head)
    a = RMSNorm(attention(q, k, v; 1/√hd) Woᵀ, post_attention_norm)   → after_attention (before the add)
    h = h + a
    m = RMSNorm((silu(h Wgᵀ) ⊙ h Wuᵀ) Wdᵀ, post_ffw_norm)       → after_mlp (before the residual add)
    h = h + m                                                   → after_layer
z = RMSNorm(h[last], output_norm)                               → before_logits
logits = z Woutᵀ                                                → after_logits
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ember import stages
from ember.errors import GGUFError
from ember.families import llama
from ember.families.head import final_norm_and_logits
from ember.families.inside import show_inputs
from ember.families.llama import LlamaConfig
from ember.families.workspace import Workspace
from ember.gguf_file import GGUFFile
from ember.ops import apply_rope, linear, rms_norm
from ember.phases import ExecutionPhase
from ember.rows import Rows
from ember.weights import WeightStore


def build_config(gguf: GGUFFile) -> LlamaConfig:
    window = gguf.metadata.get("olmo2.attention.sliding_window")
    if window:
        raise GGUFError(f"{gguf.path}: metadata 'olmo2.attention.sliding_window' is {window!r:.40}: sliding-"
                        "window layers (OLMo 3) are not supported")
    return llama.build_config(gguf)


cache_specs = llama.cache_specs


@dataclass(slots=True)
class LayerWeights:
    qkv: Any  # [q rows; k rows; v rows] stacked into one (out, H) weight
    q_norm: np.ndarray  # (heads·hd,)
    k_norm: np.ndarray  # (kv_heads·hd,)
    attn_output: Any
    post_attention_norm: np.ndarray
    gate_up: Any  # [gate rows; up rows] stacked
    ffn_down: Any
    post_ffw_norm: np.ndarray


def tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    shapes = llama.tensor_shapes(config)
    for i in range(config.layer_count):
        block = f"blk.{i}."
        del shapes[block + "attn_norm.weight"], shapes[block + "ffn_norm.weight"]
        shapes.update({
            block + "attn_q_norm.weight": (config.head_count * config.head_dim,),
            block + "attn_k_norm.weight": (config.head_count_kv * config.head_dim,),
            block + "post_attention_norm.weight": (config.hidden_size,),
            block + "post_ffw_norm.weight": (config.hidden_size,),
        })
    return shapes


def load_weights(store: WeightStore, config: LlamaConfig) -> llama.Weights:
    store.check_shapes(tensor_shapes(config), llama.SHAPES_SOURCE)
    layers = []
    for i in range(config.layer_count):
        block = f"blk.{i}."
        if store.has(block + "attn_q.bias"):
            raise GGUFError(f"{store.gguf.path}: tensor '{block}attn_q.bias' is a bias ember's olmo2 block "
                            "does not implement")
        layers.append(LayerWeights(
            qkv=store.stacked([block + "attn_q.weight", block + "attn_k.weight", block + "attn_v.weight"]),
            q_norm=store.vector(block + "attn_q_norm.weight"),
            k_norm=store.vector(block + "attn_k_norm.weight"),
            attn_output=store.matrix(block + "attn_output.weight"),
            post_attention_norm=store.vector(block + "post_attention_norm.weight"),
            gate_up=store.stacked([block + "ffn_gate.weight", block + "ffn_up.weight"]),
            ffn_down=store.matrix(block + "ffn_down.weight"),
            post_ffw_norm=store.vector(block + "post_ffw_norm.weight"),
        ))
    return llama.Weights(token_embd=store.table("token_embd.weight"),
                         output_norm=store.vector("output_norm.weight"),
                         output=store.matrix("output.weight"), layers=layers)


class Olmo2Forward(llama.LlamaForward):
    """The forward pass of one loaded olmo2 model: llama's embedding, rope tables, MLP and head; its own
    layer (post-norms only) and attention (QK-norm over all heads)."""

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
            o = self.attention(i, layer, h, rows, ws, hooks, listened)
            a = self.post_norm(o, layer.post_attention_norm, ws)
            hooks.after_attention(i, a)
            h += a
            m = self.post_norm(self.mlp(layer, h, ws), layer.post_ffw_norm, ws)
            hooks.after_mlp(i, m)
            h += m
            hooks.after_layer(i, h)

        rows.finish()
        return final_norm_and_logits(h, w.output_norm, c.rms_norm_eps, rows, hooks, self.lm_head,
                                     c.vocab_size, all_logits)

    def post_norm(self, o: np.ndarray, weight: np.ndarray, ws: Workspace) -> np.ndarray:
        """RMSNorm(o, weight) in place (the norm after attention and after the MLP)."""
        return rms_norm(o, weight, self.config.rms_norm_eps, o, ws.row_scratch)

    def attention(self, i: int, layer: LayerWeights, x: np.ndarray, rows: Rows, ws: Workspace,
                  hooks: Any, listened: frozenset[str]) -> np.ndarray:
        """o = attention(rope(q), rope(k), v) Woᵀ with q, k, v = x Wqᵀ, x Wkᵀ, x Wvᵀ, q and k each
        RMSNorm-ed over all their heads at once before rope; each row attends over its own sequence's
        keys (k, v go to layer i's cache). Returns ws.attention_output."""
        c = self.config
        T, hd, n_head, n_kv, eps = len(x), c.head_dim, c.head_count, c.head_count_kv, c.rms_norm_eps
        q_width, kv_width = n_head * hd, n_kv * hd
        linear(x, layer.qkv, ws.qkv)
        q_flat, k_flat = ws.qkv[:, :q_width], ws.qkv[:, q_width:q_width + kv_width]
        spread = ws.head_spread.reshape(T, q_width) if ws.head_spread is not None else None
        rms_norm(q_flat, layer.q_norm, eps, q_flat, ws.row_scratch, spread)
        rms_norm(k_flat, layer.k_norm, eps, k_flat, ws.row_scratch,
                 spread[:, :kv_width] if spread is not None else None)
        q = q_flat.reshape(T, n_head, hd)
        k = k_flat.reshape(T, n_kv, hd)
        v = ws.qkv[:, q_width + kv_width:].reshape(T, n_kv, hd)
        cos, sin = rows.take(self.rope_cos, T), rows.take(self.rope_sin, T)
        k_scratch = ws.rope_scratch[:, :, :n_kv] if ws.rope_scratch is not None else None
        apply_rope(q, cos, sin, c.rope_layout, c.rope_dim, ws.rope_a, ws.rope_b, ws.rope_scratch)
        apply_rope(k, cos, sin, c.rope_layout, c.rope_dim, ws.rope_a[:, :n_kv], ws.rope_b[:, :n_kv],
                   k_scratch)
        pattern = None
        if listened:
            show_inputs(hooks, i, listened, q, k, v)
            if "attention_pattern" in listened:
                pattern = partial(hooks.attention_pattern, i)
        rows.attend(i, q, k, v, scale=self.scale, window=0, out=ws.attention_heads, ws=ws, pattern=pattern)
        hooks.attention_heads(i, ws.attention_heads)
        return linear(ws.attention_heads, layer.attn_output, ws.attention_output)


def build_forward(config: LlamaConfig, store: WeightStore, context_length: int) -> Olmo2Forward:
    return Olmo2Forward(config, load_weights(store, config), store, context_length)
