"""Qwen3 mixture of experts (GGUF architecture `qwen3moe`: Qwen3-30B-A3B, 235B-A22B),
docs/families.md §2.5.

Attention is Qwen3's (QK-norm, NEOX rope: `LlamaForward.attention`); every layer's MLP is a mixture of
`expert_count` SwiGLU experts of which each token takes `expert_used_count` (`ember.families.experts`).

Per layer l, on rows h [T, H]:
    x = RMSNorm(h, attn_norm)
    a = attention(x) (as qwen3)                 → after_attention (before the residual add)
    h = h + a
    y = RMSNorm(h, ffn_norm)
    r = y W_gate_inpᵀ                           → router [T, experts] (writable: the choice is made from it)
    chosen, w = top-k of softmax(r), renormalised
    m = Σⱼ wⱼ · (silu(y W_gate[cⱼ]ᵀ) ⊙ y W_up[cⱼ]ᵀ) W_down[cⱼ]ᵀ   → after_mlp (before the residual add)
    h = h + m                                   → after_layer
z = RMSNorm(h[last], output_norm)                → before_logits
logits = z Woutᵀ (or z Eᵀ when tied)             → after_logits

The top-k probabilities are always renormalised: llama.cpp's qwen3moe graph hard-codes it (its converter
writes no `expert_weights_norm` for this architecture, and the released models set transformers'
`norm_topk_prob`), so that is what a qwen3moe GGUF means.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ember import stages
from ember.buffers import aligned_zeros
from ember.config import MetadataReader
from ember.errors import GGUFError
from ember.families import llama
from ember.families.experts import ExpertScratch, mixture, route
from ember.families.head import final_norm_and_logits
from ember.families.workspace import Workspace
from ember.gguf_file import GGUFFile
from ember.ops import linear
from ember.phases import ExecutionPhase
from ember.rows import Rows
from ember.weights import WeightStore

cache_specs = llama.cache_specs  # every layer full attention


@dataclass(frozen=True, slots=True)
class Qwen3MoeConfig(llama.LlamaConfig):
    """`feed_forward_length` is one expert's width (`expert_feed_forward_length`)."""

    expert_count: int
    expert_used_count: int


def build_config(gguf: GGUFFile) -> Qwen3MoeConfig:
    attention = llama.build_config(gguf)
    meta = MetadataReader(gguf)
    key = f"{gguf.architecture}."
    experts = meta.size("expert_count")
    used = meta.size("expert_used_count")
    if used > experts:
        raise GGUFError(f"{gguf.path}: metadata '{key}expert_used_count' is {used}, more than "
                        f"'{key}expert_count' ({experts})")
    if meta.has("expert_feed_forward_length"):
        width = meta.size("expert_feed_forward_length")
    else:  # llama.cpp's fallback: the dense width shared among the chosen experts
        width = attention.feed_forward_length // used
        if width < 1:
            raise GGUFError(f"{gguf.path}: metadata '{key}expert_feed_forward_length' is missing (and "
                            f"'{key}feed_forward_length' does not give it)")
    values = {f.name: getattr(attention, f.name) for f in fields(llama.LlamaConfig)}
    values["feed_forward_length"] = width
    return Qwen3MoeConfig(**values, expert_count=experts, expert_used_count=used)


def tensor_shapes(config: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """llama's shapes with the dense FFN replaced by the router and the experts (NumPy order)."""
    H, F, E = config.hidden_size, config.feed_forward_length, config.expert_count
    shapes = {name: shape for name, shape in llama.tensor_shapes(config).items()
              if not name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))}
    for i in range(config.layer_count):
        block = f"blk.{i}."
        shapes.update({
            block + "ffn_gate_inp.weight": (E, H),
            block + "ffn_gate_exps.weight": (E, F, H), block + "ffn_up_exps.weight": (E, F, H),
            block + "ffn_down_exps.weight": (E, H, F),
        })
    return shapes


SHAPES_SOURCE = ("the metadata (embedding_length, head counts, key_length, expert_count, "
                 "expert_feed_forward_length, vocabulary)")


