"""Key/value caches.

`KVCache`: one preallocated [n_kv, context, head_dim] pair of arrays per layer (llama, qwen3).
`LayeredKVCache`: one object per layer, `FullLayerKV` or `SlidingWindowKV` (a ring of `window` slots),
for models that mix full and sliding-window attention (Gemma 3, Gemma 4).
"""

from __future__ import annotations

import numpy as np

from ember.buffers import aligned_zeros


class KVCache:
    """Keys and values of every evaluated position, per layer.

    Arrays come from np.zeros (cache-line aligned, `ember.buffers`), so pages are only touched as
    positions are written: a long context costs address space, not memory, until it is used.
    """

    def __init__(self, keys: list[np.ndarray], values: list[np.ndarray]) -> None:
        self.keys = keys
        self.values = values
        self.length = 0  # positions evaluated so far

    @classmethod
    def full(cls, layer_count: int, kv_heads: int, context_length: int, head_dim: int) -> KVCache:
        shape = (kv_heads, context_length, head_dim)
        return cls([aligned_zeros(shape) for _ in range(layer_count)],
                   [aligned_zeros(shape) for _ in range(layer_count)])

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


class FullLayerKV:
    """One full-attention layer: every position 0…context−1 has its own slot.

    `store` returns views (no copy) plus the positions of the returned keys (a view of a shared
    arange), so attention never builds a position array per token.
    """

    def __init__(self, kv_heads: int, context_length: int, head_dim: int,
                 value_dim: int | None = None) -> None:
        self.keys = aligned_zeros((kv_heads, context_length, head_dim))
        self.values = aligned_zeros((kv_heads, context_length, value_dim or head_dim))
        self.positions = np.arange(context_length, dtype=np.int64)

    def store(self, start_position: int, keys: np.ndarray,
              values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        end = start_position + keys.shape[0]
        self.keys[:, start_position:end] = keys.transpose(1, 0, 2)
        self.values[:, start_position:end] = values.transpose(1, 0, 2)
        return self.keys[:, :end], self.values[:, :end], self.positions[:end]


class SlidingWindowKV:
    """One sliding-window layer: a ring of `window` slots; slot s holds position p with p % window == s.

    A query at position p sees keys p−window+1 … p (docs/families.md §0.3), so the ring never needs more than
    `window` slots. Evaluations must continue where the previous one stopped, or restart at 0.

    * one row (decode): the row is written into its slot first, then every filled slot is returned as
      views (no copy). The slots hold exactly the visible window; `positions` says where each key is.
    * several rows (prefill): the earlier rows' keys may still be needed by the batch, so the returned
      keys are a new array holding the ring's previous contents followed by the batch's own rows, in
      ascending position order (pass the positions and the window to attention to mask them; a caller
      may also slice out each query chunk's window); then the last `window` rows of the batch are
      written into the ring.
    """

    def __init__(self, kv_heads: int, window: int, head_dim: int, value_dim: int | None = None) -> None:
        if window <= 0:
            raise ValueError(f"a sliding window must be positive, got {window}")
        self.window = window
        self.keys = aligned_zeros((kv_heads, window, head_dim))
        self.values = aligned_zeros((kv_heads, window, value_dim or head_dim))
        self.positions = np.full(window, -1, dtype=np.int64)  # −1: empty slot
        self.length = 0  # positions stored so far; the next evaluation starts here (or at 0)

    def store(self, start_position: int, keys: np.ndarray,
              values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if start_position == 0:
            self.positions.fill(-1)
            self.length = 0
        elif start_position != self.length:
            raise ValueError(
                f"a sliding-window cache continues at position {self.length} or restarts at 0, "
                f"not at {start_position}"
            )
        count = keys.shape[0]
        end = start_position + count
        filled = min(self.length, self.window)  # slots 0…filled−1 are valid before this call
        if count == 1:
            self._write(start_position, keys, values)
            visible = min(end, self.window)
            return self.keys[:, :visible], self.values[:, :visible], self.positions[:visible]

        order = np.argsort(self.positions[:filled])  # the ring's slots, oldest position first
        all_keys = np.concatenate([self.keys[:, order], keys.transpose(1, 0, 2)], axis=1)
        all_values = np.concatenate([self.values[:, order], values.transpose(1, 0, 2)], axis=1)
        all_positions = np.concatenate([self.positions[order], np.arange(start_position, end)])
        kept = min(count, self.window)
        self._write(end - kept, keys[count - kept:], values[count - kept:])
        return all_keys, all_values, all_positions

    def _write(self, first_position: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Write rows [n, n_kv, hd] (n ≤ window) for positions first_position…; advance `length`."""
        count = keys.shape[0]
        if count == 1:  # decode: plain indexing, nothing allocated
            slot = first_position % self.window
            self.keys[:, slot] = keys[0]
            self.values[:, slot] = values[0]
            self.positions[slot] = first_position
        else:
            positions = np.arange(first_position, first_position + count)
            slots = positions % self.window
            self.keys[:, slots] = keys.transpose(1, 0, 2)
            self.values[:, slots] = values.transpose(1, 0, 2)
            self.positions[slots] = positions
        self.length = first_position + count


class LayeredKVCache:
    """Per-layer caches for models that mix full and sliding-window layers (Gemma 3, Gemma 4).

    Build it with `LayeredKVCache.build(context_length, specs)`, one `(kv_heads, head_dim, window)` per
    layer (`window` 0: full attention), or from ready layer objects. `store(layer, start, keys, values)`
    takes the evaluation's rows [T, n_kv, hd] and returns `(keys, values, key_positions)` in the layout
    `ember.ops.attention` reads ([n_kv, L, hd], [n_kv, L, hd_v], [L]); pass `key_positions` and, on a
    sliding layer, `sliding_window` to attention.
    `length` is the number of evaluated positions, as on `KVCache`; setting it to 0 starts over.
    """

    def __init__(self, layers: list[FullLayerKV | SlidingWindowKV]) -> None:
        self.layers = layers
        self.length = 0

    @classmethod
    def build(cls, context_length: int, specs: list[tuple[int, int, int]]) -> LayeredKVCache:
        layers: list[FullLayerKV | SlidingWindowKV] = []
        for kv_heads, head_dim, window in specs:
            if window and window < context_length:
                layers.append(SlidingWindowKV(kv_heads, window, head_dim))
            else:
                layers.append(FullLayerKV(kv_heads, context_length, head_dim))
        return cls(layers)

    def store(self, layer: int, start_position: int, keys: np.ndarray,
              values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.layers[layer].store(start_position, keys, values)
