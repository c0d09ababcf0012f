"""How a family shows the inside of its attention to the hooks (the on-demand stages of `ember.stages`):
the queries, keys and values as attention reads them (after QK-norm and rope), at no cost where no hook
listens. The pattern is formed by `ember.rows` (`attend(..., pattern=...)`); the per-head outputs
(`attention_heads`) are the workspace's own buffer and need nothing here. Also each head's contribution
to the residual, for the readout (`head_contributions`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ember.ops import linear


def show(hook: Callable[[int, np.ndarray], None], layer: int, array: np.ndarray,
         order: np.ndarray | None = None) -> None:
    """Show `array` [T, n, d] (a view of the engine's buffer, strided when it is a column slice of the
    fused q/k/v product) to a layer stage's hook as C-contiguous [T, n·d], each head's dims in `order`
    (None: as they are), and write back what the hook left: writes change what attention reads."""
    T, n, d = array.shape
    source = array if order is None else array[:, :, order]
    shown = np.ascontiguousarray(source).reshape(T, n * d)
    hook(layer, shown)
    if np.may_share_memory(shown, array):  # a contiguous view: the hook wrote the engine's memory
        return
    if order is None:
        array[...] = shown.reshape(T, n, d)
    else:
        array[:, :, order] = shown.reshape(T, n, d)


def show_inputs(hooks: Any, layer: int, listened: frozenset[str], q: np.ndarray | None, k: np.ndarray | None,
                v: np.ndarray | None, order: np.ndarray | None = None) -> None:
    """The queries, keys and values of layer `layer` ([T, heads, head_dim] views) at the stages the hooks
    listen at (None: not shown here); `order` puts each head's query and key dims in the checkpoint's
    order (llama's GGUF rows are permuted for its rope layout: `checkpoint_order`). A layer that reads
    another's keys and values (Gemma 4's shared KV) shows them when `ember.rows` hands them over."""
    if q is not None and "attention_queries" in listened:
        show(hooks.attention_queries, layer, q, order)
    if k is not None and "attention_keys" in listened:
        show(hooks.attention_keys, layer, k, order)
    if v is not None and "attention_values" in listened:
        show(hooks.attention_values, layer, v)


def checkpoint_order(head_dim: int) -> np.ndarray:
    """The engine's dim of each of a head's dims in the checkpoint's (HF's) order, for llama's permuted
    Q/K rows: the converter stores checkpoint dims i and i + head_dim/2 as the adjacent pair 2i, 2i+1."""
    return np.arange(head_dim).reshape(head_dim // 2, 2).T.reshape(-1)


def head_contributions(heads: np.ndarray, head_count: int, output_projection: Any,
                       post_norm: np.ndarray | None = None, eps: float = 0.0) -> np.ndarray:
    """Each head's contribution to the residual, [head_count, T, H] float32, from the per-head outputs
    `heads` [T, head_count × head_dim] (the `attention_heads` stage) of one layer: head h's columns alone
    through the output projection (the others zero: its slice of Wo's columns), the layer's own product.
    They add up to the projection's output. With `post_norm` (Gemma's norm after attention, not linear)
    each is divided by the scale of the whole output o = Σ_h o_h, row by row, and multiplied by the norm's
    weight: at that fixed scale they add up to the normed output, the layer's `after_attention`."""
    heads = np.ascontiguousarray(heads, dtype=np.float32)
    T, width = heads.shape
    head_dim = width // head_count
    out = np.empty((head_count, T, output_projection.shape[0]), np.float32)
    alone = np.zeros_like(heads)
    for h in range(head_count):
        columns = slice(h * head_dim, (h + 1) * head_dim)
        alone[:, columns] = heads[:, columns]
        linear(alone, output_projection, out[h])
        alone[:, columns] = 0.0
    if post_norm is not None:
        whole = linear(heads, output_projection, np.empty(out.shape[1:], np.float32)).astype(np.float64)
        scale = np.sqrt(np.mean(whole * whole, axis=-1, keepdims=True) + eps)
        out *= (post_norm / scale).astype(np.float32)
    return out
