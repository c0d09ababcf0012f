"""Preallocated activation buffers of a decoder evaluation."""

from __future__ import annotations

import numpy as np

from ember.config import ModelConfig


class Workspace:
    """Activation buffers for an evaluation of `rows` tokens; decode keeps one for rows = 1.

    Shared by the families whose blocks have one head geometry (llama, qwen3, gemma3); the buffers
    that only decode needs (scores, spread and rope scratch: see ember.ops) exist only for rows = 1.
    """

    def __init__(self, config: ModelConfig, rows: int, max_keys: int) -> None:
        H, F, hd = config.hidden_size, config.feed_forward_length, config.head_dim
        q_width, kv_width = config.head_count * hd, config.head_count_kv * hd
        f32 = np.float32
        self.rows = rows
        self.hidden = np.zeros((rows, H), f32)
        self.normed = np.zeros((rows, H), f32)
        self.row_scratch = np.zeros((rows, 1), f32)
        self.qkv = np.zeros((rows, q_width + 2 * kv_width), f32)
        self.head_scratch = np.zeros((rows, config.head_count, 1), f32)
        self.rope_a = np.zeros((rows, config.head_count, config.rope_dim // 2), f32)
        self.rope_b = np.zeros_like(self.rope_a)
        self.rope_scratch = np.zeros((6, *self.rope_a.shape), f32) if rows == 1 else None
        self.attention_heads = np.zeros((rows, q_width), f32)
        self.attention_output = np.zeros((rows, H), f32)
        self.gate_up = np.zeros((rows, 2 * F), f32)
        self.mlp_scratch = np.zeros((rows, F), f32)
        self.mlp_output = np.zeros((rows, H), f32)
        group = config.head_count // config.head_count_kv
        self.score_buffer = np.zeros(config.head_count * max_keys, f32) if rows == 1 else None
        self.score_spread = np.zeros_like(self.score_buffer) if rows == 1 else None
        self.head_spread = np.zeros((rows, config.head_count, hd), f32) if rows == 1 else None
        self.score_scratch = np.zeros((config.head_count_kv, group, 1), f32) if rows == 1 else None
        self.final_normed = np.zeros((1, H), f32)
        self.final_row_scratch = np.zeros((1, 1), f32)
        self.logits = np.zeros((1, config.vocab_size), f32)
