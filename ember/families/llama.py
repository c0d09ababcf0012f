"""The llama block and its variants (GGUF architectures `llama`, `qwen3`, `qwen2`, `granite`, `smollm3`,
`mistral3`), docs/families.md §1–§2, §7, §9, §10, §13.

One block serves them all; each difference is one named option of `LlamaConfig` or an optional tensor,
visible where it acts below:
* rope layout: `llama`, `granite`, `smollm3` keep the converter's permuted Q/K rows and rotate adjacent
  pairs (NORM); `qwen2`, `qwen3` rotate split halves (NEOX);
* `qwen3` normalises each Q/K head (QK-norm, `has_qk_norm`);
* q/k/v biases where the file has them (`qwen2`; llama.cpp reads them for every architecture here);
* `rope_layers`: which layers rotate Q/K at all (`smollm3`: not every 4th; `granite` with
  `rope.scaling.finetuned` false: none);
* granite's four multipliers: embedding, residual (on both branches), attention scale, logit scale
  (1 and 1/√head_dim elsewhere);
* rope scaling from the file (linear or YaRN: `ember.ops.rope_tables`; Ministral 3 has YaRN);
* `mistral3`'s attention temperature: q times 1 + β·ln(1 + ⌊p / L⌋) at position p (β
  `attention.temperature_scale`, L the YaRN original context; 1 where β = 0 and everywhere else).

Input rows: h = E[token] · embedding_scale. Per layer l, on rows h [T, H]:
    x = RMSNorm(h, attn_norm)
    q, k, v = x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv   (biases: qwen2 only)
    q, k = RMSNorm per head (attn_q_norm, attn_k_norm)   (qwen3 only)
    q, k = rope(q), rope(k)                        (on layers with rope_layers[l])
    q = q · temperature(p)                         (mistral3 only)
    a = attention(q, k, v; scale) Woᵀ · residual_scale   → after_attention (before the residual add)
    h = h + a
    m = (silu(y Wgᵀ) ⊙ y Wuᵀ) Wdᵀ · residual_scale,  y = RMSNorm(h, ffn_norm)   → after_mlp (before the add)
    h = h + m                                      → after_layer
z = RMSNorm(h[last], output_norm)                  → before_logits
logits = z Woutᵀ / logit_scale (Eᵀ when tied)      → after_logits
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ember import stages
from ember.config import (
    ROPE_SCALING_TYPES,
    MetadataReader,
    ModelConfig,
    RopeLayout,
    RopeScaling,
    read_rope_scaling,
)
from ember.errors import GGUFError
from ember.families.head import Readouts, final_norm_and_logits
from ember.families.inside import checkpoint_order, show_inputs
from ember.families.workspace import Workspace
from ember.gguf_file import GGUFFile
from ember.kv_cache import KVCache
from ember.ops import apply_rope, gather_rows, linear, linear_at, rms_norm, rope_tables, silu_inplace
from ember.phases import ExecutionPhase, ModelFamily
from ember.rows import Rows, SequenceRows
from ember.weights import WeightStore

# qwen3moe's attention is Qwen3's: its config starts as theirs (ember.families.qwen3moe); olmo2 takes
# this config with its own block (olmo2.py)
FAMILY_OF_ARCHITECTURE = {"llama": ModelFamily.LLAMA, "qwen3": ModelFamily.QWEN3, "qwen2": ModelFamily.QWEN2,
                          "granite": ModelFamily.GRANITE, "smollm3": ModelFamily.SMOLLM3,
                          "olmo2": ModelFamily.OLMO2, "qwen3moe": ModelFamily.QWEN3MOE,
                          "phi3": ModelFamily.PHI3, "mistral3": ModelFamily.MISTRAL3}
QK_NORM = ("qwen3", "qwen3moe", "olmo2")  # olmo2's spans all heads at once (olmo2.py)
# llama.cpp's LLAMA_ROPE_TYPE_NORM: the converter permutes Q/K
NORM_ROPE = ("llama", "granite", "smollm3", "mistral3")
PARTIAL_ROPE = ("qwen3", "phi3")  # may rotate fewer dims than head_dim (phi3: ember.families.phi3 checks it)
NO_ROPE_LAYER_STEP = 4  # smollm3: llama.cpp hard-codes `n_no_rope_layer_step = 4` (no metadata key)


@dataclass(frozen=True, slots=True)
class LlamaConfig(ModelConfig):
    """The block's options (docstring above); their defaults are plain llama's."""

    rope_scaling: RopeScaling  # the file's rope scaling (linear or YaRN): `ember.ops.rope_tables`
    rope_layers: tuple[bool, ...]  # per layer: whether Q/K are rotated
    attention_scale: float  # multiplies q·k: 1/√head_dim, or granite's `attention.scale`
    embedding_scale: float  # multiplies the input embeddings (granite; 1.0)
    residual_scale: float  # multiplies the attention and MLP outputs before each residual add (granite; 1.0)
    logit_scale: float  # the logits are divided by it (granite; 1.0)
    temperature_scale: float  # β of mistral3's attention temperature (0: none)
    temperature_length: int  # L: positions per temperature step (the YaRN original context)


def granite_scale(meta: MetadataReader, key: str) -> float:
    """An optional granite multiplier; llama.cpp reads absent and 0 alike as "no multiplier" (0.0)."""
    value = meta.float(key, 0.0)
    if not np.isfinite(value) or value < 0:
        raise GGUFError(f"{meta.gguf.path}: metadata '{meta.arch}.{key}' is {value}; it must be a positive "
                        "number (or 0 / absent: none)")
    return value


def rope_layers(meta: MetadataReader, layer_count: int) -> tuple[bool, ...]:
    """Which layers rotate Q/K, as llama.cpp decides: smollm3 skips every 4th layer (l + 1 ≡ 0 mod 4,
    fixed in llama.cpp's code, whatever transformers' `no_rope_layers` said); granite rotates in every
    layer unless `rope.scaling.finetuned` is false (then in none); the others in every layer."""
    if meta.arch == "smollm3":
        return tuple((layer + 1) % NO_ROPE_LAYER_STEP != 0 for layer in range(layer_count))
    if meta.arch == "granite":
        finetuned = meta.raw("rope.scaling.finetuned", True)
        if not isinstance(finetuned, (bool, np.bool_)):
            raise GGUFError(f"{meta.gguf.path}: metadata 'granite.rope.scaling.finetuned' is "
                            f"{finetuned!r:.80}, not a boolean")
        return (bool(finetuned),) * layer_count
    return (True,) * layer_count


def attention_temperature(meta: MetadataReader, scaling: RopeScaling) -> tuple[float, int]:
    """mistral3's (β, L), as llama.cpp reads them: β = `attention.temperature_scale` (absent: 0, none),
    L = the YaRN original context (`rope.scaling.original_context_length`, else the training context;
    llama.cpp has no key of its own for it)."""
    if meta.arch != "mistral3":
        return 0.0, 1
    beta = meta.float("attention.temperature_scale", 0.0)
    if not np.isfinite(beta):
        raise GGUFError(f"{meta.gguf.path}: metadata 'mistral3.attention.temperature_scale' is {beta}, not a "
                        "finite number")
    return beta, scaling.original_context_length


def build_config(gguf: GGUFFile) -> LlamaConfig:
    meta = MetadataReader(gguf)
    architecture = gguf.architecture
    hidden_size = meta.size("embedding_length")
    layer_count = meta.layer_count()
    head_count = meta.size("attention.head_count")
    head_dim = meta.int("attention.key_length", hidden_size // head_count)
    value_dim = meta.int("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"{gguf.path}: key_length {head_dim} != value_length {value_dim} is not supported")
    rope_dim = meta.int("rope.dimension_count", head_dim)
    if architecture not in PARTIAL_ROPE and rope_dim != head_dim:  # llama.cpp asserts it for these graphs
        raise GGUFError(
            f"{gguf.path}: {architecture}.rope.dimension_count {rope_dim} must equal the head dim {head_dim}"
        )
    context_length = meta.int("context_length")
    # linear or YaRN, which llama.cpp applies in any of these graphs; phi3 makes its own LongRoPE tables
    kinds = (*ROPE_SCALING_TYPES, "longrope") if architecture == "phi3" else ROPE_SCALING_TYPES
    scaling = read_rope_scaling(meta, context_length, kinds=kinds)
    attention_scale = embedding_scale = residual_scale = logit_scale = 0.0
    if architecture == "granite":
        attention_scale = granite_scale(meta, "attention.scale")
        embedding_scale = granite_scale(meta, "embedding_scale")
        residual_scale = granite_scale(meta, "residual_scale")
        logit_scale = meta.float("logit_scale")  # required by llama.cpp
        if not np.isfinite(logit_scale) or logit_scale <= 0:
            raise GGUFError(f"{gguf.path}: metadata 'granite.logit_scale' is {logit_scale}; the logits are "
                            "divided by it, so it must be a positive number")
    temperature_scale, temperature_length = attention_temperature(meta, scaling)
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    vocab_size = meta.int("vocab_size", len(tokens) if tokens is not None else None)
    return LlamaConfig(
        architecture=architecture,
        family=FAMILY_OF_ARCHITECTURE[architecture],
        name=str(gguf.metadata.get("general.name", gguf.path.stem)),
        layer_count=layer_count,
        hidden_size=hidden_size,
        head_count=head_count,
        head_count_kv=meta.int("attention.head_count_kv", head_count),
        head_dim=head_dim,
        # a mixture of experts (qwen3moe) has no dense FFN, and its file may not say one's width
        feed_forward_length=meta.int("feed_forward_length", 0 if architecture == "qwen3moe" else None),
        vocab_size=vocab_size,
        context_length=context_length,
        rms_norm_eps=meta.float("attention.layer_norm_rms_epsilon"),
        rope_base=meta.float("rope.freq_base", 10000.0),
        rope_dim=rope_dim,
        rope_layout=RopeLayout.NORM if architecture in NORM_ROPE else RopeLayout.NEOX,
        rope_linear_factor=1.0 / scaling.frequency_scale,
        has_qk_norm=architecture in QK_NORM,
        tied_embeddings="output.weight" not in gguf.tensors,
        rope_scaling=scaling,
        rope_layers=rope_layers(meta, layer_count),
        attention_scale=attention_scale or 1.0 / float(np.sqrt(head_dim)),
        embedding_scale=embedding_scale or 1.0,
        residual_scale=residual_scale or 1.0,
        logit_scale=logit_scale or 1.0,
        temperature_scale=temperature_scale,
        temperature_length=temperature_length,
    )


def cache_specs(config: ModelConfig) -> list[tuple[int, int, int]]:
    """(kv heads, head dim, window) of every layer's KV cache: all full attention."""
    return [(config.head_count_kv, config.head_dim, 0)] * config.layer_count


