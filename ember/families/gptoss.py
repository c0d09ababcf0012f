"""gpt-oss (GGUF architecture `gpt-oss`: gpt-oss-20b, gpt-oss-120b), docs/families.md §14.

A mixture of experts with biases everywhere and attention sinks. What the file means is what it means to
llama.cpp (`src/models/openai-moe-iswa.cpp`, `build_moe_ffn`), which fixes some choices in code:

* layer l slides iff l is even (llama.cpp's `set_swa_pattern(2)`; transformers' default `layer_types`),
  over `attention.sliding_window` positions (required);
* the attention scale is 1/√rope_dim (`rope.dimension_count`, = head_dim in the released models);
* each head's softmax has one more logit, the layer's `attn_sinks[h]`, that takes a share of the weight
  and brings no value (`ember.ops.softmax_with_sinks_inplace`);
* the router picks the k largest logits (bias included) and the weights are the softmax over those k
  (llama.cpp's SOFTMAX_WEIGHT gating; transformers' GptOssTopKRouter);
* the experts' gated product is the clamped SwiGLU with α = 1.702 and limit 7 (constants in llama.cpp's
  code and transformers' config defaults; the converter writes neither).

Input rows: h = E[token]. Per layer l, on rows h [T, H]:
    x = RMSNorm(h, attn_norm)
    q, k, v = x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv;  q, k = NEOX rope (YaRN as the file says)
    p = softmax([scale · q·kᵀ masked, sink_h]) without its last column     → attention_pattern: p
    a = (p v) Woᵀ + bo                                    → after_attention (before the residual add)
    h = h + a
    y = RMSNorm(h, post_attention_norm)
    r = y W_gate_inpᵀ + b_gate_inp                        → router [T, experts] (writable)
    chosen = top-k of r;  w = softmax(r[chosen])
    g, u = y W_gate[e]ᵀ + bg[e], y W_up[e]ᵀ + bu[e]
    g' = min(g, 7);  u' = clip(u, −7, 7);  act = g' · σ(1.702 g') · (u' + 1)
    m = Σⱼ wⱼ · (act W_down[cⱼ]ᵀ + bd[cⱼ])                → after_mlp (before the residual add)
    h = h + m                                             → after_layer
z = RMSNorm(h[last], output_norm)                         → before_logits
logits = z Woutᵀ                                          → after_logits
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ember import stages
from ember.config import MetadataReader, RopeLayout, read_rope_scaling
from ember.errors import GGUFError
from ember.families import llama, qwen3moe
from ember.families.experts import mixture, route_top_logits
from ember.families.head import final_norm_and_logits
from ember.families.inside import show_inputs
from ember.families.qwen3moe import MoeWorkspace, Qwen3MoeConfig
from ember.families.workspace import Workspace
from ember.gguf_file import GGUFFile
from ember.kv_cache import LayeredKVCache
from ember.ops import apply_rope, linear
from ember.phases import ExecutionPhase, ModelFamily
from ember.rows import Rows
from ember.weights import WeightStore

SLIDING_PATTERN = 2  # llama.cpp: hparams.set_swa_pattern(2) for LLM_ARCH_OPENAI_MOE (no metadata key)
SWIGLU_ALPHA = 1.702  # llama.cpp's build_moe_ffn (LLM_FFN_SWIGLU_OAI_MOE), transformers' swiglu_alpha
SWIGLU_LIMIT = 7.0  # the same places, swiglu_limit


@dataclass(frozen=True, slots=True)
class GptOssConfig(Qwen3MoeConfig):
    """qwen3moe's config (attention sizes, experts) with the sliding layers."""

    sliding_window: int
    sliding_layers: tuple[bool, ...]


