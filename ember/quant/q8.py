"""8-bit activations: decode's products the way llama.cpp computes them, an opt-in speed/precision trade.

By default ember multiplies exact float32 weight values by float32 activations: its boundaries match
transformers' float32 forward. llama.cpp instead rounds each activation vector to signed bytes, one scale
per 256 values (ggml's Q8_K, `quantize_q8_k` below), and multiplies the weights' integer values by them in
integer lanes (`simd.q4_k_q8_block`, `simd.q6_k_q8_block`): 4x the multiply-adds an instruction, at an
error of up to half a step, 1/254 of each 256-value block's largest activation. `matmul` here is that
product for the K-quants llama.cpp's Q4_K_M files are made of (Q4_K, Q6_K), for decode and prompts
alike, and `matmul_q8_0` the product of Q8_0 and Q5_0 weights (which llama.cpp multiplies by x
rounded per 32 values, ggml's Q8_0, `quantize_q8_0`; Gemma 4's Q4_K_M files keep their 704- and
2112-column down projections in Q8_0 and Q5_0); `supports` says which block types are rounded,
`rounding` how. In weights="quantized-q8" (`ember.weights`) every
product of such a matrix goes here, whatever the number of rows, each row rounded and summed as it
would be alone; the other products stay float32 (`ember.quant.matrix`). The float32 parts around them
(attention) still sum in an order that depends on the batch, at the 1e-7 level, and a rounding step
can turn such a difference into a whole 8-bit step: on Gemma 3 270M (random tokens) batched and
one-at-a-time logits then differed by up to 6% of their largest value, where float32 keeps 1e-5.

Measured before it was written (Zen 3 EPYC, one thread, Qwen3-30B-A3B decode at 2.0 tokens/s): the
float32 kernels ran Q4_K at 9-11 G values/s and Q6_K at 5-6, at the cost of widening each byte to a
float lane, where llama.cpp's 8.6 tokens/s on two threads ran near memory bandwidth.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from ember.quant import kernels, simd
from ember.quant.jit import njit

BLOCK = 256  # values of x per scale (ggml's QK_K)
BLOCK_0 = 32  # ... for Q8_0 weights (ggml's QK8_0)
K_TYPES = (int(Q.Q4_K), int(Q.Q6_K))  # x rounded as ggml's Q8_K (`quantize_q8_k`)
Q4_K, Q6_K = K_TYPES
Q8_0, Q5_0 = int(Q.Q8_0), int(Q.Q5_0)  # x rounded as ggml's Q8_0 (`quantize_q8_0`)
TYPES = K_TYPES + (Q8_0, Q5_0)
AVAILABLE = simd.has_avx2()
# Rows asked for ahead of the one multiplied (`kernels.PREFETCH_ROWS`: 4 there). A token's Qwen3-30B-A3B
# experts on one Zen 3 thread, runs alternated, medians of 6: 159 ms at 4 rows ahead, 125 at 12 and at 32.
PREFETCH_ROWS = 12  # ... up to the end of the part, past the piece: the next piece is
# most often the same thread's (decode's experts: the threads start from opposite ends). Gemma-4-26B-A4B
# decode (2 threads, Zen 3 VM, alternated): 218-224 ms a token stopping at the piece's end, 211-213 past it.


def supports(ggml_type: int) -> bool:
    return ggml_type in TYPES


def rounding(ggml_type: int) -> str:
    """How x is rounded for a product with this block type: "q8_k" (256 values a scale) or "q8_0" (32)."""
    return "q8_0" if ggml_type in (Q8_0, Q5_0) else "q8_k"


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of x [T, columns] (columns a multiple of 32) as ggml-cpu's quantize_row_q8_0 rounds it
    on x86 at run time: per block of 32, m the largest magnitude, scale d = m/127 stored as f16,
    q = round-half-even(x·(127/m)) (0 for a block of zeros). Returns q [T, columns] int8 and the scales
    as float32 [T, columns/32] (the f16 values)."""
    values = np.empty(x.shape, np.int8)
    scales = np.empty((x.shape[0], x.shape[1] // BLOCK_0), np.float32)
    _round_q8_0(x, values, scales)
    return values, scales


@njit(nogil=True, cache=True)
def _round_q8_0(x, q8, scales):
    """`quantize_q8_0` into q8 and scales. In numba: the NumPy version took 25-35 µs a call, and
    Gemma-4-26B-A4B's decode rounds ~270 rows a token (each chosen expert's down projection its own)."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // BLOCK_0):
            start = b * BLOCK_0
            largest = np.float32(0.0)
            for i in range(start, start + BLOCK_0):
                largest = max(largest, abs(x[t, i]))
            scales[t, b] = simd.round_to_half(largest / np.float32(127.0))
            inverse = np.float32(127.0) / largest if largest != 0 else np.float32(0.0)
            for i in range(start, start + BLOCK_0):
                q8[t, i] = np.int8(np.rint(x[t, i] * inverse))


@njit(nogil=True, cache=True)
def quantize_q8_k(x, q8, scales, sums16, sums32):
    """Each row of x [T, columns] (columns a multiple of 256) as ggml's quantize_row_q8_K_ref rounds it:
    per block of 256, the value of largest magnitude m maps to −127 (iscale = −127/m, q =
    round-half-even(iscale·x), at most 127), scale 1/iscale (0 for a block of zeros); sums16/sums32 the
    sums of q over 16 and 32 values. One call for all the rows (a prefill's experts round ~1,000 rows a
    layer: one call each cost 0.2 s of Qwen3-30B-A3B's 10 s prefill in Python)."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // BLOCK):
            start = b * BLOCK
            largest = np.float32(0.0)
            magnitude = np.float32(0.0)
            for i in range(start, start + BLOCK):
                if abs(x[t, i]) > magnitude:
                    magnitude = abs(x[t, i])
                    largest = x[t, i]
            if magnitude == 0:
                scales[t, b] = 0.0
                for i in range(start, start + BLOCK):
                    q8[t, i] = 0
            else:
                iscale = np.float32(-127.0) / largest
                scales[t, b] = np.float32(1.0) / iscale
                for i in range(start, start + BLOCK):
                    q8[t, i] = min(127, np.int32(np.rint(iscale * x[t, i])))
            for k in range(BLOCK // 16):
                total = 0
                for i in range(start + 16 * k, start + 16 * k + 16):
                    total += np.int32(q8[t, i])
                sums16[t, b * 16 + k] = total
            for k in range(BLOCK // 32):
                sums32[t, b * 8 + k] = sums16[t, b * 16 + 2 * k] + sums16[t, b * 16 + 2 * k + 1]


@njit(inline="always")
def _block(q4, tokens, acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks):
    """`simd.q{4,6}_k_q8_block_<tokens>`: one super-block of a weight row w times `tokens` rows of x."""
    if q4:
        if tokens == 8:
            simd.q4_k_q8_block_8(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)
        elif tokens == 4:
            simd.q4_k_q8_block_4(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)
        elif tokens == 3:
            simd.q4_k_q8_block_3(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)
        elif tokens == 2:
            simd.q4_k_q8_block_2(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)
        else:
            simd.q4_k_q8_block_1(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)
    elif tokens == 8:
        simd.q6_k_q8_block_8(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)
    elif tokens == 4:
        simd.q6_k_q8_block_4(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)
    elif tokens == 3:
        simd.q6_k_q8_block_3(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)
    elif tokens == 2:
        simd.q6_k_q8_block_2(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)
    else:
        simd.q6_k_q8_block_1(acc, w, at, y, y_at, stride, sums, s_at, s_stride, xs, b, blocks)


@njit(nogil=True, fastmath=True, cache=True)
def matmul(qtypes, parts, offsets, q8, scales, sums16, sums32, out, state, piece, caller):
    """out[t, r] = Σ_c W[r, c]·x[t, c] for every row t of x, given rounded (`quantize_q8_k`, one row of
    q8/scales/sums16/sums32 per row of x, each C-contiguous), every part of W Q4_K or Q6_K. W stacked
    and shared among threads as `kernels.matvec` takes it (pieces of `piece` rows through `state`).
    A weight row's super-block is unpacked once for 8 rows of x (the last few: up to 4). Each output is
    summed in the same order whatever the number of rows of x: a row's values do not depend on its
    batch."""
    rows = offsets[-1]
    tokens, columns = q8.shape
    blocks = columns // BLOCK
    flat, xs = q8.reshape(-1), scales.reshape(-1)
    flat16, flat32 = sums16.reshape(-1), sums32.reshape(-1)
    stride16, stride32 = sums16.shape[1], sums32.shape[1]
    acc = np.empty(16 * 8, np.float32)
    buffer = np.empty((tokens, piece), np.float32)
    checked = 0
    while True:
        k, first, stop, checked = kernels.next_piece(state, piece, rows, caller, checked)
        if first >= rows:
            return
        target, shift = (out, 0) if caller else (buffer, first)
        for part in range(len(qtypes)):
            base = offsets[part] - shift
            start, end = kernels.part_rows(first, stop, offsets, part)
            data = parts[part]
            q4 = qtypes[part] == Q4_K
            block_bytes = 144 if q4 else 210
            sums, sums_stride, per_block = (flat32, stride32, 8) if q4 else (flat16, stride16, 16)
            if tokens == 1:  # decode: a loop of one primitive per type
                for r in range(start, end):
                    kernels.prefetch_ahead(data, r, len(data), PREFETCH_ROWS)
                    row = data[r]
                    acc[:16] = 0.0
                    if q4:
                        for b in range(blocks):
                            simd.q4_k_q8_block_1(acc, row, 144 * b, flat, BLOCK * b, columns, flat32, 8 * b,
                                                 stride32, xs, b, blocks)
                    else:
                        for b in range(blocks):
                            simd.q6_k_q8_block_1(acc, row, 210 * b, flat, BLOCK * b, columns, flat16, 16 * b,
                                                 stride16, xs, b, blocks)
                    target[0, base + r] = simd.sum_lanes16(acc, 0)
                continue
            for r in range(start, end):
                kernels.prefetch_ahead(data, r, len(data), PREFETCH_ROWS)
                row = data[r]
                t0 = 0
                while t0 < tokens:
                    count = 8 if tokens - t0 >= 8 else min(4, tokens - t0)
                    acc[:16 * count] = 0.0
                    for b in range(blocks):
                        at, y_at = b * block_bytes, t0 * columns + b * BLOCK
                        sums_at, xs_at = t0 * sums_stride + per_block * b, t0 * blocks + b
                        _block(q4, count, acc, row, at, flat, y_at, columns, sums, sums_at, sums_stride, xs,
                               xs_at, blocks)
                    for j in range(count):
                        target[t0 + j, base + r] = simd.sum_lanes16(acc, 16 * j)
                    t0 += count
        kernels.finish_piece(state, k, caller, buffer, out, first, stop)


@njit(inline="always")
def _block_0(eight, tokens, acc, w, at, y, y_at, stride, xs, xs_at, blocks):
    """`simd.q{8,5}_0_q8_block_<tokens>`: one block of a weight row w times `tokens` rows of x."""
    if eight:
        if tokens == 8:
            simd.q8_0_q8_block_8(acc, w, at, y, y_at, stride, xs, xs_at, blocks)
        elif tokens == 4:
            simd.q8_0_q8_block_4(acc, w, at, y, y_at, stride, xs, xs_at, blocks)
        elif tokens == 3:
            simd.q8_0_q8_block_3(acc, w, at, y, y_at, stride, xs, xs_at, blocks)
        elif tokens == 2:
            simd.q8_0_q8_block_2(acc, w, at, y, y_at, stride, xs, xs_at, blocks)
        else:
            simd.q8_0_q8_block_1(acc, w, at, y, y_at, stride, xs, xs_at, blocks)
    elif tokens == 8:
        simd.q5_0_q8_block_8(acc, w, at, y, y_at, stride, xs, xs_at, blocks)
    elif tokens == 4:
        simd.q5_0_q8_block_4(acc, w, at, y, y_at, stride, xs, xs_at, blocks)
    elif tokens == 3:
        simd.q5_0_q8_block_3(acc, w, at, y, y_at, stride, xs, xs_at, blocks)
    elif tokens == 2:
        simd.q5_0_q8_block_2(acc, w, at, y, y_at, stride, xs, xs_at, blocks)
    else:
        simd.q5_0_q8_block_1(acc, w, at, y, y_at, stride, xs, xs_at, blocks)


@njit(nogil=True, fastmath=True, cache=True)
def matmul_q8_0(qtypes, parts, offsets, q8, scales, out, state, piece, caller):
    """out[t, r] = Σ_c W[r, c]·x[t, c] for every row t of x, given rounded (`quantize_q8_0`: q8 and its
    block scales, C-contiguous), every part of W Q8_0 or Q5_0: per block of 32, the integer sum of w·y
    times the two scales (`simd.q8_0_q8_block_<n>`, `simd.q5_0_q8_block_<n>`), as
    ggml_vec_dot_q8_0_q8_0 / ggml_vec_dot_q5_0_q8_0. A block's values are formed once for 8 rows of x
    (the last few: up to 4), each row's blocks summed in 4 banks of 8 lanes (block b in bank b % 4: four
    independent chains of additions; one bank, as ggml, ran one row 3-10% slower),
    the same for any number of rows: a row's values do not depend on its batch. Shared as `matmul` is."""
    rows = offsets[-1]
    tokens, columns = q8.shape
    blocks = columns // BLOCK_0
    flat, xs = q8.reshape(-1), scales.reshape(-1)
    acc = np.empty(32 * 8, np.float32)  # row j of x, bank k: acc[32j + 8k : 32j + 8k + 8]
    buffer = np.empty((tokens, piece), np.float32)
    checked = 0
    while True:
        k, first, stop, checked = kernels.next_piece(state, piece, rows, caller, checked)
        if first >= rows:
            return
        target, shift = (out, 0) if caller else (buffer, first)
        for part in range(len(qtypes)):
            base = offsets[part] - shift
            start, end = kernels.part_rows(first, stop, offsets, part)
            data = parts[part]
            eight = qtypes[part] == Q8_0
            block_bytes = 34 if eight else 22  # an f16 scale, then 32 bytes / 4 bytes of high bits + 16
            for r in range(start, end):
                kernels.prefetch_ahead(data, r, len(data), PREFETCH_ROWS)
                row = data[r]
                t0 = 0
                while t0 < tokens:
                    count = 8 if tokens - t0 >= 8 else min(4, tokens - t0)
                    acc[:32 * count] = 0.0
                    for b in range(blocks):
                        at, y_at, xs_at = b * block_bytes, t0 * columns + b * BLOCK_0, t0 * blocks + b
                        if count == 1:  # decode: the primitive named, no dispatch on the row count
                            if eight:
                                simd.q8_0_q8_block_1(acc[(b & 3) * 8:], row, at, flat, y_at, columns, xs,
                                                     xs_at, blocks)
                            else:
                                simd.q5_0_q8_block_1(acc[(b & 3) * 8:], row, at, flat, y_at, columns, xs,
                                                     xs_at, blocks)
                        else:
                            _block_0(eight, count, acc[(b & 3) * 8:], row, at, flat, y_at, columns, xs, xs_at,
                                     blocks)
                    for j in range(count):
                        target[t0 + j, base + r] = (simd.sum_lanes16(acc, 32 * j)
                                                    + simd.sum_lanes16(acc, 32 * j + 16))
                    t0 += count
        kernels.finish_piece(state, k, caller, buffer, out, first, stop)
