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


def route_top_logits(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(chosen [T, k], weights [T, k]) the other way round (gpt-oss; llama.cpp's SOFTMAX_WEIGHT gating):
    the k largest logits of each row (ties: the lower expert number first), then the softmax over those
    k logits alone. A row whose chosen logits are all −inf gets no weight."""
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    top = np.take_along_axis(logits, chosen, axis=1).astype(np.float32)
    with np.errstate(invalid="ignore"):
        top -= top.max(axis=1, keepdims=True)
        weights = np.exp(top, dtype=np.float32)
        weights /= weights.sum(axis=1, keepdims=True, dtype=np.float32)
    return chosen, np.nan_to_num(weights, nan=0.0).astype(np.float32, copy=False)


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


class ExpertScratch:
    """`mixture`'s buffers for up to `pairs` (row, chosen expert) pairs (rows × experts per row): the
    rows gathered by expert, their gate/up products, the SwiGLU scratch and the experts' outputs."""

    def __init__(self, pairs: int, hidden: int, width: int) -> None:
        self.inputs = aligned_zeros((pairs, hidden))
        self.gate_up = aligned_zeros((pairs, 2 * width))
        self.scratch = aligned_zeros((pairs, width))
        self.outputs = aligned_zeros((pairs, hidden))
        self.by_row = aligned_zeros((pairs, hidden))


def mixture(y: np.ndarray, chosen: np.ndarray, weights: np.ndarray, gate_up: Sequence[Any],
            down: Sequence[Any], scratch: ExpertScratch, out: np.ndarray,
            activation: Callable[[np.ndarray, np.ndarray], Any] = silu_inplace, *,
            glu: Callable[[np.ndarray, np.ndarray, np.ndarray], Any] | None = None,
            gate_up_bias: Sequence[np.ndarray] | None = None,
            down_bias: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """out = Σⱼ weights[:, j] · expert chosen[:, j](y), each expert's gated product
    (activation(y W_gateᵀ) ⊙ y W_upᵀ) W_downᵀ (gate rows then up rows stacked in `gate_up[e]`, `down[e]`;
    `activation(x, scratch)` works in place, `ember.ops`) multiplied once over the rows routed to it, the
    chosen experts' products of a step shared among the threads at once (`matrix.multiply_each`: on the
    Qwen3-30B-A3B shape, one share per expert made decode wait on 16 wake-ups a layer). The sum runs
    over the slots j in order, as llama.cpp's.

    gpt-oss's experts: `gate_up_bias[e]` ([gate bias; up bias]) and `down_bias[e]` are added to expert
    e's products, and `glu(gate, up, scratch)` forms the gated product in `gate` in place of
    activation(gate) ⊙ up."""
    out[...] = 0.0
    if chosen.size == 0:  # a batch's layer that no sequence has reached yet
        return out
    T, k = chosen.shape
    F = scratch.scratch.shape[1]
    order = np.argsort(chosen, axis=None, kind="stable")  # (row, slot) pairs grouped by expert
    experts = chosen.reshape(-1)[order]
    starts = np.flatnonzero(np.r_[True, experts[1:] != experts[:-1]]).tolist()
    stops = [*starts[1:], len(order)]
    pairs = len(order)
    x = scratch.inputs[:pairs]
    np.take(y, order // k, axis=0, out=x, mode="clip")  # valid rows; "raise" would copy via a temporary
    gate_up_rows, products = scratch.gate_up[:pairs], scratch.outputs[:pairs]
    groups = list(zip(starts, stops, strict=True))  # each expert's pairs: a contiguous run a…b−1
    _multiply_each([(gate_up[int(experts[a])], x[a:b], gate_up_rows[a:b]) for a, b in groups])
    if gate_up_bias is not None:
        for a, b in groups:
            gate_up_rows[a:b] += gate_up_bias[int(experts[a])]
    gate, up = gate_up_rows[:, :F], gate_up_rows[:, F:]
    if glu is not None:
        glu(gate, up, scratch.scratch[:pairs])
    else:
        activation(gate, scratch.scratch[:pairs])
        gate *= up
    _multiply_each([(down[int(experts[a])], gate[a:b], products[a:b]) for a, b in groups])
    if down_bias is not None:
        for a, b in groups:
            products[a:b] += down_bias[int(experts[a])]
    products *= weights.reshape(-1)[order][:, None]
    by_row = scratch.by_row[:pairs]
    by_row[order] = products  # back to (row, slot) order
    return np.sum(by_row.reshape(T, k, -1), axis=1, out=out)


def _multiply_each(products: list[tuple[Any, np.ndarray, np.ndarray]]) -> None:
    """out = x Wᵀ for each (W, x, out): quantized experts through `matrix.multiply_each` (imported here:
    the kernels, and numba with them, load only in quantized mode), float32 ones one by one."""
    if products and not isinstance(products[0][0], np.ndarray):
        from ember.quant.matrix import multiply_each

        multiply_each(products)
        return
    for weight, x, out in products:
        linear(x, weight, out)
