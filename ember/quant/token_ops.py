"""numba versions of `ember.ops`' per-token operations, for decode: one call where NumPy needs several.

(SiLU and GELU stay in NumPy, whose tanh is vectorized: a numba loop calling tanh per value measured
29 µs for SmolLM2's 1536 values against NumPy's 6 µs.)

A decode step of a small model spends much of its time outside the matrix products: NumPy costs about
1-2 µs a call, and RMSNorm, rope, attention over the cache and the activation take ~45 calls a layer
(measured on SmolLM2-135M, one thread: 3.3 of 17 ms a step outside the products). Each function here
is one call and computes what its `ember.ops` namesake computes, in float32, up to summation order.

`ember.ops` uses them once `register()` has run (`ember.quant.matrix.warm_up`, i.e. when the quantized
kernels are in use) and only for the arguments they are written for: C-contiguous rows; everything
else (prefill batches, strided views, no numba) takes the NumPy route.
"""

from __future__ import annotations

import numpy as np

from ember.quant.jit import njit

# Sums may be reassociated (vectorized); no approximate functions ('afn'), no fused multiply-add
# ('contract', so that each product rounds as NumPy's does), and NaN and infinities keep their meaning
# (masked keys are −inf; an experiment may write NaN, which must show).
FLAGS = {"reassoc", "nsz"}

# `attend` runs in one thread at about 10 G multiply-adds/s, so past this many (heads × keys × head
# dim, twice) NumPy's batched BLAS products, on every thread, are faster. Measured: SmolLM2 at 129 keys
# (74 k) 15 µs against ~50 µs in NumPy's seven calls.
ATTEND_LIMIT = 1 << 20


@njit(fastmath=FLAGS, cache=True)
def rms_norm(x, weight, eps, out):
    """out[r] = x[r] · rsqrt(mean(x[r]²) + eps) · weight for each row of x [N, D]; weight has D values
    or none (the weightless norm). out may be x."""
    rows, width = x.shape
    inverse_width = np.float32(1.0 / width)
    for r in range(rows):
        total = np.float32(0.0)
        for c in range(width):
            total += x[r, c] * x[r, c]
        factor = np.float32(1.0) / np.sqrt(total * inverse_width + np.float32(eps))
        if weight.shape[0] == width:
            for c in range(width):
                out[r, c] = x[r, c] * factor * weight[c]
        else:
            for c in range(width):
                out[r, c] = x[r, c] * factor


@njit(fastmath=FLAGS, cache=True)
def apply_rope(x, cos, sin, neox, rope_dim):
    """Rotate x [T, heads, head_dim] in place by cos/sin [T, rope_dim/2]: pairs (2i, 2i+1), or (i, i+half)
    with `neox`; dims at or past rope_dim pass through."""
    tokens, heads, _ = x.shape
    half = rope_dim // 2
    for t in range(tokens):
        for h in range(heads):
            for i in range(half):
                a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
                u, v = x[t, h, a], x[t, h, b]
                x[t, h, a] = u * cos[t, i] - v * sin[t, i]
                x[t, h, b] = u * sin[t, i] + v * cos[t, i]


NO_SINKS = np.empty(0, np.float32)  # the kernels' `sinks` when the family has none


@njit(fastmath=FLAGS, cache=True)
def attend(q, keys, values, key_count, scale, position, key_positions, window, softcap, sinks, scores, out):
    """One query row's grouped-query attention over the cache (`ember.ops.attention` uses it for short
    caches only: see `ATTEND_LIMIT`).

    q [n_head, hd]; keys [n_kv, ≥L, hd], values [n_kv, ≥L, hd_v] (the cache buffers, of which the first
    L = key_count positions are read); key_positions [L] (the
    position of each key; only read with a sliding `window` > 0, which hides keys `window` or more
    positions back); `softcap` c > 0: each scaled score s becomes c·tanh(s/c) (Gemma 2); `sinks`
    [n_head] or empty: each head's softmax has its sink logit too, which takes a share and adds no value
    (gpt-oss); scores [n_head, L] scratch; out [n_head, hd_v]. Head h reads KV head h // group.
    """
    cap = np.float32(softcap)
    head_count, head_dim = q.shape
    kv_count = keys.shape[0]
    group = head_count // kv_count
    value_dim = values.shape[2]
    for h in range(head_count):
        kv = h // group
        row = scores[h]
        largest = sinks[h] if sinks.shape[0] > 0 else -np.inf
        for j in range(key_count):
            if window > 0 and position - key_positions[j] >= window:
                row[j] = -np.inf
                continue
            total = np.float32(0.0)
            for c in range(head_dim):
                total += q[h, c] * keys[kv, j, c]
            row[j] = total * np.float32(scale)
            if cap > 0:
                row[j] = cap * np.tanh(row[j] / cap)
            largest = max(largest, row[j])
        norm = np.float32(np.exp(sinks[h] - largest)) if sinks.shape[0] > 0 else np.float32(0.0)
        for j in range(key_count):
            row[j] = np.exp(row[j] - largest)
            norm += row[j]
        for c in range(value_dim):
            out[h, c] = 0.0
        for j in range(key_count):
            weight = row[j] / norm
            if weight != 0.0:
                for c in range(value_dim):
                    out[h, c] += weight * values[kv, j, c]


