"""numba kernels over GGUF-encoded weights: decode a row's blocks, multiply rows by activations.

Every block type has one decoder, `_decode_<type>(src, first_block, blocks, dst)`, that writes the
float32 values of `blocks` consecutive blocks of one row (starting at block `first_block`) into `dst`,
computed as ggml's `dequantize_row_*` computes them (same float32 operations in the same order, no
fused multiply-add), so they equal gguf-py's dequantization bit for bit (tests/test_quant.py).

The drivers dispatch on the type once per row segment:

* `dequantize_rows(qtype, data, row_ids, out)`: whole rows (embedding rows, prefill tiles).
* `matvec(qtype, data, x, out, ..., threads)`: out[r] = Σ_c W[r, c] · x[c] (decode). Each weight row
  is decoded into a per-thread buffer and multiplied by x there.

Why decode-then-multiply instead of one fused loop per type: measured on SmolLM2's Q4_1 matrices (one
thread, 2026-12-01), a row decoded into a buffer and then dotted ran as fast as a fused loop once both
loops have a trip count known only at run time (LLVM then vectorizes them with run-time alias checks;
with a constant 16 it unrolled them into scalar code and ran 3–5× slower). One decoder per type then
serves decode, prefill and embedding lookups alike.

f16 scales are read through a 65536-entry float32 table (numba has no float16 on the CPU).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# ggml type ids (gguf.GGMLQuantizationType values), as plain ints for the kernels.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30

# f16 bit pattern → float32 value
F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)

# Without "contract" LLVM keeps a·b + c as two roundings, as ggml's C and gguf-py's NumPy compute it.
EXACT = {"nnan", "ninf", "nsz", "arcp"}
# The products may be reassociated (vectorized sums) and fused: summation order is not specified.
FAST = True


@njit(inline="always")
def _f16(table: np.ndarray, src: np.ndarray, at: int) -> np.float32:
    return table[np.int64(src[at]) | (np.int64(src[at + 1]) << 8)]


@njit(inline="always")
def _u32(src: np.ndarray, at: int) -> np.int64:
    return (np.int64(src[at]) | (np.int64(src[at + 1]) << 8) | (np.int64(src[at + 2]) << 16)
            | (np.int64(src[at + 3]) << 24))


# ------------------------------------------------------------------------------ 32-value blocks


@njit(fastmath=EXACT)
def _decode_q4_0(src, first, blocks, dst, table, half):
    # 18 bytes: d (f16), 16 bytes of nibbles; value j = (low nibble − 8)·d, value j+16 = (high − 8)·d
    for b in range(blocks):
        at = (first + b) * 18
        d = _f16(table, src, at)
        out = b * 32
        for j in range(half):
            q = np.int32(src[at + 2 + j])
            dst[out + j] = np.float32((q & 0xF) - 8) * d
            dst[out + half + j] = np.float32((q >> 4) - 8) * d


@njit(fastmath=EXACT)
def _decode_q4_1(src, first, blocks, dst, table, half):
    # 20 bytes: d, m (f16), 16 bytes of nibbles; value = nibble·d + m
    for b in range(blocks):
        at = (first + b) * 20
        d = _f16(table, src, at)
        m = _f16(table, src, at + 2)
        out = b * 32
        for j in range(half):
            q = np.int32(src[at + 4 + j])
            dst[out + j] = np.float32(q & 0xF) * d + m
            dst[out + half + j] = np.float32(q >> 4) * d + m


@njit(fastmath=EXACT)
def _decode_q5_0(src, first, blocks, dst, table, half):
    # 22 bytes: d, 32 high bits (u32), 16 bytes of nibbles; value = ((nibble | high << 4) − 16)·d
    for b in range(blocks):
        at = (first + b) * 22
        d = _f16(table, src, at)
        high = _u32(src, at + 2)
        out = b * 32
        for j in range(half):
            q = np.int64(src[at + 6 + j])
            low_high = ((high >> j) << 4) & 0x10
            high_high = (high >> (j + 12)) & 0x10
            dst[out + j] = np.float32(((q & 0xF) | low_high) - 16) * d
            dst[out + half + j] = np.float32(((q >> 4) | high_high) - 16) * d


@njit(fastmath=EXACT)
def _decode_q5_1(src, first, blocks, dst, table, half):
    # 24 bytes: d, m, 32 high bits, 16 bytes of nibbles; value = (nibble | high << 4)·d + m
    for b in range(blocks):
        at = (first + b) * 24
        d = _f16(table, src, at)
        m = _f16(table, src, at + 2)
        high = _u32(src, at + 4)
        out = b * 32
        for j in range(half):
            q = np.int64(src[at + 8 + j])
            low_high = ((high >> j) << 4) & 0x10
            high_high = (high >> (j + 12)) & 0x10
            dst[out + j] = np.float32((q & 0xF) | low_high) * d + m
            dst[out + half + j] = np.float32((q >> 4) | high_high) * d + m


@njit(fastmath=EXACT)
def _decode_q8_0(src, first, blocks, dst, table, count):
    # 34 bytes: d, 32 signed bytes; value = q·d
    for b in range(blocks):
        at = (first + b) * 34
        d = _f16(table, src, at)
        out = b * 32
        for j in range(count):
            dst[out + j] = np.float32(np.int8(src[at + 2 + j])) * d


# ------------------------------------------------------------------------------ 256-value super-blocks


@njit(inline="always")
def _scale_min_k4(j, src, at):
    """Scale and min of sub-block j from the 12 packed 6-bit bytes at `at` (Q4_K, Q5_K)."""
    if j < 4:
        return np.int32(src[at + j] & 63), np.int32(src[at + j + 4] & 63)
    scale = (src[at + j + 4] & 0xF) | ((src[at + j - 4] >> 6) << 4)
    minimum = (src[at + j + 4] >> 4) | ((src[at + j] >> 6) << 4)
    return np.int32(scale), np.int32(minimum)


@njit(fastmath=EXACT)
def _decode_q4_k(src, first, blocks, dst, table, count):
    # 144 bytes: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles. Four chunks of 64
    # values: 32 bytes whose low nibbles are sub-block 2c and high nibbles sub-block 2c+1.
    for b in range(blocks):
        at = (first + b) * 144
        d = _f16(table, src, at)
        dmin = _f16(table, src, at + 2)
        for c in range(4):
            scale1, min1 = _scale_min_k4(2 * c, src, at + 4)
            scale2, min2 = _scale_min_k4(2 * c + 1, src, at + 4)
            d1, m1 = d * np.float32(scale1), dmin * np.float32(min1)
            d2, m2 = d * np.float32(scale2), dmin * np.float32(min2)
            qs = at + 16 + 32 * c
            out = b * 256 + 64 * c
            for j in range(count):
                q = np.int32(src[qs + j])
                dst[out + j] = d1 * np.float32(q & 0xF) - m1
                dst[out + count + j] = d2 * np.float32(q >> 4) - m2


@njit(fastmath=EXACT)
def _decode_q5_k(src, first, blocks, dst, table, count):
    # 176 bytes: d, dmin, 12 bytes of scales/mins, 32 bytes of high bits, 128 bytes of nibbles.
    for b in range(blocks):
        at = (first + b) * 176
        d = _f16(table, src, at)
        dmin = _f16(table, src, at + 2)
        for c in range(4):
            scale1, min1 = _scale_min_k4(2 * c, src, at + 4)
            scale2, min2 = _scale_min_k4(2 * c + 1, src, at + 4)
            d1, m1 = d * np.float32(scale1), dmin * np.float32(min1)
            d2, m2 = d * np.float32(scale2), dmin * np.float32(min2)
            qs = at + 48 + 32 * c
            bit1, bit2 = 1 << (2 * c), 2 << (2 * c)
            out = b * 256 + 64 * c
            for j in range(count):
                q = np.int32(src[qs + j])
                high = np.int32(src[at + 16 + j])
                dst[out + j] = d1 * np.float32((q & 0xF) + (16 if high & bit1 else 0)) - m1
                dst[out + count + j] = d2 * np.float32((q >> 4) + (16 if high & bit2 else 0)) - m2


@njit(fastmath=EXACT)
def _decode_q6_k(src, first, blocks, dst, table, count):
    # 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed scales, d. Two halves of
    # 128 values; in each, byte j gives values j, j+32, j+64, j+96 (scales change every 16 values).
    for b in range(blocks):
        at = (first + b) * 210
        d = _f16(table, src, at + 208)
        for h in range(2):
            low = at + 64 * h
            high = at + 128 + 32 * h
            scales = at + 192 + 8 * h
            out = b * 256 + 128 * h
            for part in range(2):
                s1 = d * np.float32(np.int8(src[scales + part]))
                s2 = d * np.float32(np.int8(src[scales + part + 2]))
                s3 = d * np.float32(np.int8(src[scales + part + 4]))
                s4 = d * np.float32(np.int8(src[scales + part + 6]))
                for i in range(count):
                    j = 16 * part + i
                    ql1 = np.int32(src[low + j])
                    ql2 = np.int32(src[low + j + 32])
                    qh = np.int32(src[high + j])
                    dst[out + j] = s1 * np.float32(((ql1 & 0xF) | ((qh & 3) << 4)) - 32)
                    dst[out + j + 32] = s2 * np.float32(((ql2 & 0xF) | (((qh >> 2) & 3) << 4)) - 32)
                    dst[out + j + 64] = s3 * np.float32(((ql1 >> 4) | (((qh >> 4) & 3) << 4)) - 32)
                    dst[out + j + 96] = s4 * np.float32(((ql2 >> 4) | (((qh >> 6) & 3) << 4)) - 32)


# ------------------------------------------------------------------------------ 16-bit floats


@njit(fastmath=EXACT)
def _decode_f16(src, first, count, dst, table, unused):
    # src holds 2 bytes a value; `first`/`count` are in values here (a block is one value)
    for i in range(count):
        dst[i] = _f16(table, src, 2 * (first + i))


@njit(fastmath=EXACT)
def _decode_bf16(src, first, count, dst, table, unused):
    # bfloat16 is the top half of a float32: shift it back up (the float32 bits are written as uint32)
    bits = dst.view(np.uint32)
    for i in range(count):
        at = 2 * (first + i)
        bits[i] = (np.uint32(src[at]) << 16) | (np.uint32(src[at + 1]) << 24)


@njit(fastmath=EXACT)
def _decode_f32(src, first, count, dst, table, unused):
    values = src.view(np.float32)
    for i in range(count):
        dst[i] = values[first + i]


# ------------------------------------------------------------------------------ dispatch


@njit(inline="always")
def block_values(qtype: int) -> int:
    if qtype in (Q4_K, Q5_K, Q6_K):
        return 256
    if qtype in (F32, F16, BF16):
        return 1
    return 32


@njit(inline="always")
def _decode(qtype, src, first, blocks, dst, table, half):
    """Decode `blocks` blocks of one row from block `first` into dst[: blocks·block_values].

    `half` is always 16, passed in at run time by the callers: with a loop bound LLVM can see, it
    unrolls the 16-iteration loops into scalar code instead of vectorizing them (measured on Q4_1:
    1.4 G values/s unrolled, 4.6 G values/s vectorized, one thread).
    """
    if qtype == Q4_K:
        _decode_q4_k(src, first, blocks, dst, table, 2 * half)
    elif qtype == Q6_K:
        _decode_q6_k(src, first, blocks, dst, table, half)
    elif qtype == Q5_K:
        _decode_q5_k(src, first, blocks, dst, table, 2 * half)
    elif qtype == Q8_0:
        _decode_q8_0(src, first, blocks, dst, table, 2 * half)
    elif qtype == Q4_0:
        _decode_q4_0(src, first, blocks, dst, table, half)
    elif qtype == Q4_1:
        _decode_q4_1(src, first, blocks, dst, table, half)
    elif qtype == Q5_0:
        _decode_q5_0(src, first, blocks, dst, table, half)
    elif qtype == Q5_1:
        _decode_q5_1(src, first, blocks, dst, table, half)
    elif qtype == F16:
        _decode_f16(src, first, blocks, dst, table, 0)
    elif qtype == BF16:
        _decode_bf16(src, first, blocks, dst, table, 0)
    elif qtype == F32:
        _decode_f32(src, first, blocks, dst, table, 0)


@njit(parallel=True, fastmath=EXACT, cache=True)
def dequantize_rows(qtype, data, row_ids, out, table, half):
    """out[i] = row row_ids[i] of the encoded matrix `data` ([rows, bytes per row] uint8)."""
    block = block_values(qtype)
    blocks = out.shape[1] // block
    for i in prange(row_ids.shape[0]):
        _decode(qtype, data[row_ids[i]], 0, blocks, out[i], table, half)


@njit(parallel=True, fastmath=EXACT, cache=True)
def dequantize_range(qtype, data, first_row, out, table, half):
    """out[i] = row first_row + i of `data`, for every row of out (a tile of consecutive rows)."""
    block = block_values(qtype)
    blocks = out.shape[1] // block
    for i in prange(out.shape[0]):
        _decode(qtype, data[first_row + i], 0, blocks, out[i], table, half)


@njit(parallel=True, fastmath=FAST, cache=True)
def matvec(qtype, data, x, out, table, half, threads):
    """out[r] = Σ_c W[r, c]·x[c] for every row r of W (`data`): decode's matrix-vector product.

    Each thread takes an equal share of consecutive rows and decodes one row at a time into its own
    buffer (a 14336-value row is 56 KB: it stays in L2), then multiplies it by x there. (Decoding a long
    row in L1-sized segments instead measured 3× slower: LLVM then kept the decoders scalar.)
    """
    rows = data.shape[0]
    columns = x.shape[0]
    blocks = columns // block_values(qtype)
    workers = max(1, min(threads, rows))  # numba.get_num_threads() here would make it uncacheable
    for worker in prange(workers):
        values = np.empty(columns, np.float32)
        for r in range(rows * worker // workers, rows * (worker + 1) // workers):
            _decode(qtype, data[r], 0, blocks, values, table, half)
            total = np.float32(0.0)
            for i in range(columns):
                total += values[i] * x[i]
            out[r] = total
