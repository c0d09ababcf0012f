"""A mixture-of-experts MLP: the router's choice and the chosen experts' gated products.

For rows y [T, H] (the experts' normed input), E experts of which each row takes k:

    logits = x W_routerᵀ                        [T, E]   → the `router` stage (writable); x is y
                                                          (qwen3moe) or the family's own router input
    p = softmax(logits) over the experts        (float32; a −inf logit gives p = 0)
    chosen = the k experts of largest p         [T, k]   (ties: the lower expert number first)
    w = p[chosen] / Σ p[chosen]                 [T, k]   (the sum clamped below at 2⁻¹⁴, as llama.cpp)
    m = Σⱼ w[:, j] · (act(y W_gate[cⱼ]ᵀ) ⊙ y W_up[cⱼ]ᵀ) W_down[cⱼ]ᵀ   [T, H]

`route` is the second to fourth lines (experiments call it too, to read a row's choice from its
logits); `mixture` the last, with act = silu (SwiGLU: qwen3moe) or another activation (gelu_tanh,
GeGLU: Gemma 4). A family may change w between the two (Gemma 4 multiplies it by a per-expert scale).
Each expert's weights are its own slices of the file's 3-D tensors (`WeightStore.experts`): `mixture`
groups the rows by expert and multiplies each chosen expert once over the rows routed to it (a decode
step: the k chosen experts, one row each); an expert no row chose is not read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ember.buffers import aligned_zeros
from ember.ops import linear, silu_inplace

# llama.cpp clamps the sum of the chosen probabilities to the smallest normal float16 before dividing
# (build_moe_ffn); it only matters when every chosen expert was banned.
SMALLEST_SUM = 6.103515625e-5


def route(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(chosen experts [T, k] int64, their weights [T, k] float32) of router logits [T, E]: the k most
    probable experts of each row under softmax(logits), their probabilities renormalised to sum to 1."""
    with np.errstate(invalid="ignore", divide="ignore"):
        top = logits.max(axis=1, keepdims=True)
        probabilities = np.exp(logits - np.where(np.isfinite(top), top, 0), dtype=np.float32)
        probabilities /= probabilities.sum(axis=1, keepdims=True, dtype=np.float32)
    probabilities = np.nan_to_num(probabilities, nan=0.0)  # a row banned everywhere: no weight at all
    chosen = np.argsort(-probabilities, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probabilities, chosen, axis=1)
    weights /= np.maximum(weights.sum(axis=1, keepdims=True), np.float32(SMALLEST_SUM))
    return chosen, weights.astype(np.float32, copy=False)


class ExpertBuffers:
    """The scratch `mixture` writes, for up to `rows` rows, hidden width H and expert width F (a family
    whose workspace does not already hold these names keeps one of these)."""

    def __init__(self, rows: int, hidden: int, width: int) -> None:
        self.rows_in = aligned_zeros((rows, hidden))
        self.gate_up = aligned_zeros((rows, 2 * width))
        self.mlp_scratch = aligned_zeros((rows, width))
        self.expert_output = aligned_zeros((rows, hidden))


def mixture(y: np.ndarray, chosen: np.ndarray, weights: np.ndarray, gate_up: Sequence[Any],
            down: Sequence[Any], ws: Any, out: np.ndarray,
            activation: Callable[[np.ndarray, np.ndarray], Any] = silu_inplace) -> np.ndarray:
    """out = Σⱼ weights[:, j] · expert chosen[:, j](y), each expert's gated product
    (activation(y W_gateᵀ) ⊙ y W_upᵀ) W_downᵀ (gate rows then up rows stacked in `gate_up[e]`, `down[e]`)
    multiplied once over the rows routed to it. `activation(x, scratch)` works in place (`ember.ops`).
    Scratch: ws.rows_in [T, H], ws.gate_up [T, 2F], ws.mlp_scratch [T, F], ws.expert_output [T, H]
    (a workspace or an `ExpertBuffers`)."""
    out[...] = 0.0
    if chosen.size == 0:  # a batch's layer that no sequence has reached yet
        return out
    F = ws.mlp_scratch.shape[1]
    order = np.argsort(chosen, axis=None, kind="stable")  # (row, slot) pairs grouped by expert
    experts = chosen.reshape(-1)[order]
    starts = np.flatnonzero(np.r_[True, experts[1:] != experts[:-1]])
    stops = np.r_[starts[1:], len(order)]
    for start, stop in zip(starts.tolist(), stops.tolist(), strict=True):
        expert = int(experts[start])
        pairs = order[start:stop]
        rows, slots = pairs // chosen.shape[1], pairs % chosen.shape[1]
        n = len(rows)
        x = ws.rows_in[:n]
        np.take(y, rows, axis=0, out=x, mode="clip")  # valid rows; "raise" would copy via a temporary
        gate_up_rows = linear(x, gate_up[expert], ws.gate_up[:n])
        gate, up = gate_up_rows[:, :F], gate_up_rows[:, F:]
        activation(gate, ws.mlp_scratch[:n])
        gate *= up
        product = linear(gate, down[expert], ws.expert_output[:n])
        product *= weights[rows, slots][:, None]
        out[rows] += product  # each row takes an expert at most once: no repeated index
    return out