@njit(fastmath=FLAGS, cache=True, nogil=True)
def ragged_attention(q, k, v, prefix_keys, prefix_values, offsets, starts, prefix_index, prefix_length, own,
                     row_entry, row_positions, scale, window, softcap, sinks, first_row, stop_row, out):
    """Grouped-query attention of rows first_row…stop_row−1 of a batch of sequences (`ember.rows`).

    q [R, n_head, hd]; k, v [R', n_kv, hd] the batch's own rows (R' ≥ R); row r belongs to sequence
    e = row_entry[r] (rows offsets[e]… of the stack, positions starts[e]…) and sits at row_positions[r].
    Its keys: the saved ones of prefix prefix_index[e] at positions 0…prefix_length[e]−1
    (prefix_keys/values [prefixes, n_kv, T, hd]), then, when own[e], its sequence's own rows up to
    itself. A key at position p is seen when p ≤ the row's position and, with a sliding `window` > 0,
    when the row's position − p < window. `softcap` c > 0: each scaled score s becomes c·tanh(s/c)
    (Gemma 2). `sinks` [n_head] or empty: as in `attend` (gpt-oss). out [R, n_head, hd_v].
    """
    cap = np.float32(softcap)
    head_count, head_dim = q.shape[1], q.shape[2]
    kv_count = k.shape[1]
    group = head_count // kv_count
    value_dim = v.shape[2]
    longest = prefix_keys.shape[2] + (stop_row - first_row) + 1
    for r in range(first_row, stop_row):
        longest = max(longest, prefix_length[row_entry[r]] + r - offsets[row_entry[r]] + 1)
    scores = np.empty(longest, np.float32)
    for r in range(first_row, stop_row):
        e = row_entry[r]
        position = row_positions[r]
        source = prefix_index[e]
        saved = prefix_length[e]
        own_first = offsets[e]
        own_last = r if own[e] else own_first - 1
        for h in range(head_count):
            kv = h // group
            largest = sinks[h] if sinks.shape[0] > 0 else -np.inf
            n = 0
            for j in range(saved):
                if j > position or (window > 0 and position - j >= window):
                    scores[n] = -np.inf
                else:
                    total = np.float32(0.0)
                    for c in range(head_dim):
                        total += q[r, h, c] * prefix_keys[source, kv, j, c]
                    scores[n] = total * scale
                    if cap > 0:
                        scores[n] = cap * np.tanh(scores[n] / cap)
                    largest = max(largest, scores[n])
                n += 1
            for j in range(own_first, own_last + 1):
                key_position = starts[e] + j - own_first
                if window > 0 and position - key_position >= window:
                    scores[n] = -np.inf
                else:
                    total = np.float32(0.0)
                    for c in range(head_dim):
                        total += q[r, h, c] * k[j, kv, c]
                    scores[n] = total * scale
                    if cap > 0:
                        scores[n] = cap * np.tanh(scores[n] / cap)
                    largest = max(largest, scores[n])
                n += 1
            norm = np.float32(np.exp(sinks[h] - largest)) if sinks.shape[0] > 0 else np.float32(0.0)
            for j in range(n):
                scores[j] = np.exp(scores[j] - largest)
                norm += scores[j]
            for c in range(value_dim):
                out[r, h, c] = 0.0
            for j in range(saved):
                weight = scores[j] / norm
                if weight != 0.0:
                    for c in range(value_dim):
                        out[r, h, c] += weight * prefix_values[source, kv, j, c]
            for j in range(own_first, own_last + 1):
                weight = scores[saved + j - own_first] / norm
                if weight != 0.0:
                    for c in range(value_dim):
                        out[r, h, c] += weight * v[j, kv, c]


def warm_up() -> None:
    """Compile (or load from the cache) every function with the types decode passes."""
    rows = np.ones((1, 16), np.float32)
    rms_norm(rows, np.ones(16, np.float32), 1e-6, rows)
    rms_norm(rows, np.empty(0, np.float32), 1e-6, rows)
    heads = np.ones((1, 2, 8), np.float32)
    apply_rope(heads, np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32), True, 8)
    cache = np.ones((1, 4, 8), np.float32)
    view = cache.view()
    view.flags.writeable = False
    for keys in (cache, view):  # the cache's own arrays (sliding windows) or read-only views of it
        for sinks in (NO_SINKS, np.zeros(2, np.float32)):
            attend(heads[0], keys, keys, 3, 1.0, 2, np.arange(3), 0, 0.0, sinks, np.empty((2, 3), np.float32),
                   np.empty((2, 8), np.float32))
    rows = np.ones((2, 2, 8), np.float32)
    saved = np.ones((1, 1, 2, 8), np.float32)
    one = np.ones(1, np.int64)
    ragged_attention(rows, rows[:, :1].copy(), rows[:, :1].copy(), saved, saved, np.array([0, 2]),
                     np.zeros(1, np.int64), np.zeros(1, np.int64), one, one, np.zeros(2, np.int64),
                     np.arange(2), np.float32(1.0), 0, 0.0, NO_SINKS, 0, 2, np.empty((2, 2, 8), np.float32))
