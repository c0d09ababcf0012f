"""Gemma 4 text decoder (GGUF architecture `gemma4`), docs/families.md §3: the dense models (E2B/E4B with PLE
and KV sharing, and the 31B-style layout without them) and the mixture-of-experts one (26B-A4B: in every
layer a dense FFN and `expert_count` GeGLU experts side by side, of which each token takes
`expert_used_count`). Dense and MoE files are one family (`ModelFamily.GEMMA4`); `expert_count` > 0 in
the metadata makes a file MoE.

What differs from llama/qwen3, each explicit below: a per-layer pattern of sliding-window and full
attention layers with their own head dim, rope base and KV head count; full layers rotate with
`rope_freqs` factors ("proportional" partial rope); QK-norm and a weightless V-norm; V is the raw K
projection when `attn_v` is absent; attention scale 1.0; the last `shared_kv_layers` layers attend to
the K/V of an earlier layer and hold no cache of their own; four norms per block; per-layer embeddings
(PLE); a per-layer output scalar; a (normally tied) LM head and a final logit softcap. In MoE layers:
a router with its own input (a weightless norm of h, a scale vector, 1/√H), a per-expert scale on the
renormalised top-k weights, and three more norms around the two FFN branches.

Inputs: token ids t [T]; H hidden, P PLE width, L layers.
    h  = E[t] · √H                                            (the residual stream)
    ple[:, l] = (RMSNorm((h Wpmpᵀ)/√H, per_layer_proj_norm) + PLE[t]·√P) / √2     [T, L, P]
Per layer l (hd, n_kv, F and the rope set by the layer's kind):
    x = RMSNorm(h, attn_norm)
    q = rope(RMSNorm(x Wqᵀ, attn_q_norm))                      per head
    layers that own K/V:  k = x Wkᵀ;  v = x Wvᵀ (or the raw k when attn_v is absent)
                          k = rope(RMSNorm(k, attn_k_norm));  v = RMSNorm(v) (no weight) → cache
    shared layers:        k, v of layer `kv_source[l]` from this same evaluation
    a = RMSNorm(attention(q, k, v; scale 1, window on sliding layers) Woᵀ, post_attention_norm)
                                                               → after_attention (before the residual add)
    h = h + a
    d = (gelu_tanh(y Wgᵀ) ⊙ y Wuᵀ) Wdᵀ,  y = RMSNorm(h, ffn_norm)                 (the dense FFN)
    dense layers:  m = RMSNorm(d, post_ffw_norm)
    MoE layers (transformers' Gemma4TextDecoderLayer, llama.cpp's gemma4 graph):
        r = RMSNorm(h) ⊙ ffn_gate_inp.scale / √H                 (no weight in the norm)
        logits = r W_gate_inpᵀ                                 → router [T, experts] (writable)
        c, p = top-k of softmax(logits), renormalised to sum 1    (c the chosen experts: `experts.route`)
        wⱼ = pⱼ · ffn_down_exps.scale[cⱼ]                        (the per-expert scale)
        x = RMSNorm(h, pre_ffw_norm_2)
        e = Σⱼ wⱼ · (gelu_tanh(x W_gate[cⱼ]ᵀ) ⊙ x W_up[cⱼ]ᵀ) W_down[cⱼ]ᵀ
        m = RMSNorm(RMSNorm(d, post_ffw_norm_1) + RMSNorm(e, post_ffw_norm_2), post_ffw_norm)
                                                               → after_mlp (before the residual add)
    h = h + m
    h = h + RMSNorm((gelu_tanh(h Wgateᵀ) ⊙ ple[:, l]) Wprojᵀ, post_norm)      (PLE, when P > 0)
    h = h · layer_output_scale                                 → after_layer
z = RMSNorm(h[last], output_norm)                              → before_logits
logits = c·tanh((z Eᵀ)/c),  c = final_logit_softcapping        → after_logits

Memory: `token_embd` (also the LM head) and `per_layer_token_embd` are never dequantized whole: the
forward decodes the rows of the evaluated tokens only, and with quantized weights (the default) the LM
head multiplies the table in its own encoding (`ember.quant`). With weights="float32" the tied head is
a float32 copy (1.5 GiB for E2B's 262144 x 1536 table); the PLE table is still read by rows. Each
expert is a view of its own blocks in the mapped file (`WeightStore.experts`), multiplied once over the
rows routed to it (`ember.families.experts.mixture`); an expert no row chose is not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ember import stages
from ember.buffers import aligned_zeros
from ember.config import MetadataReader, ModelConfig, RopeLayout
from ember.errors import GGUFError
from ember.families.experts import ExpertScratch, mixture, route
from ember.families.head import Readouts, final_norm_and_logits
from ember.families.inside import show_inputs
from ember.families.workspace import head_of
from ember.gguf_file import GGUFFile
from ember.kv_cache import LayeredKVCache
from ember.ops import apply_rope, gather_rows, gelu_tanh_inplace, linear, linear_at, rms_norm
from ember.phases import ExecutionPhase, ModelFamily
from ember.rows import Rows, SequenceRows
from ember.weights import WeightStore


@dataclass(frozen=True, slots=True)
class Gemma4Config(ModelConfig):
    """ModelConfig plus Gemma 4's per-layer geometry.

    The inherited scalars describe the full-attention layers where they differ per layer kind
    (`head_dim` = `attention.key_length`, `rope_base`, `rope_dim`); `head_count_kv` and
    `feed_forward_length` are the largest per-layer values. The per-layer tuples are authoritative.
    """

    sliding: tuple[bool, ...]  # per layer: True = sliding-window attention
    layer_head_dims: tuple[int, ...]
    layer_kv_heads: tuple[int, ...]
    layer_ffn_lengths: tuple[int, ...]
    head_dim_swa: int
    rope_dim_swa: int
    rope_base_swa: float
    sliding_window: int
    shared_kv_layers: int
    kv_source: tuple[int, ...]  # per layer: the layer whose K/V it attends to (itself if it owns K/V)
    per_layer_input_dim: int  # P; 0 disables PLE
    final_logit_softcap: float  # 0 disables the cap
    expert_count: int = 0  # E; 0: a dense file. Otherwise every layer adds E experts beside its dense FFN
    expert_used_count: int = 0  # k, the experts each token takes
    expert_feed_forward_length: int = 0  # F_e, one expert's width

    @property
    def first_shared_layer(self) -> int:
        return self.layer_count - self.shared_kv_layers

    def owns_kv(self, layer: int) -> bool:
        return layer < self.first_shared_layer


def build_config(gguf: GGUFFile) -> Gemma4Config:
    meta = MetadataReader(gguf)
    path = gguf.path
    hidden_size = meta.size("embedding_length")
    layer_count = meta.layer_count()
    head_count = meta.size("attention.head_count")

    experts, used, expert_width = _experts(gguf, meta)
    pattern = meta.raw("attention.sliding_window_pattern")
    if pattern is None:
        gguf.require(f"{meta.arch}.attention.sliding_window_pattern")
    if np.ndim(pattern) != 1 or len(pattern) != layer_count:
        raise GGUFError(
            f"{path}: metadata '{meta.arch}.attention.sliding_window_pattern' must be one bool per layer "
            f"({layer_count}), got {pattern!r}"
        )
    sliding = tuple(bool(v) for v in pattern)

    head_dim_full = meta.int("attention.key_length", hidden_size // head_count)
    head_dim_swa = meta.int("attention.key_length_swa")
    value_lengths = (("attention.value_length", head_dim_full), ("attention.value_length_swa", head_dim_swa))
    for key, expected in value_lengths:
        value = meta.raw(key)
        if value is not None and int(value) != expected:
            raise GGUFError(f"{path}: '{meta.arch}.{key}' {value} differs from the key length {expected}; "
                            "Gemma 4 needs equal key and value head dims")
    rope_dim = meta.int("rope.dimension_count", head_dim_full)
    rope_dim_swa = meta.int("rope.dimension_count_swa", rope_dim)
    if rope_dim > head_dim_full or rope_dim_swa > head_dim_swa:
        raise GGUFError(f"{path}: rope dimension counts ({rope_dim} full, {rope_dim_swa} sliding) exceed the "
                        f"head dims ({head_dim_full}, {head_dim_swa})")

    kv_heads = meta.int_per_layer("attention.head_count_kv", layer_count, head_count)
    ffn_lengths = meta.int_per_layer("feed_forward_length", layer_count)
    shared = meta.int("attention.shared_kv_layers", 0)
    head_dims = tuple(head_dim_swa if s else head_dim_full for s in sliding)
    kv_source = _kv_sources(path, sliding, head_dims, kv_heads, shared)

    linear_factor = 1.0
    factor = meta.raw("rope.scaling.factor", meta.raw("rope.scale_linear"))
    if factor and float(factor) != 1.0:
        if meta.raw("rope.scaling.type", "linear") != "linear":
            raise GGUFError(f"{path}: rope scaling type '{meta.raw('rope.scaling.type')}' is not supported")
        linear_factor = float(factor)  # full layers only, as in llama.cpp

    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    vocab_size = meta.int("vocab_size", len(tokens) if tokens is not None else None)
    if "token_embd.weight" in gguf.tensors:
        vocab_size = gguf.tensor("token_embd.weight").shape[0]
    return Gemma4Config(
        architecture=gguf.architecture,
        family=ModelFamily.GEMMA4,
        name=str(gguf.metadata.get("general.name", path.stem)),
        layer_count=layer_count,
        hidden_size=hidden_size,
        head_count=head_count,
        head_count_kv=max(kv_heads),
        head_dim=head_dim_full,
        feed_forward_length=max(ffn_lengths),
        vocab_size=vocab_size,
        context_length=meta.int("context_length"),
        rms_norm_eps=meta.float("attention.layer_norm_rms_epsilon"),
        rope_base=meta.float("rope.freq_base", 10000.0),
        rope_dim=rope_dim,
        rope_layout=RopeLayout.NEOX,
        rope_linear_factor=linear_factor,
        has_qk_norm=True,
        tied_embeddings="output.weight" not in gguf.tensors,
        sliding=sliding,
        layer_head_dims=head_dims,
        layer_kv_heads=kv_heads,
        layer_ffn_lengths=ffn_lengths,
        head_dim_swa=head_dim_swa,
        rope_dim_swa=rope_dim_swa,
        rope_base_swa=meta.float("rope.freq_base_swa", 10000.0),
        sliding_window=meta.int("attention.sliding_window"),
        shared_kv_layers=shared,
        kv_source=kv_source,
        per_layer_input_dim=meta.int("embedding_length_per_layer_input"),
        final_logit_softcap=meta.float("final_logit_softcapping", 0.0),
        expert_count=experts,
        expert_used_count=used,
        expert_feed_forward_length=expert_width,
    )


def _experts(gguf: GGUFFile, meta: MetadataReader) -> tuple[int, int, int]:
    """(expert_count, expert_used_count, expert_feed_forward_length), zeros for a dense file. A file with
    experts has them in every layer (transformers' `enable_moe_block` is one switch for the model)."""
    path, key = gguf.path, f"{meta.arch}."
    count = meta.raw("expert_count")
    router = next((name for name in gguf.tensors if name.endswith("ffn_gate_inp.weight")), None)
    if not count:
        if router is not None:
            said = "is missing" if count is None else f"is {count}"
            raise GGUFError(f"{path}: metadata '{key}expert_count' {said}, but the file has a router "
                            f"tensor ({router!r}) of mixture-of-experts layers")
        return 0, 0, 0
    experts = meta.size("expert_count")
    used = meta.size("expert_used_count")
    if used > experts:
        raise GGUFError(f"{path}: metadata '{key}expert_used_count' is {used}, more than "
                        f"'{key}expert_count' ({experts})")
    return experts, used, meta.size("expert_feed_forward_length")


def _kv_sources(path, sliding: tuple[bool, ...], head_dims: tuple[int, ...], kv_heads: tuple[int, ...],
                shared: int) -> tuple[int, ...]:
    """llama.cpp's reuse rule: with f = first shared layer, a shared sliding layer reads layer f−2 and a
    shared full layer reads layer f−1. It assumes f−2 is sliding and f−1 is full (true for E2B/E4B);
    a file where that does not hold is refused rather than computed wrongly."""
    layer_count = len(sliding)
    if shared == 0:
        return tuple(range(layer_count))
    first = layer_count - shared
    if not 2 <= first < layer_count:
        raise GGUFError(f"{path}: shared_kv_layers = {shared} leaves {first} layers with their own KV; "
                        f"Gemma 4 needs at least 2 and at most {layer_count - 1}")
    sources = []
    for layer in range(layer_count):
        if layer < first:
            sources.append(layer)
            continue
        source = first - (2 if sliding[layer] else 1)
        if (sliding[source], head_dims[source], kv_heads[source]) != (sliding[layer], head_dims[layer],
                                                                      kv_heads[layer]):
            raise GGUFError(
                f"{path}: KV-shared layer {layer} ({'sliding' if sliding[layer] else 'full'}) would reuse "
                f"layer {source}, which has a different kind or geometry; llama.cpp's rule needs layers "
                f"{first - 2} (sliding) and {first - 1} (full) just before the shared ones"
            )
        sources.append(source)
    return tuple(sources)


# --------------------------------------------------------------------------- weights


def cache_specs(config: Gemma4Config) -> list[tuple[int, int, int]]:
    """(kv heads, head dim, window; 0 = full) of every layer that holds K/V (shared layers hold none)."""
    c = config
    return [(c.layer_kv_heads[i], c.layer_head_dims[i], c.sliding_window if c.sliding[i] else 0)
            for i in range(c.first_shared_layer)]


def expert_tensor_shapes(config: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """The shapes (NumPy order) the metadata implies for the mixture-of-experts tensors of every layer;
    the experts' gate and up are either fused (`ffn_gate_up_exps`: F_e gate rows, then F_e up rows) or
    two tensors (`ffn_gate_exps`, `ffn_up_exps`), as llama.cpp accepts both."""
    H, E, F = config.hidden_size, config.expert_count, config.expert_feed_forward_length
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config.layer_count if E else 0):
        block = f"blk.{i}."
        shapes.update({
            block + "ffn_gate_inp.weight": (E, H), block + "ffn_gate_inp.scale": (H,),
            block + "ffn_gate_up_exps.weight": (E, 2 * F, H),
            block + "ffn_gate_exps.weight": (E, F, H), block + "ffn_up_exps.weight": (E, F, H),
            block + "ffn_down_exps.weight": (E, H, F), block + "ffn_down_exps.scale": (E,),
            block + "pre_ffw_norm_2.weight": (H,), block + "post_ffw_norm_1.weight": (H,),
            block + "post_ffw_norm_2.weight": (H,),
        })
    return shapes


EXPERT_SHAPES_SOURCE = "the metadata (embedding_length, expert_count, expert_feed_forward_length)"


@dataclass(slots=True)
class ExpertWeights:
    """A mixture-of-experts layer's weights beside its dense FFN (26B-A4B); norm weights and scales are
    float32 vectors, the experts per-expert views of the file's 3-D tensors (`WeightStore.experts`)."""

    router: Any  # ffn_gate_inp [E, H]
    router_scale: np.ndarray  # ffn_gate_inp.scale [H] (transformers' router.scale)
    expert_scale: np.ndarray  # ffn_down_exps.scale [E] (transformers' router.per_expert_scale)
    gate_up: list[Any]  # per expert: [gate rows; up rows]
    down: list[Any]  # per expert: [H, F_e]
    pre_norm_2: np.ndarray  # pre_ffw_norm_2: the experts' input norm
    post_norm_1: np.ndarray  # post_ffw_norm_1: the dense FFN's output norm
    post_norm_2: np.ndarray  # post_ffw_norm_2: the experts' output norm


def load_experts(store: WeightStore, layer: int) -> ExpertWeights:
    block = f"blk.{layer}."
    fused = block + "ffn_gate_up_exps.weight"
    if store.has(fused):
        gate_up = store.experts(fused)
    else:
        gate, up = block + "ffn_gate_exps.weight", block + "ffn_up_exps.weight"
        if not (store.has(gate) and store.has(up)):
            raise GGUFError(f"{store.gguf.path}: tensor {fused!r} (or the pair {gate!r}, {up!r}) is missing; "
                            f"a Gemma 4 mixture-of-experts layer needs its experts' gate and up weights")
        gate_up = [store.stack(pair) for pair in zip(store.experts(gate), store.experts(up), strict=True)]
    return ExpertWeights(
        router=store.matrix(block + "ffn_gate_inp.weight"),
        router_scale=store.vector(block + "ffn_gate_inp.scale"),
        expert_scale=store.vector(block + "ffn_down_exps.scale"),
        gate_up=gate_up,
        down=store.experts(block + "ffn_down_exps.weight"),
        pre_norm_2=store.vector(block + "pre_ffw_norm_2.weight"),
        post_norm_1=store.vector(block + "post_ffw_norm_1.weight"),
        post_norm_2=store.vector(block + "post_ffw_norm_2.weight"),
    )


@dataclass(slots=True)
class LayerWeights:
    """Norm weights are float32 vectors; matrices are whatever `WeightStore` holds."""

    attn_norm: np.ndarray
    projection: Any  # [q; k; v] rows when the layer owns K/V (v only if attn_v exists); else q
    has_v: bool
    q_norm: np.ndarray
    k_norm: np.ndarray | None  # None on shared layers
    attn_output: Any
    post_attention_norm: np.ndarray
    ffn_norm: np.ndarray
    gate_up: Any  # [gate rows; up rows]
    ffn_down: Any
    post_ffw_norm: np.ndarray
    output_scale: float  # layer_output_scale; 1.0 when absent
    ple_gate: Any  # inp_gate (P, H); None without PLE
    ple_proj: Any  # proj (H, P); None without PLE
    ple_post_norm: np.ndarray | None
    experts: ExpertWeights | None = None  # None in a dense file


@dataclass(slots=True)
class Weights:
    token_embd: Any  # [V, H], rows read on demand
    ple_token_embd: Any  # per_layer_token_embd [V, L·P], rows read on demand
    output: Any  # the LM head: token_embd itself when tied
    output_norm: np.ndarray
    rope_freqs: np.ndarray | None  # factors of the full layers' rope
    ple_model_proj: Any  # per_layer_model_proj (L·P, H); None without PLE
    ple_proj_norm: np.ndarray | None
    layers: list[LayerWeights]


def load_weights(store: WeightStore, config: Gemma4Config) -> Weights:
    def fused(*names: str) -> Any:
        # one weight instead of two or three: fewer calls per layer in decode
        return store.stacked(names)

    ple = config.per_layer_input_dim > 0
    store.check_shapes(expert_tensor_shapes(config), EXPERT_SHAPES_SOURCE)
    layers = []
    for i in range(config.layer_count):
        block = f"blk.{i}."
        own = config.owns_kv(i)
        has_v = own and store.has(block + "attn_v.weight")
        names = [block + "attn_q.weight"]
        if own:
            names.append(block + "attn_k.weight")
            if has_v:
                names.append(block + "attn_v.weight")
        scale = block + "layer_output_scale.weight"
        layers.append(LayerWeights(
            attn_norm=store.vector(block + "attn_norm.weight"),
            projection=fused(*names),
            has_v=has_v,
            q_norm=store.vector(block + "attn_q_norm.weight"),
            k_norm=store.vector(block + "attn_k_norm.weight") if own else None,
            attn_output=store.matrix(block + "attn_output.weight"),
            post_attention_norm=store.vector(block + "post_attention_norm.weight"),
            ffn_norm=store.vector(block + "ffn_norm.weight"),
            gate_up=fused(block + "ffn_gate.weight", block + "ffn_up.weight"),
            ffn_down=store.matrix(block + "ffn_down.weight"),
            post_ffw_norm=store.vector(block + "post_ffw_norm.weight"),
            output_scale=float(store.vector(scale)[0]) if store.has(scale) else 1.0,
            ple_gate=store.matrix(block + "inp_gate.weight") if ple else None,
            ple_proj=store.matrix(block + "proj.weight") if ple else None,
            ple_post_norm=store.vector(block + "post_norm.weight") if ple else None,
            experts=load_experts(store, i) if config.expert_count else None,
        ))
    has_full = not all(config.sliding)
    if has_full and not store.has("rope_freqs.weight"):
        raise GGUFError(f"{store.gguf.path}: tensor 'rope_freqs.weight' is missing; Gemma 4's full-attention "
                        "layers need it for their partial rope")
    tied = config.tied_embeddings
    embedding = store.matrix("token_embd.weight") if tied else store.table("token_embd.weight")
    return Weights(
        token_embd=embedding,
        ple_token_embd=store.table("per_layer_token_embd.weight") if ple else None,
        output=embedding if tied else store.matrix("output.weight"),
        output_norm=store.vector("output_norm.weight"),
        rope_freqs=store.vector("rope_freqs.weight") if has_full else None,
        ple_model_proj=store.matrix("per_layer_model_proj.weight") if ple else None,
        ple_proj_norm=store.vector("per_layer_proj_norm.weight") if ple else None,
        layers=layers,
    )


# --------------------------------------------------------------------------- forward


def _inverse_frequencies(rope_dim: int, base: float, factors: np.ndarray | None) -> np.ndarray:
    """base^(−2i/rope_dim) / f_i as float32, formed as `ember.ops.rope_tables` forms it."""
    inverse = base ** (-np.arange(rope_dim // 2, dtype=np.float64) * 2.0 / rope_dim)
    if factors is not None:
        inverse = inverse / factors[: rope_dim // 2].astype(np.float64)
    return inverse.astype(np.float32)


class Workspace:
    """Activation buffers for an evaluation of `rows` tokens; decode keeps one for rows = 1.

    Buffers whose width changes per layer (projections, heads, FFN) are flat and handed out as
    contiguous [rows, width] views sized for the layer.
    """

    def __init__(self, config: Gemma4Config, rows: int, max_keys: int) -> None:
        c = config
        H, n_head, P, L = c.hidden_size, c.head_count, c.per_layer_input_dim, c.layer_count
        q_width = max(n_head * hd for hd in c.layer_head_dims)
        kv_width = max(n * hd for n, hd in zip(c.layer_kv_heads, c.layer_head_dims, strict=True))
        F = c.feed_forward_length
        half = max(c.rope_dim, c.rope_dim_swa) // 2
        self.rows = rows
        self.hidden = aligned_zeros((rows, H))
        self.normed = aligned_zeros((rows, H))
        self.row_scratch = aligned_zeros((rows, 1))
        self.projection = aligned_zeros(rows * (q_width + 2 * kv_width))
        self.values = aligned_zeros(rows * kv_width)  # V copied from the raw K when attn_v is absent
        self.head_scratch = aligned_zeros((rows, max(n_head, c.head_count_kv), 1))
        self.rope_a = aligned_zeros(rows * n_head * half)
        self.rope_b = aligned_zeros(self.rope_a.shape)
        self.positions = aligned_zeros((rows, 1))
        self.cos_full = aligned_zeros((rows, c.rope_dim // 2))
        self.sin_full = aligned_zeros(self.cos_full.shape)
        self.cos_swa = aligned_zeros((rows, c.rope_dim_swa // 2))
        self.sin_swa = aligned_zeros(self.cos_swa.shape)
        self.heads = aligned_zeros(rows * q_width)
        self.attention_output = aligned_zeros((rows, H))
        self.gate_up = aligned_zeros(rows * 2 * F)
        self.mlp_scratch = aligned_zeros(rows * F)
        self.mlp_output = aligned_zeros((rows, H))
        self.ple = aligned_zeros((rows, L, P))
        self.ple_identity = aligned_zeros((rows, L * P))
        self.ple_row_scratch = aligned_zeros((rows, L, 1))
        self.ple_gate = aligned_zeros((rows, P))
        self.ple_scratch = aligned_zeros((rows, P))
        self.ple_output = aligned_zeros((rows, H))
        if c.expert_count:  # the mixture-of-experts branch
            self.router_input = aligned_zeros((rows, H))
            self.router_logits = aligned_zeros((rows, c.expert_count))
            self.expert_mixture = aligned_zeros((rows, H))
            self.experts = ExpertScratch(rows * c.expert_used_count, H, c.expert_feed_forward_length)
        self.score_buffer = aligned_zeros(n_head * max_keys) if rows == 1 else None
        self.score_scratch = aligned_zeros(n_head) if rows == 1 else None
        self.final_normed = aligned_zeros((1, H))
        self.final_row_scratch = aligned_zeros((1, 1))
        self.logits = aligned_zeros((1, c.vocab_size))

    def head(self, rows: int) -> Workspace:
        return head_of(self, rows)

    def view(self, flat: np.ndarray, *shape: int) -> np.ndarray:
        """A contiguous view of the first prod(shape) values of a flat buffer."""
        return flat[: int(np.prod(shape))].reshape(shape)


class Gemma4Forward(Readouts):
    """The forward pass of one loaded Gemma 4 model."""

    def __init__(self, config: Gemma4Config, weights: Weights, store: WeightStore) -> None:
        self.config = config
        self.weights = weights
        self.store = store
        self.inverse_frequency_full = _inverse_frequencies(config.rope_dim, config.rope_base,
                                                           weights.rope_freqs)
        self.inverse_frequency_swa = _inverse_frequencies(config.rope_dim_swa, config.rope_base_swa, None)
        self.embedding_scale = np.float32(np.sqrt(config.hidden_size))
        P = config.per_layer_input_dim
        self.ple_token_scale = np.float32(np.sqrt(P)) if P else np.float32(0)
        self.ple_projection_scale = np.float32(1.0 / np.sqrt(config.hidden_size))
        self.ple_combine_scale = np.float32(1.0 / np.sqrt(2.0))
        self.router_root = np.float32(config.hidden_size ** -0.5)

    def new_cache(self, context_length: int) -> LayeredKVCache:
        return LayeredKVCache.build(context_length, cache_specs(self.config))

    def new_workspace(self, rows: int, max_keys: int) -> Workspace:
        return Workspace(self.config, rows, max_keys)

    # -- inputs ------------------------------------------------------------------------------

    def embed(self, token_ids: np.ndarray, out: np.ndarray) -> None:
        """out = E[t]·√H, decoding only the rows of these tokens."""
        gather_rows(self.weights.token_embd, token_ids, out)
        out *= self.embedding_scale

    def per_layer_inputs(self, token_ids: np.ndarray, embedded: np.ndarray, ws: Workspace) -> np.ndarray:
        """ple [T, L, P] (§3.5): the token-identity rows plus the normed projection of the embedding."""
        c, w = self.config, self.weights
        T, L, P = len(token_ids), c.layer_count, c.per_layer_input_dim
        ple = ws.ple[:T]
        context = ple.reshape(T, L * P)
        linear(embedded, w.ple_model_proj, context)
        context *= self.ple_projection_scale
        rms_norm(ple, w.ple_proj_norm, c.rms_norm_eps, ple, ws.ple_row_scratch[:T])
        identity = gather_rows(w.ple_token_embd, token_ids, ws.ple_identity[:T])
        identity *= self.ple_token_scale
        context += identity
        context *= self.ple_combine_scale
        return ple

    def rope(self, rows: Rows, T: int, ws: Workspace) -> None:
        """cos/sin of both layer kinds for the evaluated positions (formed per evaluation, no table)."""
        positions = ws.positions[:T]
        positions[:, 0] = rows.positions(T) / self.config.rope_linear_factor
        np.multiply(positions, self.inverse_frequency_full, out=ws.cos_full[:T])
        np.sin(ws.cos_full[:T], out=ws.sin_full[:T])
        np.cos(ws.cos_full[:T], out=ws.cos_full[:T])
        positions[:, 0] = rows.positions(T)
        np.multiply(positions, self.inverse_frequency_swa, out=ws.cos_swa[:T])
        np.sin(ws.cos_swa[:T], out=ws.sin_swa[:T])
        np.cos(ws.cos_swa[:T], out=ws.cos_swa[:T])

    # -- the pass ----------------------------------------------------------------------------

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

        ws, T = rows.ws, rows.count
        self.embed(rows.token_ids, ws.hidden)
        ple = self.per_layer_inputs(rows.token_ids, ws.hidden, ws) if c.per_layer_input_dim else None
        self.rope(rows, T, ws)
        for i, layer in enumerate(w.layers):
            h, ws = rows.enter(i)
            hooks.before_layer(i, h)
            x = self.norm(h, layer.attn_norm, ws)
            o = self.attention(i, layer, x, rows, ws, hooks, listened)
            a = self.post_norm(o, layer.post_attention_norm, ws)
            hooks.after_attention(i, a)
            h += a
            y = self.norm(h, layer.ffn_norm, ws)
            m = self.mlp(i, layer, y, ws)
            if layer.experts is not None:  # the experts beside the dense FFN, both read h
                m = self.post_norm(m, layer.experts.post_norm_1, ws)
                m += self.mixture_of_experts(i, layer.experts, h, ws, hooks, listened)
            m = self.post_norm(m, layer.post_ffw_norm, ws)
            hooks.after_mlp(i, m)
            h += m
            if ple is not None:
                h += self.post_norm(self.per_layer_embedding(i, layer, h, ple, ws), layer.ple_post_norm, ws)
            if layer.output_scale != 1.0:
                h *= np.float32(layer.output_scale)
            hooks.after_layer(i, h)

        rows.finish()
        return final_norm_and_logits(h, w.output_norm, c.rms_norm_eps, rows, hooks, self.lm_head,
                                     c.vocab_size, all_logits)

    # -- the steps of a layer ----------------------------------------------------------------

    def norm(self, h: np.ndarray, weight: np.ndarray, ws: Workspace) -> np.ndarray:
        """RMSNorm(h, weight) into ws.normed."""
        return rms_norm(h, weight, self.config.rms_norm_eps, ws.normed, ws.row_scratch)

    def post_norm(self, o: np.ndarray, weight: np.ndarray, ws: Workspace) -> np.ndarray:
        """RMSNorm(o, weight) in place (after attention, MLP and the PLE term)."""
        return rms_norm(o, weight, self.config.rms_norm_eps, o, ws.row_scratch)

    def attention(self, i: int, layer: LayerWeights, x: np.ndarray, rows: Rows, ws: Workspace,
                  hooks: Any, listened: frozenset[str]) -> np.ndarray:
        """o = attention(q, k, v) Woᵀ with layer i's geometry and rope: q = rope(RMSNorm(x Wqᵀ)) per head;
        a layer that owns K/V forms k = rope(RMSNorm(x Wkᵀ)), v = RMSNorm(x Wvᵀ or the raw k) (stored, and
        kept for the layers sharing them); a shared layer reads its source's. Each row attends over its
        own sequence's keys. Returns ws.attention_output."""
        c = self.config
        T, n_head, eps = len(x), c.head_count, c.rms_norm_eps
        sliding = c.sliding[i]
        hd, n_kv = c.layer_head_dims[i], c.layer_kv_heads[i]
        q_width, kv_width = n_head * hd, n_kv * hd
        if sliding:
            rope_dim, cos, sin = c.rope_dim_swa, ws.cos_swa[:T], ws.sin_swa[:T]
        else:
            rope_dim, cos, sin = c.rope_dim, ws.cos_full[:T], ws.sin_full[:T]
        rope_scratch = [ws.view(buffer, T, n_head, rope_dim // 2) for buffer in (ws.rope_a, ws.rope_b)]

        projected = linear(x, layer.projection, ws.view(ws.projection, T, layer.projection.shape[0]))
        q = projected[:, :q_width].reshape(T, n_head, hd)
        rms_norm(q, layer.q_norm, eps, q, ws.head_scratch[:T, :n_head])
        apply_rope(q, cos, sin, RopeLayout.NEOX, rope_dim, *rope_scratch)
        heads = ws.view(ws.heads, T, q_width)
        window = c.sliding_window if sliding else 0
        pattern = None
        if listened and "attention_pattern" in listened:
            pattern = partial(hooks.attention_pattern, i)
        if c.owns_kv(i):
            k = projected[:, q_width:q_width + kv_width].reshape(T, n_kv, hd)
            if layer.has_v:
                v = projected[:, q_width + kv_width:].reshape(T, n_kv, hd)
            else:  # attention_k_eq_v: V is the raw K projection, taken before k_norm
                v = ws.view(ws.values, T, n_kv, hd)
                v[...] = k
            rms_norm(k, layer.k_norm, eps, k, ws.head_scratch[:T, :n_kv])
            rms_norm(v, None, eps, v, ws.head_scratch[:T, :n_kv])
            apply_rope(k, cos, sin, RopeLayout.NEOX, rope_dim, *(s[:, :n_kv] for s in rope_scratch))
            if listened:
                show_inputs(hooks, i, listened, q, k, v)
            rows.attend(i, q, k, v, scale=1.0, window=window, out=heads, ws=ws, keep=True, pattern=pattern)
        else:  # the source layer's keys and values, as this layer reads them (writes reach this layer only)
            inputs = None
            if listened:
                show_inputs(hooks, i, listened, q, None, None)
                if "attention_keys" in listened or "attention_values" in listened:
                    inputs = partial(show_inputs, hooks, i, listened, None)
            rows.attend_shared(i, c.kv_source[i], q, scale=1.0, window=window, out=heads, ws=ws,
                               pattern=pattern, inputs=inputs)
        hooks.attention_heads(i, heads)
        return linear(heads, layer.attn_output, ws.attention_output)

    def mlp(self, i: int, layer: LayerWeights, y: np.ndarray, ws: Workspace) -> np.ndarray:
        """(gelu_tanh(y Wgᵀ) ⊙ y Wuᵀ) Wdᵀ with layer i's FFN width. Returns ws.mlp_output."""
        T, F = len(y), self.config.layer_ffn_lengths[i]
        gate_up = linear(y, layer.gate_up, ws.view(ws.gate_up, T, 2 * F))
        gate, up = gate_up[:, :F], gate_up[:, F:]
        gelu_tanh_inplace(gate, ws.view(ws.mlp_scratch, T, F))
        gate *= up
        return linear(gate, layer.ffn_down, ws.mlp_output)

    def mixture_of_experts(self, i: int, moe: ExpertWeights, h: np.ndarray, ws: Workspace, hooks: Any,
                           listened: frozenset[str]) -> np.ndarray:
        """RMSNorm(Σⱼ wⱼ · expert cⱼ(RMSNorm(h, pre_ffw_norm_2)), post_ffw_norm_2), each expert GeGLU, for
        the experts c the router chooses from its own input. Returns ws.expert_mixture.

            r = (RMSNorm(h) ⊙ router_scale) / √H         (the weightless norm)
            logits = r W_gate_inpᵀ                        → router (writable)
            c, p = top-k of softmax(logits), renormalised (`ember.families.experts.route`)
            wⱼ = pⱼ · expert_scale[cⱼ]
        """
        c = self.config
        r = rms_norm(h, None, c.rms_norm_eps, ws.router_input, ws.row_scratch)
        r *= moe.router_scale
        r *= self.router_root
        logits = linear(r, moe.router, ws.router_logits)
        if "router" in listened:
            hooks.router(i, logits)
        chosen, weights = route(logits, c.expert_used_count)
        weights *= moe.expert_scale[chosen]
        y = self.norm(h, moe.pre_norm_2, ws)
        out = mixture(y, chosen, weights, moe.gate_up, moe.down, ws.experts, ws.expert_mixture,
                      activation=gelu_tanh_inplace)
        return self.post_norm(out, moe.post_norm_2, ws)

    def per_layer_embedding(self, i: int, layer: LayerWeights, h: np.ndarray, ple: np.ndarray,
                            ws: Workspace) -> np.ndarray:
        """(gelu_tanh(h Wgateᵀ) ⊙ ple[:, i]) Wprojᵀ, before its post norm. Returns ws.ple_output."""
        T = len(h)
        g = linear(h, layer.ple_gate, ws.ple_gate[:T])
        gelu_tanh_inplace(g, ws.ple_scratch[:T])
        g *= ple[:T, i, :]
        return linear(g, layer.ple_proj, ws.ple_output)

    def lm_head(self, z: np.ndarray, out: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
        """logits = c·tanh((z Eᵀ)/c): the (normally tied) LM head, then the final softcap; with `columns`
        those vocabulary entries' alone."""
        linear_at(z, self.weights.output, out, columns)
        cap = self.config.final_logit_softcap
        if cap:
            out *= np.float32(1.0 / cap)
            np.tanh(out, out=out)
            out *= np.float32(cap)
        return out

    def carried(self, layer: int) -> float:
        """The factor a vector added to the residual in layer `layer` (its attention, MLP or PLE output) is
        multiplied by before the final norm: the product of the layer output scales from `layer` on
        (readout; `layer` = layer_count gives 1)."""
        return float(np.prod([np.float64(np.float32(w.output_scale)) for w in self.weights.layers[layer:]]))


def build_forward(config: Gemma4Config, store: WeightStore, context_length: int) -> Gemma4Forward:
    del context_length  # rope is formed per evaluation; the cache is sized by the caller
    return Gemma4Forward(config, load_weights(store, config), store)
