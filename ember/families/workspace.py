"""Preallocated activation buffers of a decoder evaluation, each starting on a cache line
(`ember.buffers`: the kernels read them 64 bytes at a time)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ember.buffers import aligned_zeros
from ember.config import ModelConfig


def head_of(ws: Any, rows: int) -> Any:
    """A copy of workspace `ws` whose row buffers ([ws.rows, …] arrays) are views of their first `rows`
    rows: a batch's layers that evaluate fewer rows than the batch holds (`ember.rows.BatchRows`)."""
    cut = copy.copy(ws)
    for name, value in vars(ws).items():
        if isinstance(value, np.ndarray) and value.ndim >= 2 and value.shape[0] == ws.rows:
            setattr(cut, name, value[:rows])
    cut.rows = rows
    return cut


class Workspace:
    """Activation buffers for an evaluation of `rows` tokens; decode keeps one for rows = 1.

    Shared by the families whose blocks have one head geometry (the llama block's, olmo2, gemma3); the
    buffers that only decode needs (scores, spread and rope scratch: see ember.ops) exist only for
    rows = 1.
    """

    def __init__(self, config: ModelConfig, rows: int, max_keys: int) -> None:
        H, F, hd = config.hidden_size, config.feed_forward_length, config.head_dim
        q_width, kv_width = config.head_count * hd, config.head_count_kv * hd
        self.rows = rows
        self.hidden = aligned_zeros((rows, H))
        self.normed = aligned_zeros((rows, H))
        self.row_scratch = aligned_zeros((rows, 1))
        self.qkv = aligned_zeros((rows, q_width + 2 * kv_width))
        self.head_scratch = aligned_zeros((rows, config.head_count, 1))
        self.rope_a = aligned_zeros((rows, config.head_count, config.rope_dim // 2))
        self.rope_b = aligned_zeros(self.rope_a.shape)
        self.rope_scratch = aligned_zeros((6, *self.rope_a.shape)) if rows == 1 else None
        self.attention_heads = aligned_zeros((rows, q_width))
        self.attention_output = aligned_zeros((rows, H))
        self.gate_up = aligned_zeros((rows, 2 * F))
        self.mlp_scratch = aligned_zeros((rows, F))
        self.mlp_output = aligned_zeros((rows, H))
        group = config.head_count // config.head_count_kv
        self.score_buffer = aligned_zeros(config.head_count * max_keys) if rows == 1 else None
        self.score_spread = aligned_zeros(self.score_buffer.shape) if rows == 1 else None
        self.head_spread = aligned_zeros((rows, config.head_count, hd)) if rows == 1 else None
        self.score_scratch = aligned_zeros((config.head_count_kv, group, 1)) if rows == 1 else None
        self.final_normed = aligned_zeros((1, H))
        self.final_row_scratch = aligned_zeros((1, 1))
        self.logits = aligned_zeros((1, config.vocab_size))

    def head(self, rows: int) -> Workspace:
        return head_of(self, rows)