def build_config(gguf: GGUFFile) -> GptOssConfig:
    meta = MetadataReader(gguf)
    key = f"{gguf.architecture}."
    hidden_size = meta.size("embedding_length")
    layer_count = meta.layer_count()
    head_count = meta.size("attention.head_count")
    head_dim = meta.int("attention.key_length", hidden_size // head_count)
    value_dim = meta.int("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"{gguf.path}: key_length {head_dim} != value_length {value_dim} is not supported")
    rope_dim = meta.int("rope.dimension_count", head_dim)
    if rope_dim != head_dim:  # llama.cpp reshapes Q/K/V by n_rot: they must be equal
        raise GGUFError(f"{gguf.path}: metadata '{key}rope.dimension_count' is {rope_dim}; gpt-oss rotates "
                        f"whole heads (key_length {head_dim})")
    context_length = meta.int("context_length")
    scaling = read_rope_scaling(meta, context_length)  # the released files: YaRN, factor 32 over 4096
    experts = meta.size("expert_count")
    used = meta.size("expert_used_count")
    if used > experts:
        raise GGUFError(f"{gguf.path}: metadata '{key}expert_used_count' is {used}, more than "
                        f"'{key}expert_count' ({experts})")
    window = meta.int("attention.sliding_window")
    if window < 1:
        raise GGUFError(f"{gguf.path}: metadata '{key}attention.sliding_window' is {window}; the even "
                        "layers slide over it, so it must be at least 1")
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    return GptOssConfig(
        architecture=gguf.architecture,
        family=ModelFamily.GPT_OSS,
        name=str(gguf.metadata.get("general.name", gguf.path.stem)),
        layer_count=layer_count,
        hidden_size=hidden_size,
        head_count=head_count,
        head_count_kv=meta.int("attention.head_count_kv", head_count),
        head_dim=head_dim,
        feed_forward_length=meta.size("expert_feed_forward_length"),
        vocab_size=meta.int("vocab_size", len(tokens) if tokens is not None else None),
        context_length=context_length,
        rms_norm_eps=meta.float("attention.layer_norm_rms_epsilon"),
        rope_base=meta.float("rope.freq_base", 10000.0),
        rope_dim=rope_dim,
        rope_layout=RopeLayout.NEOX,
        rope_linear_factor=1.0 / scaling.frequency_scale,
        has_qk_norm=False,
        tied_embeddings="output.weight" not in gguf.tensors,
        rope_scaling=scaling,
        rope_layers=(True,) * layer_count,
        attention_scale=1.0 / float(np.sqrt(rope_dim)),
        embedding_scale=1.0,
        residual_scale=1.0,
        logit_scale=1.0,
        temperature_scale=0.0,  # no attention temperature (mistral3's)
        temperature_length=1,
        expert_count=experts,
        expert_used_count=used,
        sliding_window=window,
        sliding_layers=tuple(layer % SLIDING_PATTERN < SLIDING_PATTERN - 1 for layer in range(layer_count)),
    )


def cache_specs(config: GptOssConfig) -> list[tuple[int, int, int]]:
    """(kv heads, head dim, window; 0 = full) of every layer's KV cache."""
    return [(config.head_count_kv, config.head_dim, config.sliding_window if slides else 0)
            for slides in config.sliding_layers]


def tensor_shapes(config: GptOssConfig) -> dict[str, tuple[int, ...]]:
    """qwen3moe's shapes without QK-norm, with every bias, the sinks and the post-attention norm."""
    H, F, E, D = config.hidden_size, config.feed_forward_length, config.expert_count, config.head_dim
    q, kv = config.head_count * D, config.head_count_kv * D
    shapes = {name: shape for name, shape in qwen3moe.tensor_shapes(config).items()
              if "_norm" not in name or name.startswith("output")}
    for i in range(config.layer_count):
        block = f"blk.{i}."
        shapes.update({
            block + "attn_norm.weight": (H,), block + "post_attention_norm.weight": (H,),
            block + "attn_q.bias": (q,), block + "attn_k.bias": (kv,), block + "attn_v.bias": (kv,),
            block + "attn_output.bias": (H,), block + "attn_sinks.weight": (config.head_count,),
            block + "ffn_gate_inp.bias": (E,),
            block + "ffn_gate_exps.bias": (E, F), block + "ffn_up_exps.bias": (E, F),
            block + "ffn_down_exps.bias": (E, H),
        })
    return shapes


@dataclass(slots=True)
class LayerWeights:
    attn_norm: np.ndarray
    qkv: Any  # [q rows; k rows; v rows] stacked
    qkv_bias: np.ndarray  # [bq; bk; bv]
    attn_output: Any
    attn_output_bias: np.ndarray
    sinks: np.ndarray  # [heads]: each head's sink logit
    ffn_norm: np.ndarray  # the file's post_attention_norm: the experts' input norm (not on a's output)
    router: Any  # [experts, H]
    router_bias: np.ndarray  # [experts]
    expert_gate_up: list[Any]  # per expert: [gate rows; up rows] stacked, views of the file's blocks
    expert_gate_up_bias: list[np.ndarray]  # per expert: [gate bias; up bias]
    expert_down: list[Any]  # per expert: [H, F]
    expert_down_bias: list[np.ndarray]  # per expert: [H]


def load_weights(store: WeightStore, config: GptOssConfig) -> llama.Weights:
    store.check_shapes(tensor_shapes(config), qwen3moe.SHAPES_SOURCE)
    layers = []
    for i in range(config.layer_count):
        block = f"blk.{i}."
        gates = store.experts(block + "ffn_gate_exps.weight")
        ups = store.experts(block + "ffn_up_exps.weight")
        gate_bias = store.vectors(block + "ffn_gate_exps.bias")
        up_bias = store.vectors(block + "ffn_up_exps.bias")
        bias = llama.qkv_bias(store, block)
        if bias is None:
            raise GGUFError(f"{store.gguf.path}: tensor '{block}attn_q.bias' is missing (gpt-oss has Q/K/V "
                            "biases)")
        layers.append(LayerWeights(
            attn_norm=store.vector(block + "attn_norm.weight"),
            qkv=store.stacked([block + "attn_q.weight", block + "attn_k.weight", block + "attn_v.weight"]),
            qkv_bias=bias,
            attn_output=store.matrix(block + "attn_output.weight"),
            attn_output_bias=store.vector(block + "attn_output.bias"),
            sinks=store.vector(block + "attn_sinks.weight"),
            ffn_norm=store.vector(block + "post_attention_norm.weight"),
            router=store.matrix(block + "ffn_gate_inp.weight"),
            router_bias=store.vector(block + "ffn_gate_inp.bias"),
            expert_gate_up=[store.stack([gate, up]) for gate, up in zip(gates, ups, strict=True)],
            expert_gate_up_bias=[np.concatenate([g, u]) for g, u in zip(gate_bias, up_bias, strict=True)],
            expert_down=store.experts(block + "ffn_down_exps.weight"),
            expert_down_bias=store.vectors(block + "ffn_down_exps.bias"),
        ))
    tied = config.tied_embeddings
    embedding = store.matrix("token_embd.weight") if tied else store.table("token_embd.weight")
    return llama.Weights(
        token_embd=embedding,
        output_norm=store.vector("output_norm.weight"),
        output=embedding if tied else store.matrix("output.weight"),
        layers=layers,
    )


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """gate ← min(gate, 7) · σ(1.702 · min(gate, 7)) · (clip(up, −7, 7) + 1), in place (gpt-oss's
    experts; llama.cpp's swiglu_oai). `scratch` is gate's shape."""
    np.minimum(gate, np.float32(SWIGLU_LIMIT), out=gate)
    np.multiply(gate, np.float32(-SWIGLU_ALPHA), out=scratch)
    np.exp(scratch, out=scratch)
    scratch += np.float32(1.0)
    gate /= scratch  # g · σ(αg) = g / (1 + e^(−αg))
    np.clip(up, np.float32(-SWIGLU_LIMIT), np.float32(SWIGLU_LIMIT), out=up)
    up += np.float32(1.0)
    gate *= up
    return gate


class GptOssForward(qwen3moe.Qwen3MoeForward):
    """The forward pass of one loaded gpt-oss model: qwen3moe's loop with gpt-oss's attention (biases,
    sinks, sliding layers) and its experts (router bias, top-k then softmax, clamped SwiGLU, biases)."""

    config: GptOssConfig

    def __init__(self, config: GptOssConfig, weights: llama.Weights, store: WeightStore,
                 context_length: int) -> None:
        super().__init__(config, weights, store, context_length)
        self.layer_window = [config.sliding_window if slides else 0 for slides in config.sliding_layers]

    def new_cache(self, context_length: int) -> LayeredKVCache:
        return LayeredKVCache.build(context_length, cache_specs(self.config))

    def new_workspace(self, rows: int, max_keys: int) -> Workspace:
        return MoeWorkspace(self.config, rows, max_keys)

    def evaluate(self, rows: Rows, hooks, phase: ExecutionPhase, *, all_logits: bool = False) -> np.ndarray:
        c, w = self.config, self.weights
        rows.begin(hooks, phase)
        listened = stages.listened(hooks)

        self.embed(rows.token_ids, rows.hidden)
        for i, layer in enumerate(w.layers):
            h, ws = rows.enter(i)
            hooks.before_layer(i, h)
            x = self.norm(h, layer.attn_norm, ws)
            a = self.attention(i, layer, x, rows, ws, hooks, listened)
            hooks.after_attention(i, a)
            h += a
            y = self.norm(h, layer.ffn_norm, ws)
            logits = linear(y, layer.router, ws.router_logits)
            logits += layer.router_bias
            if "router" in listened:
                hooks.router(i, logits)
            chosen, weights = route_top_logits(logits, c.expert_used_count)
            m = mixture(y, chosen, weights, layer.expert_gate_up, layer.expert_down, ws.experts,
                        ws.mlp_output, glu=clamped_swiglu, gate_up_bias=layer.expert_gate_up_bias,
                        down_bias=layer.expert_down_bias)
            hooks.after_mlp(i, m)
            h += m
            hooks.after_layer(i, h)

        rows.finish()
        return final_norm_and_logits(h, w.output_norm, c.rms_norm_eps, rows, hooks, self.lm_head,
                                     c.vocab_size, all_logits)

    def attention(self, i: int, layer: LayerWeights, x: np.ndarray, rows: Rows, ws: Workspace,
                  hooks: Any, listened: frozenset[str]) -> np.ndarray:
        """a = (p v) Woᵀ + bo, p each head's softmax over its visible keys' scaled scores and its sink,
        q, k, v = x Wᵀ + b rotated (q, k); within the window on a sliding layer. Returns
        ws.attention_output."""
        c = self.config
        T, hd, n_head, n_kv = len(x), c.head_dim, c.head_count, c.head_count_kv
        q_width, kv_width = n_head * hd, n_kv * hd
        linear(x, layer.qkv, ws.qkv)
        ws.qkv += layer.qkv_bias
        q = ws.qkv[:, :q_width].reshape(T, n_head, hd)
        k = ws.qkv[:, q_width:q_width + kv_width].reshape(T, n_kv, hd)
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
        rows.attend(i, q, k, v, scale=c.attention_scale, window=self.layer_window[i], out=ws.attention_heads,
                    ws=ws, pattern=pattern, sinks=layer.sinks)
        hooks.attention_heads(i, ws.attention_heads)
        out = linear(ws.attention_heads, layer.attn_output, ws.attention_output)
        out += layer.attn_output_bias
        return out


def build_forward(config: GptOssConfig, store: WeightStore, context_length: int) -> GptOssForward:
    return GptOssForward(config, load_weights(store, config), store, context_length)
