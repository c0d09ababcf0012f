"""Key/value cache: one preallocated [n_kv, context, head_dim] pair of arrays per layer."""

from __future__ import annotations

import numpy as np


class KVCache:
    """Keys and values of every evaluated position, per layer.

    Arrays come from np.zeros, so pages are only touched as positions are written: a long context
    costs address space, not memory, until it is used.
    """

    def __init__(self, keys: list[np.ndarray], values: list[np.ndarray]) -> None:
        self.keys = keys
        self.values = values
        self.length = 0  # positions evaluated so far

    @classmethod
    def full(cls, layer_count: int, kv_heads: int, context_length: int, head_dim: int) -> KVCache:
        shape = (kv_heads, context_length, head_dim)
        return cls([np.zeros(shape, np.float32) for _ in range(layer_count)],
                   [np.zeros(shape, np.float32) for _ in range(layer_count)])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def store(self, layer: int, start_position: int, keys: np.ndarray,
              values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write rows [T, n_kv, hd] at start_position…; return views of every visible position."""
        end = start_position + keys.shape[0]
        self.keys[layer][:, start_position:end] = keys.transpose(1, 0, 2)
        self.values[layer][:, start_position:end] = values.transpose(1, 0, 2)
        return self.keys[layer][:, :end], self.values[layer][:, :end]