@dataclass(slots=True)
class LayerWeights:
    """Norm weights are float32 vectors; matrices are whatever `WeightStore` holds (quantized blocks
    or float32), multiplied by `ember.ops.linear`."""

    attn_norm: np.ndarray
    qkv: Any  # [q rows; k rows; v rows] stacked into one (out, H) weight
    qkv_bias: np.ndarray | None  # [bq; bk; bv] where the file has them (qwen2)
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    attn_output: Any
    ffn_norm: np.ndarray
    gate_up: Any  # [gate rows; up rows] stacked
    ffn_down: Any


@dataclass(slots=True)
class Weights:
    token_embd: Any  # rows read on demand (`gather_rows`); also the LM head when tied
    output_norm: np.ndarray
    output: Any
    layers: list[LayerWeights]


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a llama-style block uses, from the config (NumPy order: (out, in))."""
    H, D, F = config.hidden_size, config.head_dim, config.feed_forward_length
    q, kv = config.head_count * D, config.head_count_kv * D
    shapes = {"token_embd.weight": (config.vocab_size, H), "output.weight": (config.vocab_size, H),
              "output_norm.weight": (H,), "rope_freqs.weight": (config.rope_dim // 2,)}
    for i in range(config.layer_count):
        block = f"blk.{i}."
        shapes.update({
            block + "attn_norm.weight": (H,), block + "ffn_norm.weight": (H,),
            block + "attn_q.weight": (q, H), block + "attn_k.weight": (kv, H),
            block + "attn_v.weight": (kv, H), block + "attn_output.weight": (H, q),
            block + "attn_q_norm.weight": (D,), block + "attn_k_norm.weight": (D,),
            block + "ffn_gate.weight": (F, H), block + "ffn_up.weight": (F, H),
            block + "ffn_down.weight": (H, F),
        })
    return shapes


SHAPES_SOURCE = "the metadata (embedding_length, head counts, key_length, feed_forward_length, vocabulary)"
QKV = ("attn_q", "attn_k", "attn_v")
UNUSED_BIASES = ("attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")  # optional in llama.cpp


def qkv_bias(store: WeightStore, block: str) -> np.ndarray | None:
    """[bq; bk; bv] of one block, or None when the file has no Q/K/V biases; all three or none."""
    names = [f"{block}{part}.bias" for part in QKV]
    present = [store.has(name) for name in names]
    if not any(present):
        return None
    if not all(present):
        missing = names[present.index(False)]
        raise GGUFError(f"{store.gguf.path}: tensor {missing!r} is missing (the block has the other Q/K/V "
                        "biases)")
    return np.concatenate([store.vector(name) for name in names])


def refuse_unused_biases(store: WeightStore, config: ModelConfig) -> None:
    """Biases llama.cpp would add but this block does not have: one line rather than a wrong model."""
    for i in range(config.layer_count):
        for suffix in UNUSED_BIASES:
            if store.has(f"blk.{i}.{suffix}"):
                raise GGUFError(f"{store.gguf.path}: tensor 'blk.{i}.{suffix}' is a bias ember's "
                                f"{config.architecture} block does not implement")


def load_weights(store: WeightStore, config: ModelConfig) -> Weights:
    shapes = tensor_shapes(config)
    for i in range(config.layer_count):
        q, kv = config.head_count * config.head_dim, config.head_count_kv * config.head_dim
        shapes.update({f"blk.{i}.attn_q.bias": (q,), f"blk.{i}.attn_k.bias": (kv,),
                       f"blk.{i}.attn_v.bias": (kv,)})
    store.check_shapes(shapes, SHAPES_SOURCE)
    refuse_unused_biases(store, config)

    def fused(*names: str) -> Any:
        # One weight instead of three (two): one call per layer in decode instead of three (two).
        return store.stacked(names)

    layers = []
    for i in range(config.layer_count):
        block = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=store.vector(block + "attn_norm.weight"),
            qkv=fused(block + "attn_q.weight", block + "attn_k.weight", block + "attn_v.weight"),
            qkv_bias=qkv_bias(store, block),
            q_norm=store.vector(block + "attn_q_norm.weight") if config.has_qk_norm else None,
            k_norm=store.vector(block + "attn_k_norm.weight") if config.has_qk_norm else None,
            attn_output=store.matrix(block + "attn_output.weight"),
            ffn_norm=store.vector(block + "ffn_norm.weight"),
            gate_up=fused(block + "ffn_gate.weight", block + "ffn_up.weight"),
            ffn_down=store.matrix(block + "ffn_down.weight"),
        ))
    if config.tied_embeddings:
        embedding = store.matrix("token_embd.weight")
    else:
        embedding = store.table("token_embd.weight")
    return Weights(
        token_embd=embedding,
        output_norm=store.vector("output_norm.weight"),
        output=embedding if config.tied_embeddings else store.matrix("output.weight"),
        layers=layers,
    )


class LlamaForward(Readouts):
    """The forward pass of one loaded model of the llama block (llama, qwen3, qwen2, granite, smollm3)."""

    def __init__(self, config: LlamaConfig, weights: Weights, store: WeightStore,
                 context_length: int) -> None:
        self.config = config
        self.weights = weights
        self.store = store
        factors = store.vector("rope_freqs.weight") if store.has("rope_freqs.weight") else None
        self.rope_cos, self.rope_sin = rope_tables(
            config.rope_dim, config.rope_base, context_length,
            scaling=config.rope_scaling, frequency_factors=factors,
        )
        self.scale = config.attention_scale
        # mistral3: the query multiplier 1 + β·ln(1 + ⌊p / L⌋) per position p, [context, 1] (None: off)
        self.temperature = None
        if config.temperature_scale != 0.0:
            steps = np.floor(np.arange(context_length, dtype=np.float64) / config.temperature_length)
            self.temperature = (1.0 + config.temperature_scale * np.log1p(steps)).astype(np.float32)[:, None]
        # llama's Q/K rows are permuted for its rope layout: the stages show them in the checkpoint's order
        norm_rope = config.rope_layout is RopeLayout.NORM
        self.checkpoint_order = checkpoint_order(config.head_dim) if norm_rope else None

    def new_cache(self, context_length: int) -> KVCache:
        c = self.config
        return KVCache.full(c.layer_count, c.head_count_kv, context_length, c.head_dim)

    def new_workspace(self, rows: int, max_keys: int) -> Workspace:
        return Workspace(self.config, rows, max_keys)

    def embed(self, token_ids: np.ndarray, out: np.ndarray) -> None:
        """out = E[t] · embedding_scale (granite's multiplier; 1 elsewhere)."""
        gather_rows(self.weights.token_embd, token_ids, out)
        if self.config.embedding_scale != 1.0:
            out *= np.float32(self.config.embedding_scale)

    def forward(self, token_ids: np.ndarray, start_position: int, cache: KVCache, ws: Workspace,
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
            a = self.residual(self.attention(i, layer, x, rows, ws, hooks, listened))
            hooks.after_attention(i, a)
            h += a
            y = self.norm(h, layer.ffn_norm, ws)
            m = self.residual(self.mlp(layer, y, ws))
            hooks.after_mlp(i, m)
            h += m
            hooks.after_layer(i, h)

        rows.finish()
        return final_norm_and_logits(h, w.output_norm, c.rms_norm_eps, rows, hooks, self.lm_head,
                                     c.vocab_size, all_logits)

    def norm(self, h: np.ndarray, weight: np.ndarray, ws: Workspace) -> np.ndarray:
        """RMSNorm(h, weight) into ws.normed."""
        return rms_norm(h, weight, self.config.rms_norm_eps, ws.normed, ws.row_scratch)

    def residual(self, out: np.ndarray) -> np.ndarray:
        """A branch's contribution to the residual: out · residual_scale, in place (granite; 1 elsewhere)."""
        if self.config.residual_scale != 1.0:
            out *= np.float32(self.config.residual_scale)
        return out

    def attention(self, i: int, layer: LayerWeights, x: np.ndarray, rows: Rows, ws: Workspace,
                  hooks: Any, listened: frozenset[str]) -> np.ndarray:
        """a = attention(rope(q), rope(k), v) Woᵀ with q, k, v = x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv
        (biases where the file has them; qwen3: q, k RMSNorm-ed per head before rope; rope only on layers
        with rope_layers[i]; mistral3: q times its temperature after rope); each row attends over its own
        sequence's keys (k, v go to layer i's cache).
        Returns ws.attention_output."""
        c = self.config
        T, hd, n_head, n_kv = len(x), c.head_dim, c.head_count, c.head_count_kv
        q_width, kv_width = n_head * hd, n_kv * hd
        linear(x, layer.qkv, ws.qkv)
        if layer.qkv_bias is not None:
            ws.qkv += layer.qkv_bias
        q = ws.qkv[:, :q_width].reshape(T, n_head, hd)
        k = ws.qkv[:, q_width:q_width + kv_width].reshape(T, n_kv, hd)
        v = ws.qkv[:, q_width + kv_width:].reshape(T, n_kv, hd)
        if c.has_qk_norm:
            k_spread = ws.head_spread[:, :n_kv] if ws.head_spread is not None else None
            rms_norm(q, layer.q_norm, c.rms_norm_eps, q, ws.head_scratch, ws.head_spread)
            rms_norm(k, layer.k_norm, c.rms_norm_eps, k, ws.head_scratch[:, :n_kv], k_spread)
        if c.rope_layers[i]:
            cos, sin = rows.take(self.rope_cos, T), rows.take(self.rope_sin, T)
            k_scratch = ws.rope_scratch[:, :, :n_kv] if ws.rope_scratch is not None else None
            apply_rope(q, cos, sin, c.rope_layout, c.rope_dim, ws.rope_a, ws.rope_b, ws.rope_scratch)
            apply_rope(k, cos, sin, c.rope_layout, c.rope_dim, ws.rope_a[:, :n_kv], ws.rope_b[:, :n_kv],
                       k_scratch)
        if self.temperature is not None:  # mistral3: the queries' temperature by position
            q *= rows.take(self.temperature, T)[:, :, None]
        pattern = None
        if listened:
            show_inputs(hooks, i, listened, q, k, v, self.checkpoint_order)
            if "attention_pattern" in listened:
                pattern = partial(hooks.attention_pattern, i)
        rows.attend(i, q, k, v, scale=self.scale, window=0, out=ws.attention_heads, ws=ws, pattern=pattern)
        hooks.attention_heads(i, ws.attention_heads)
        return linear(ws.attention_heads, layer.attn_output, ws.attention_output)

    def mlp(self, layer: LayerWeights, y: np.ndarray, ws: Workspace) -> np.ndarray:
        """m = (silu(y Wgᵀ) ⊙ y Wuᵀ) Wdᵀ. Returns ws.mlp_output."""
        F = self.config.feed_forward_length
        linear(y, layer.gate_up, ws.gate_up)
        gate, up = ws.gate_up[:, :F], ws.gate_up[:, F:]
        silu_inplace(gate, ws.mlp_scratch)
        gate *= up
        return linear(gate, layer.ffn_down, ws.mlp_output)

    def lm_head(self, z: np.ndarray, out: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
        """logits = z Woutᵀ (or z Eᵀ when tied), divided by logit_scale (granite; 1 elsewhere); with
        `columns` those vocabulary entries' alone."""
        linear_at(z, self.weights.output, out, columns)
        if self.config.logit_scale != 1.0:
            out /= np.float32(self.config.logit_scale)
        return out

    def head_contributions(self, layer: int, heads: np.ndarray) -> np.ndarray:
        """`Readouts.head_contributions`, times granite's residual multiplier (inside after_attention)."""
        parts = super().head_contributions(layer, heads)
        parts *= np.float32(self.config.residual_scale)
        return parts

    def logit_difference(self, vectors: np.ndarray, answer: int, foil: int, scale: float | np.ndarray
                         ) -> np.ndarray:
        """`Readouts.logit_difference`, divided by granite's logit scale as the logits are."""
        return super().logit_difference(vectors, answer, foil, scale) / self.config.logit_scale
