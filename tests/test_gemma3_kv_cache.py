"""The sliding-window KV cache: a ring of `window` slots that attends exactly like a full cache + mask."""

import numpy as np
import pytest

from ember.kv_cache import FullLayerKV, LayeredKVCache, SlidingWindowKV
from ember.ops import attention

KV_HEADS, HEADS, HEAD_DIM = 2, 4, 8


def rows(rng: np.random.Generator, count: int, heads: int) -> np.ndarray:
    return rng.standard_normal((count, heads, HEAD_DIM)).astype(np.float32)


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, window: int) -> np.ndarray:
    """Attention of q (positions start…) over every key 0…start+T−1 with a sliding mask, in float64."""
    T = q.shape[0]
    group = HEADS // KV_HEADS
    out = np.zeros((T, HEADS, HEAD_DIM))
    for t in range(T):
        p = start + t
        visible = [j for j in range(p + 1) if p - j < window]
        for h in range(HEADS):
            kv = h // group
            scores = keys[visible, kv].astype(np.float64) @ q[t, h] / np.sqrt(HEAD_DIM)
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            out[t, h] = weights @ values[visible, kv]
    return out.reshape(T, HEADS * HEAD_DIM)


@pytest.mark.parametrize("window, steps", [
    (4, [3, 1, 1, 1, 1, 1]),        # prefill shorter than the window, decode across it
    (4, [9, 1, 1, 1]),              # prefill longer than the window
    (5, [2, 7, 1, 3, 1, 1]),        # batches after decode steps, wider than the window
    (3, [1, 1, 1, 1, 1, 6]),        # decode first, then a long batch
])
def test_ring_matches_full_cache_with_mask(window: int, steps: list[int]) -> None:
    rng = np.random.default_rng(window * 100 + len(steps))
    total = sum(steps)
    q_all, k_all, v_all = rows(rng, total, HEADS), rows(rng, total, KV_HEADS), rows(rng, total, KV_HEADS)
    ring = SlidingWindowKV(KV_HEADS, window, HEAD_DIM)
    full = FullLayerKV(KV_HEADS, total, HEAD_DIM)
    score_buffer = np.zeros(HEADS * total, np.float32)
    score_scratch = np.zeros((KV_HEADS, HEADS // KV_HEADS, 1), np.float32)
    start = 0
    for count in steps:
        span = slice(start, start + count)
        expected = reference(q_all[span], k_all[:start + count], v_all[:start + count], start, window)
        for cache in (ring, full):
            keys, values, positions = cache.store(start, k_all[span], v_all[span])
            out = np.zeros((count, HEADS * HEAD_DIM), np.float32)
            attention(q_all[span].copy(), keys, values, start_position=start, scale=1 / np.sqrt(HEAD_DIM),
                      out=out, score_buffer=score_buffer, row_scratch=score_scratch,
                      key_positions=positions, sliding_window=window)
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        assert ring.length == start + count
        assert ring.keys.shape[1] == window  # never more than the window
        held = sorted(p for p in ring.positions.tolist() if p >= 0)
        assert held == list(range(max(0, start + count - window), start + count))
        start += count


def test_decode_returns_views_of_the_ring() -> None:
    rng = np.random.default_rng(0)
    ring = SlidingWindowKV(KV_HEADS, 4, HEAD_DIM)
    ring.store(0, rows(rng, 6, KV_HEADS), rows(rng, 6, KV_HEADS))
    keys, values, positions = ring.store(6, rows(rng, 1, KV_HEADS), rows(rng, 1, KV_HEADS))
    assert np.shares_memory(keys, ring.keys) and np.shares_memory(values, ring.values)
    assert sorted(positions.tolist()) == [3, 4, 5, 6]


def test_restart_and_rejected_gap() -> None:
    rng = np.random.default_rng(1)
    ring = SlidingWindowKV(KV_HEADS, 4, HEAD_DIM)
    ring.store(0, rows(rng, 6, KV_HEADS), rows(rng, 6, KV_HEADS))
    with pytest.raises(ValueError, match="continues at position 6"):
        ring.store(3, rows(rng, 1, KV_HEADS), rows(rng, 1, KV_HEADS))
    keys, _, positions = ring.store(0, rows(rng, 2, KV_HEADS), rows(rng, 2, KV_HEADS))
    assert positions.tolist() == [0, 1] and keys.shape == (KV_HEADS, 2, HEAD_DIM)
    assert sorted(p for p in ring.positions.tolist() if p >= 0) == [0, 1]


def test_layered_cache_build() -> None:
    cache = LayeredKVCache.build(64, [(1, 8, 16), (1, 8, 0), (2, 4, 128)])
    assert isinstance(cache.layers[0], SlidingWindowKV) and cache.layers[0].keys.shape == (1, 16, 8)
    assert isinstance(cache.layers[1], FullLayerKV) and cache.layers[1].keys.shape == (1, 64, 8)
    assert isinstance(cache.layers[2], FullLayerKV)  # a window wider than the context is a full layer
    assert cache.length == 0


def test_chunked_sliding_prefill_matches_the_masked_reference() -> None:
    """Gemma 3's prefill on a sliding layer: per query chunk, only the keys its window reaches; with
    earlier ring contents (out of slot order after wrapping) and more rows than one chunk."""
    from ember.ops import PREFILL_QUERY_CHUNK, sliding_window_attention

    rng = np.random.default_rng(7)
    window, earlier, count = 40, 57, PREFILL_QUERY_CHUNK * 2 + 30
    total = earlier + count
    q_all, k_all, v_all = rows(rng, total, HEADS), rows(rng, total, KV_HEADS), rows(rng, total, KV_HEADS)
    ring = SlidingWindowKV(KV_HEADS, window, HEAD_DIM)
    ring.store(0, k_all[:earlier], v_all[:earlier])
    keys, values, positions = ring.store(earlier, k_all[earlier:], v_all[earlier:])
    assert positions.tolist() == list(range(earlier - window, total))  # ascending, window of earlier ones
    out = np.zeros((count, HEADS * HEAD_DIM), np.float32)
    sliding_window_attention(q_all[earlier:].copy(), keys, values, positions, earlier, window,
                              1 / np.sqrt(HEAD_DIM), out)
    expected = reference(q_all[earlier:], k_all, v_all, earlier, window)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
