"""Numerical building blocks shared by the families (docs/families.md §0.3).

Every function writes into buffers its caller owns (`out=`), so the decode path can run on a
preallocated workspace without allocating an activation per token. Arrays are float32, rows are
tokens.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ember import parallel
from ember.config import RopeLayout, RopeScaling

# numba versions of the per-token operations (`ember.quant.token_ops`), set by `use_token_ops` once the
# quantized kernels are in use; None: NumPy everywhere.
_token_ops: Any = None
_NO_WEIGHT = np.empty(0, np.float32)
_positions = np.arange(0)


def use_token_ops(module: Any) -> None:
    """Let decode's row operations run as single numba calls (`ember.quant.token_ops`)."""
    global _token_ops
    _token_ops = module


def token_ops() -> Any:
    """The numba row operations when in use (`use_token_ops`), else None."""
    return _token_ops


def _one_row(*arrays: np.ndarray) -> bool:
    """Whether the numba route applies: token ops in use, every array C-contiguous (decode's rows, whole
    activation buffers)."""
    return _token_ops is not None and all(a.flags.c_contiguous for a in arrays)


def linear(x: np.ndarray, weight: Any, out: np.ndarray) -> np.ndarray:
    """out = x @ weight.T, with weight stored (out_features, in_features) as in GGUF/PyTorch.

    `weight` is a float32 array (multiplied by BLAS) or a quantized weight from `ember.weights`
    (`ember.quant.QuantizedMatrix`, `StackedMatrix`: its own `matmul(x, out)`).
    """
    if not isinstance(weight, np.ndarray):
        return weight.matmul(x, out)
    features = weight.shape[0]
    if (x.shape[0] * weight.size < SHARED_PRODUCT or parallel.threads() <= 1
            or parallel.blas_threads() > 1):  # weights="float32": BLAS runs the products on its threads
        _blas_product(x, weight, out)
        return out
    # BLAS keeps to one thread (`ember.quant.compute_threads`, quantized weights): ember's threads share
    # the product in pieces of output features instead, each a single-threaded BLAS call
    pieces = min(-(-features // 16), parallel.threads() * 4)
    bounds = [features * i // pieces for i in range(pieces + 1)]

    def straight(index: int) -> None:
        start, stop = bounds[index], bounds[index + 1]
        _blas_product(x, weight[start:stop], out[:, start:stop])

    def aside(index: int) -> np.ndarray:
        start, stop = bounds[index], bounds[index + 1]
        product = np.empty((x.shape[0], stop - start), np.float32)
        _blas_product(x, weight[start:stop], product)
        return product

    def store(index: int, product: object) -> None:
        out[:, bounds[index]:bounds[index + 1]] = product

    parallel.race_pieces(pieces, aside, store, direct=straight)
    return out


# Float32 products of at least this many multiply-adds are shared among ember's threads (`linear`).
# Below it one thread is quicker than a share's ~20 us: Qwen3-30B-A3B's router in decode (1 x 2048 x
# 128 = 2^18) takes ~30 us alone.
SHARED_PRODUCT = 1 << 21


def _blas_product(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
    if x.shape[0] == 1:
        # A single row goes through BLAS gemv, which is faster than a one-row gemm.
        np.matmul(x[0], weight.T, out=out[0])
    else:
        np.matmul(x, weight.T, out=out)


def linear_at(x: np.ndarray, weight: Any, out: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
    """`linear`, or with `columns` only those output features: out[:, j] = x · weight[columns[j]] (their
    rows decoded first, `gather_rows`). An LM head asked for a few logits forms those alone: a patched
    run read through a logit difference needs 2 of SmolLM2's 49,152 (its head was 22% of residual
    patching's multiply-adds)."""
    if columns is None:
        return linear(x, weight, out)
    if getattr(weight, "q8", False):  # activations rounded (weights="quantized-q8"): the full head's sums
        return weight.picked(columns).matmul(x, out)
    picked = gather_rows(weight, columns, np.empty((len(columns), x.shape[1]), np.float32))
    return np.matmul(x, picked.T, out=out)


def gather_rows(table: Any, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = table[ids[i]]: embedding lookups from a float32 array or a table that decodes its own
    rows (`rows(ids, out)`: quantized weights, rows read from the file). ids are valid row numbers."""
    if isinstance(table, np.ndarray):
        # mode="clip" (ids are validated upstream): with the default "raise" NumPy copies via a temporary
        return np.take(table, ids, axis=0, out=out, mode="clip")
    return table.rows(ids, out)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, out: np.ndarray,
             row_scratch: np.ndarray, spread: np.ndarray | None = None) -> np.ndarray:
    """y = x · rsqrt(mean(x²) + eps) · weight over the last axis; `weight=None` is the weightless norm.

    `row_scratch` has x's shape with the last axis of length 1. `out` may be `x` itself. With
    `spread` (x's shape) the per-row factor and the weight are first copied out to full size: NumPy
    allocates a temporary for an operand broadcast over several rows, and decode must not allocate.
    """
    if _one_row(x, out):  # any number of rows: a row's result must not depend on how many there are
        width = x.shape[-1]
        _token_ops.rms_norm(x.reshape(-1, width), _NO_WEIGHT if weight is None else weight, eps,
                            out.reshape(-1, width))
        return out
    np.vecdot(x, x, out=row_scratch[..., 0])
    row_scratch *= 1.0 / x.shape[-1]
    row_scratch += eps
    np.sqrt(row_scratch, out=row_scratch)
    np.reciprocal(row_scratch, out=row_scratch)
    if spread is None:
        np.multiply(x, row_scratch, out=out)
        if weight is not None:
            out *= weight
        return out
    np.copyto(spread, row_scratch)
    np.multiply(x, spread, out=out)
    if weight is not None:
        np.copyto(spread, weight)
        out *= spread
    return out


def silu_inplace(x: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """x ← x · sigmoid(x), with sigmoid(x) = (1 + tanh(x/2)) / 2, which cannot overflow."""

    def rows(start: int, stop: int) -> None:
        y, s = x[start:stop], scratch[start:stop]
        np.multiply(y, 0.5, out=s)
        np.tanh(s, out=s)
        s += 1.0
        s *= 0.5
        y *= s

    parallel.share_ranges(x.shape[0], x.size, rows)
    return x


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh_inplace(x: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """x ← 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), the exact formula HF uses."""

    def rows(start: int, stop: int) -> None:
        y, s = x[start:stop], scratch[start:stop]
        np.multiply(y, y, out=s)
        s *= y  # in place: `0.044715 * x` would allocate an [rows, F] temporary per call
        s *= 0.044715
        s += y
        s *= _GELU_C
        np.tanh(s, out=s)
        s += 1.0
        s *= 0.5
        y *= s

    parallel.share_ranges(x.shape[0], x.size, rows)
    return x


def rope_tables(rope_dim: int, base: float, context_length: int, *, linear_factor: float = 1.0,
                frequency_factors: np.ndarray | None = None, scaling: RopeScaling | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [context, rope_dim/2] of θ[p, i] = p · inv_freq[i], formed in float32 as transformers does.

    inv_freq[i] = 1 / base^(2i / rope_dim) / f_i / linear_factor, each step rounded to float32. A one-ulp
    difference in inv_freq moves θ by ~3e-5 rad at position 500; on Gemma 3 270M that alone put layer
    outputs 2.7e-4 (relative) away from transformers instead of 5e-5.

    `scaling` (instead of linear_factor) applies the file's rope scaling as llama.cpp does: the frequency
    divided by the factor, and with a YaRN ext_factor `yarn_frequencies` between that and the unscaled
    one; cos and sin are multiplied by `scaling.mscale` (docs/families.md §0.3).
    """
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    powers = (base ** exponents.astype(np.float64)).astype(np.float32)
    if frequency_factors is not None:
        powers = powers * frequency_factors.astype(np.float32)
    inverse_frequency = np.float32(1.0) / powers
    mscale = 1.0
    if scaling is not None:
        if linear_factor != 1.0:
            raise ValueError("rope_tables takes linear_factor or scaling, not both")
        if scaling.ext_factor != 0.0:
            inverse_frequency = yarn_frequencies(powers, rope_dim, base, scaling)
        else:
            linear_factor = 1.0 / scaling.frequency_scale
        mscale = scaling.mscale
    if linear_factor != 1.0:
        inverse_frequency = inverse_frequency / np.float32(linear_factor)
    theta = np.arange(context_length, dtype=np.float32)[:, None] * inverse_frequency[None, :]
    cos, sin = np.cos(theta), np.sin(theta)
    if mscale != 1.0:
        cos *= np.float32(mscale)
        sin *= np.float32(mscale)
    return cos, sin


def yarn_correction_range(rope_dim: int, base: float, scaling: RopeScaling) -> tuple[float, float]:
    """The pair indices [low, high] between which YaRN's ramp runs: the pair that turns `beta_fast`
    (low) and `beta_slow` (high) times over the original context, floored / ceiled and clamped to
    [0, rope_dim − 1] (llama.cpp's `ggml_rope_yarn_corr_dims`, transformers' `truncate`)."""

    def dim(rotations: float) -> float:
        ratio = scaling.original_context_length / (rotations * 2 * np.pi)
        return rope_dim * float(np.log(ratio)) / (2 * float(np.log(base)))

    return max(float(np.floor(dim(scaling.beta_fast))), 0.0), min(float(np.ceil(dim(scaling.beta_slow))),
                                                                   rope_dim - 1.0)


def yarn_frequencies(powers: np.ndarray, rope_dim: int, base: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN's frequencies from powers[i] = base^(2i/rope_dim) (times f_i): with
    mix = ext_factor · (1 − clamp((i − low) / max(high − low, 0.001), 0, 1)) per pair i,
    inv_freq = 1/(factor·powers) · (1 − mix) + 1/powers · mix: pairs below `low` (fast, many turns)
    extrapolate (unscaled), pairs past `high` interpolate (divided by the factor). In float32, formed as
    transformers' `_compute_yarn_parameters` forms it."""
    low, high = yarn_correction_range(rope_dim, base, scaling)
    pairs = np.arange(rope_dim // 2, dtype=np.float32)
    ramp = np.clip((pairs - np.float32(low)) / np.float32(max(high - low, 0.001)), 0, 1).astype(np.float32)
    mix = (np.float32(1.0) - ramp) * np.float32(scaling.ext_factor)
    extrapolated = np.float32(1.0) / powers
    interpolated = np.float32(1.0) / (np.float32(1.0 / scaling.frequency_scale) * powers)
    return (interpolated * (np.float32(1.0) - mix) + extrapolated * mix).astype(np.float32)


def apply_rope(
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    layout: RopeLayout,
    rope_dim: int,
    scratch_a: np.ndarray,
    scratch_b: np.ndarray,
    decode_scratch: np.ndarray | None = None,
) -> None:
    """Rotate x [T, heads, head_dim] in place; cos/sin are [T, rope_dim/2] for the rows' positions.

    Each pair (u, v) becomes (u·cos − v·sin, u·sin + v·cos). Dims at or past rope_dim pass through.
    scratch_a/b are [T, heads, rope_dim/2]. `decode_scratch` ([6, T, heads, rope_dim/2]) selects a
    route that allocates nothing: NumPy buffers (allocates) for a strided or broadcast operand, so the
    halves and cos/sin are first copied to contiguous scratch and the results copied back.
    """
    if x.shape[0] == 1 and _one_row(x, cos, sin):
        _token_ops.apply_rope(x, cos, sin, layout is not RopeLayout.NORM, rope_dim)
        return
    half = rope_dim // 2
    if layout is RopeLayout.NORM:
        pairs = x[:, :, :rope_dim].reshape(x.shape[0], x.shape[1], half, 2)
        u, v = pairs[..., 0], pairs[..., 1]
    else:
        u, v = x[:, :, :half], x[:, :, half:rope_dim]
    if decode_scratch is None:

        def rows(start: int, stop: int) -> None:
            tokens = slice(start, stop)
            uu, vv, a, b = u[tokens], v[tokens], scratch_a[tokens], scratch_b[tokens]
            c, s = cos[tokens, None, :], sin[tokens, None, :]
            np.multiply(uu, s, out=a)
            np.multiply(uu, c, out=uu)
            np.multiply(vv, s, out=b)
            np.subtract(uu, b, out=uu)
            np.multiply(vv, c, out=vv)
            np.add(vv, a, out=vv)

        parallel.share_ranges(x.shape[0], x.size, rows)
        return
    u_copy, v_copy, cos_heads, sin_heads, first, second = decode_scratch
    np.copyto(u_copy, u)
    np.copyto(v_copy, v)
    np.copyto(cos_heads, cos[:, None, :])
    np.copyto(sin_heads, sin[:, None, :])
    np.multiply(u_copy, cos_heads, out=first)
    np.multiply(v_copy, sin_heads, out=second)
    np.subtract(first, second, out=first)
    np.copyto(u, first)
    np.multiply(u_copy, sin_heads, out=first)
    np.multiply(v_copy, cos_heads, out=second)
    np.add(first, second, out=first)
    np.copyto(v, first)


def softmax_inplace(scores: np.ndarray, row_scratch: np.ndarray, spread: np.ndarray | None = None) -> None:
    """Softmax over the last axis, in place; row_scratch has the last axis of length 1.

    `spread` (scores' shape) avoids NumPy's temporary for the broadcast row max and sum, as in rms_norm.
    """
    np.max(scores, axis=-1, keepdims=True, out=row_scratch)
    if spread is None:
        scores -= row_scratch
    else:
        np.copyto(spread, row_scratch)
        scores -= spread
    np.exp(scores, out=scores)
    np.sum(scores, axis=-1, keepdims=True, out=row_scratch)
    if spread is None:
        scores /= row_scratch
    else:
        np.copyto(spread, row_scratch)
        scores /= spread


def softmax_with_sinks_inplace(scores: np.ndarray, sinks: np.ndarray) -> None:
    """Softmax over the last axis with one more logit per row that takes a share but has no value
    (gpt-oss's attention sinks): p_j = exp(s_j) / (Σ_k exp(s_k) + exp(sink)), in place. `sinks`
    broadcasts against scores[..., :1] (one per head). The row's p sum to 1 − the sink's share."""
    top = np.maximum(scores.max(axis=-1, keepdims=True), sinks)
    scores -= top
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    total += np.exp(sinks - top)
    scores /= total


def _whole_rows(view: np.ndarray) -> np.ndarray | None:
    """The C-contiguous [n, rows, d] buffer that `view` ([n, :L, d], a cache view) is the start of, or
    None. numba multiplies unit-stride rows far faster when their array says so (measured on SmolLM2's
    decode attention: 45 µs a layer over the view, 15 µs over the buffer)."""
    if view.flags.c_contiguous:
        return view
    n, _, d = view.shape
    item = view.itemsize
    if view.strides[2] != item or view.strides[1] != d * item or view.strides[0] % (d * item):
        return None
    rows = view.strides[0] // (d * item)
    return np.lib.stride_tricks.as_strided(view, shape=(n, rows, d), strides=view.strides, writeable=False)


def _position_range(count: int) -> np.ndarray:
    """0…count−1 without allocating per call (a view of a range grown on demand)."""
    global _positions
    if _positions.shape[0] < count:
        _positions = np.arange(max(count, 2 * _positions.shape[0]), dtype=np.int64)
    return _positions[:count]


def softcap_inplace(scores: np.ndarray, cap: float) -> np.ndarray:
    """scores ← cap · tanh(scores / cap), in place (Gemma 2's attention-logit softcap, before the mask)."""
    np.divide(scores, np.float32(cap), out=scores)
    np.tanh(scores, out=scores)
    scores *= np.float32(cap)
    return scores


PREFILL_QUERY_CHUNK = 128  # bounds the [heads, chunk, keys] score block; smaller skips more masked keys
# Attention's pieces (a KV head's chunk of queries) are shared among the threads from this many
# query · key · head · dimension products on; below it they run in the calling thread. Each piece is a
# few small NumPy calls, mostly Python holding the GIL, so two threads wait on each other. Measured on a
# 2-core Zen 3 EPYC (2026-12-07, µs 1 thread / 2 threads, T queries over T keys): SmolLM2's 9 heads (3 KV)
# of 64 at T = 5 146/150, 32 235/443, 64 433/590, 128 1159/1012; 32 heads (8 KV) of 64 at 16 654/1092,
# 32 706/1436, 64 1570/1434, 128 4000/3157. Two threads gained from about 2^23 products on.
ATTENTION_SHARED_FROM = 1 << 23


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, *, start_position: int, scale: float,
              out: np.ndarray, score_buffer: np.ndarray | None = None,
              row_scratch: np.ndarray | None = None, key_positions: np.ndarray | None = None,
              sliding_window: int = 0, spread_buffer: np.ndarray | None = None,
              softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal grouped-query attention; with `softcap` c > 0 each scaled score s becomes c·tanh(s/c)
    before the mask and the softmax (Gemma 2). `sinks` [n_head] (gpt-oss): each head's softmax has one
    more logit, which takes its share of the weight and adds no value (`softmax_with_sinks_inplace`).

    q: [T, n_head, hd] for positions start_position … start_position+T−1.
    keys/values: [n_kv, L, hd] cache views holding every visible position (the current rows included).
    key_positions: absolute position of each cached key ([L]); default 0…L−1.
    out: [T, n_head·hd_v]. Query head h reads KV head h // (n_head / n_kv).
    Decode (T = 1) runs on `score_buffer` and `spread_buffer` (flat, ≥ n_head·L each) and `row_scratch`
    ([n_kv, group, 1]) without allocating; longer evaluations allocate their score blocks.
    """
    token_count, head_count, head_dim = q.shape
    kv_count, key_count, _ = keys.shape
    group = head_count // kv_count
    value_dim = values.shape[2]

    if (token_count == 1 and score_buffer is not None and _one_row(q, out)
            and head_count * key_count * head_dim <= _token_ops.ATTEND_LIMIT
            and (full_keys := _whole_rows(keys)) is not None
            and (full_values := _whole_rows(values)) is not None):
        positions = key_positions if key_positions is not None else _position_range(key_count)
        _token_ops.attend(q[0], full_keys, full_values, key_count, scale, start_position, positions,
                          sliding_window, softcap, _token_ops.NO_SINKS if sinks is None else sinks,
                          score_buffer[: head_count * key_count].reshape(head_count, key_count),
                          out.reshape(head_count, value_dim))
        return out
    if token_count == 1 and score_buffer is not None:
        query = q.reshape(kv_count, group, head_dim)
        scores = score_buffer[: kv_count * group * key_count].reshape(kv_count, group, key_count)
        np.matmul(query, keys.transpose(0, 2, 1), out=scores)
        scores *= scale
        if softcap:
            softcap_inplace(scores, softcap)
        if sliding_window:
            positions = key_positions if key_positions is not None else np.arange(key_count)
            hidden_keys = (start_position - positions) >= sliding_window
            if hidden_keys.any():
                scores[:, :, hidden_keys] = -np.inf
        if sinks is not None:
            softmax_with_sinks_inplace(scores, sinks.reshape(kv_count, group, 1))
        else:
            spread = None
            if spread_buffer is not None:
                spread = spread_buffer[: kv_count * group * key_count].reshape(kv_count, group, key_count)
            softmax_inplace(scores, row_scratch, spread)
        np.matmul(scores, values, out=out.reshape(kv_count, group, value_dim))
        return out

    # Longer evaluations: one piece of work per KV head and chunk of queries, shared out among ember's
    # threads (`ember.parallel`), each piece a few single-threaded BLAS products.
    out_heads = out.reshape(token_count, kv_count, group, value_dim)
    chunks = range(0, token_count, PREFILL_QUERY_CHUNK)

    def chunk_of(index: int) -> tuple[int, slice]:
        kv, chunk_start = divmod(index, len(chunks))
        chunk_start *= PREFILL_QUERY_CHUNK
        return kv, slice(chunk_start, min(chunk_start + PREFILL_QUERY_CHUNK, token_count))

    def piece(index: int) -> np.ndarray:  # writes nothing shared: a helper's result may be dropped
        kv, chunk = chunk_of(index)
        query_positions = start_position + np.arange(chunk.start, chunk.stop)
        if key_positions is None:
            # keys are cached in position order: those after the chunk's last query are all masked
            visible = start_position + chunk.stop
            chunk_keys, chunk_values = keys[kv, :visible], values[kv, :visible]
            chunk_key_positions = np.arange(visible)
        else:
            chunk_keys, chunk_values, chunk_key_positions = keys[kv], values[kv], key_positions
        query = q[chunk, kv * group:(kv + 1) * group].transpose(1, 0, 2)  # [g, t, hd]
        scores = np.matmul(query, chunk_keys.T)  # [g, t, L]
        distance = query_positions[:, None] - chunk_key_positions[None, :]
        masked = distance < 0
        if sliding_window:
            masked |= distance >= sliding_window
        # scale, then add 0 / −inf: one pass each, cheaper than boolean indexing of the score block
        scores *= scale
        if softcap:
            softcap_inplace(scores, softcap)
        scores += np.where(masked, np.float32(-np.inf), np.float32(0.0))
        if sinks is not None:
            softmax_with_sinks_inplace(scores, sinks[kv * group:(kv + 1) * group].reshape(group, 1, 1))
        else:
            softmax_inplace(scores, np.empty(scores.shape[:-1] + (1,), dtype=np.float32))
        return np.matmul(scores, chunk_values).transpose(1, 0, 2)  # [t, g, hd_v]

    def store(index: int, result: object) -> None:
        kv, chunk = chunk_of(index)
        out_heads[chunk, kv] = result

    small = token_count * key_count * head_count * head_dim < ATTENTION_SHARED_FROM
    parallel.race_pieces(kv_count * len(chunks), piece, store, on=1 if small else None)
    return out


def sliding_window_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, key_positions: np.ndarray,
                             start_position: int, window: int, scale: float, out: np.ndarray,
                             softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
    """Attention of several rows on a sliding layer, one query chunk at a time over only the keys its
    window can reach (keys in ascending position order, as `SlidingWindowKV.store` returns them for
    several rows).

    Same result as one `attention` call over every key with the mask, without scoring a long prompt's
    rows against thousands of keys that are all masked.
    """
    token_count = q.shape[0]
    for first_row in range(0, token_count, PREFILL_QUERY_CHUNK):
        last_row = min(first_row + PREFILL_QUERY_CHUNK, token_count)
        oldest = int(np.searchsorted(key_positions, start_position + first_row - window + 1))
        newest = int(np.searchsorted(key_positions, start_position + last_row - 1, side="right"))
        reach = slice(oldest, newest)
        attention(q[first_row:last_row], keys[:, reach], values[:, reach],
                  start_position=start_position + first_row, scale=scale, out=out[first_row:last_row],
                  key_positions=key_positions[reach], sliding_window=window, softcap=softcap, sinks=sinks)
    return out