@dataclass(slots=True)
class LayerWeights:
    """llama's attention weights (`LlamaForward.attention` reads them by name), then the mixture."""

    attn_norm: np.ndarray
    qkv: Any
    qkv_bias: None  # qwen3moe has no Q/K/V biases (llama.cpp reads none for it)
    q_norm: np.ndarray
    k_norm: np.ndarray
    attn_output: Any
    ffn_norm: np.ndarray
    router: Any  # [experts, H]
    expert_gate_up: list[Any]  # per expert: [gate rows; up rows] stacked, views of the file's blocks
    expert_down: list[Any]  # per expert: [H, F]


def load_weights(store: WeightStore, config: Qwen3MoeConfig) -> llama.Weights:
    store.check_shapes(tensor_shapes(config), SHAPES_SOURCE)
    layers = []
    for i in range(config.layer_count):
        block = f"blk.{i}."
        gates = store.experts(block + "ffn_gate_exps.weight")
        ups = store.experts(block + "ffn_up_exps.weight")
        layers.append(LayerWeights(
            attn_norm=store.vector(block + "attn_norm.weight"),
            qkv=store.stacked([block + "attn_q.weight", block + "attn_k.weight", block + "attn_v.weight"]),
            qkv_bias=None,
            q_norm=store.vector(block + "attn_q_norm.weight"),
            k_norm=store.vector(block + "attn_k_norm.weight"),
            attn_output=store.matrix(block + "attn_output.weight"),
            ffn_norm=store.vector(block + "ffn_norm.weight"),
            router=store.matrix(block + "ffn_gate_inp.weight"),
            expert_gate_up=[store.stack([gate, up]) for gate, up in zip(gates, ups, strict=True)],
            expert_down=store.experts(block + "ffn_down_exps.weight"),
        ))
    tied = config.tied_embeddings
    embedding = store.matrix("token_embd.weight") if tied else store.table("token_embd.weight")
    return llama.Weights(
        token_embd=embedding,
        output_norm=store.vector("output_norm.weight"),
        output=embedding if tied else store.matrix("output.weight"),
        layers=layers,
    )


class MoeWorkspace(Workspace):
    """llama's buffers plus the router's logits and the mixture's buffers for every (row, chosen
    expert) pair."""

    def __init__(self, config: Qwen3MoeConfig, rows: int, max_keys: int) -> None:
        super().__init__(config, rows, max_keys)
        self.router_logits = aligned_zeros((rows, config.expert_count))
        self.experts = ExpertScratch(rows * config.expert_used_count, config.hidden_size,
                                     config.feed_forward_length)


class Qwen3MoeForward(llama.LlamaForward):
    """The forward pass of one loaded qwen3moe model: qwen3's, with the mixture as its MLP."""

    config: Qwen3MoeConfig

    def new_workspace(self, rows: int, max_keys: int) -> MoeWorkspace:
        return MoeWorkspace(self.config, rows, max_keys)

    def evaluate(self, rows: Rows, hooks, phase: ExecutionPhase, *, all_logits: bool = False) -> np.ndarray:
        c, w = self.config, self.weights
        rows.begin(hooks, phase)
        listened = stages.listened(hooks)  # the on-demand stages (attention's, the router) hooks listen at

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
            if "router" in listened:
                hooks.router(i, logits)
            chosen, weights = route(logits, c.expert_used_count)
            m = mixture(y, chosen, weights, layer.expert_gate_up, layer.expert_down, ws.experts,
                        ws.mlp_output)
            hooks.after_mlp(i, m)
            h += m
            hooks.after_layer(i, h)

        rows.finish()
        return final_norm_and_logits(h, w.output_norm, c.rms_norm_eps, rows, hooks, self.lm_head,
                                     c.vocab_size, all_logits)


def build_forward(config: Qwen3MoeConfig, store: WeightStore, context_length: int) -> Qwen3MoeForward:
    return Qwen3MoeForward(config, load_weights(store, config), store, context_length)
