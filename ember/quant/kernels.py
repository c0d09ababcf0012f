"""numba kernels over GGUF-encoded weights: decode a row's blocks, multiply rows by activations.

Every block type is one record (`ember.quant.blocks.BlockType`), declared below with its two kernels:

* `decode(src, first, blocks, dst, table, half)` writes the float32 values of `blocks` consecutive
  blocks of one row (starting at block `first`) into `dst`, computed as ggml's `dequantize_row_*`
  computes them (same float32 operations in the same order, no fused multiply-add), so they equal
  gguf-py's dequantization bit for bit (tests/test_quant.py).
* `dot(src, columns, x, ...)`: Σ_c W[r, c]·x[c] for one row, straight from its blocks, with the 16-lane
  primitives of `simd.py`.

The drivers dispatch on the type once per row segment, through `_decode`, `_rows_dot` and
`block_values`, which `blocks.switch` generates from the records:

* `dequantize_rows(qtype, data, row_ids, out)` and `dequantize_tile(qtype, data, first_row, out)`: whole
  rows (embedding rows; prefill tiles).
* `matvec(qtypes, parts, offsets, x, out, ...)`: out[r] = Σ_c W[r, c] · x[c] (decode), W one matrix or
  several stacked, multiplied with the `dot` kernels.
* `matmul_rows(...)`: the same for a few rows of x (short prompts): each weight row decoded once.

None of them starts threads: each runs in its caller's thread without the GIL, and the threads that
share a product (`matrix._on_threads`, on `ember.parallel`'s threads) each call it, the rows taken in
small pieces through an atomic counter (`simd.claim`) rather than as fixed shares (numba's prange); a
helper publishes each piece it computed unless the caller has taken it back (`share_state`).

The decoders serve prefill (tiles for BLAS) and embedding lookups; decode's products do not decode
rows into memory first: with the primitives they ran 2.5–4× faster than decoding a row and dotting it.

f16 scales are read through a 65536-entry float32 table (numba has no float16 on the CPU).

The records live in this file on purpose: numba keys its on-disk cache of the drivers on this file, so
changing a record (or adding one) recompiles them.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from ember.parallel import COPYING, DONE, OPEN, TAKEN
from ember.quant import simd
from ember.quant.blocks import BLOCK_TYPES, BlockType, seal, switch
from ember.quant.jit import njit

# f16 bit pattern → float32 value
F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)

# Without "contract" LLVM keeps a·b + c as two roundings, as ggml's C and gguf-py's NumPy compute it.
EXACT = {"nnan", "ninf", "nsz", "arcp"}
# The products may be reassociated (vectorized sums) and fused: summation order is not specified.
FAST = True
# Accumulators of a row · vector product: 8 banks of 16 lanes, so consecutive primitives add into
# different banks instead of waiting on each other's store, then 16 lanes where the K-quants add their
# blocks' minimums or offsets times the sums of x (summed with the rest at the end of the row).
OFFSET_LANES = simd.OFFSET_LANES
ACC_LANES = OFFSET_LANES + 16


@njit(inline="always")
def _f16(table: np.ndarray, src: np.ndarray, at: int) -> np.float32:
    return table[np.int64(src[at]) | (np.int64(src[at + 1]) << 8)]


@njit(inline="always")
def _f16_value(src, i):
    """The f16 at element i of src (2 bytes a value), from its bits: exponent rebased by 2^112."""
    bits = np.empty(1, np.uint32)
    h = np.uint32(src[2 * i]) | (np.uint32(src[2 * i + 1]) << 8)
    bits[0] = ((h & 0x8000) << 16) | ((h & 0x7FFF) << 13)
    return bits.view(np.float32)[0] * np.float32(5.192296858534828e33)


@njit(inline="always")
def _u32(src: np.ndarray, at: int) -> np.int64:
    return (np.int64(src[at]) | (np.int64(src[at + 1]) << 8) | (np.int64(src[at + 2]) << 16)
            | (np.int64(src[at + 3]) << 24))


# ------------------------------------------------------------------------------ block types
#
# One record per block type (`ember.quant.blocks`): its decoder and its row · vector product.
#
# The products use the 16-lane primitives of `ember.quant.simd`. A block's scale multiplies its 16
# products lane by lane (so no sum is formed per block); a block's offset or minimum (Q4_1's m, Q4_0's
# −8, the K-quants' mins) multiplies the sum of its x values, summed once per call (`sums16[k]` =
# x[16k] + … + x[16k+15], `sums32[k]` the sums of 32). The lanes are added up once per row.


class Q4_0(BlockType, qtype=Q.Q4_0):
    """18 bytes: d (f16), 16 bytes of nibbles; value j = (low nibble − 8)·d, j+16 = (high nibble − 8)·d."""
    f16_fields = (0,)

    @njit(fastmath=EXACT)
    def decode(src, first, blocks, dst, table, half):
        for b in range(blocks):
            at = (first + b) * 18
            d = _f16(table, src, at)
            out = b * 32
            for j in range(half):
                q = np.int32(src[at + 2 + j])
                dst[out + j] = np.float32((q & 0xF) - 8) * d
                dst[out + half + j] = np.float32((q >> 4) - 8) * d

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        offset = np.float32(0.0)
        for b in range(columns // 32):
            at, xb = b * 18, b * 32
            d = _f16(table, src, at)
            simd.fma_nibbles(acc, 32 * (b & 1), src, at + 2, x, xb, xb + 16, d, d)
            offset -= np.float32(8.0) * d * (sums16[2 * b] + sums16[2 * b + 1])
        return offset


class Q4_1(BlockType, qtype=Q.Q4_1):
    """20 bytes: d, m (f16), 16 bytes of nibbles; value = nibble·d + m."""
    f16_fields = (0, 2)

    @njit(fastmath=EXACT)
    def decode(src, first, blocks, dst, table, half):
        for b in range(blocks):
            at = (first + b) * 20
            d = _f16(table, src, at)
            m = _f16(table, src, at + 2)
            out = b * 32
            for j in range(half):
                q = np.int32(src[at + 4 + j])
                dst[out + j] = np.float32(q & 0xF) * d + m
                dst[out + half + j] = np.float32(q >> 4) * d + m

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        offset = np.float32(0.0)
        for b in range(columns // 32):
            at, xb = b * 20, b * 32
            d = _f16(table, src, at)
            simd.fma_nibbles(acc, 32 * (b & 1), src, at + 4, x, xb, xb + 16, d, d)
            offset += _f16(table, src, at + 2) * (sums16[2 * b] + sums16[2 * b + 1])
        return offset


class Q5_0(BlockType, qtype=Q.Q5_0):
    """22 bytes: d, 32 high bits (u32), 16 bytes of nibbles; value = ((nibble | high << 4) − 16)·d."""
    f16_fields = (0,)

    @njit(fastmath=EXACT)
    def decode(src, first, blocks, dst, table, half):
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

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        offset = np.float32(0.0)
        for b in range(columns // 32):
            at, xb = b * 22, b * 32
            d = _f16(table, src, at)
            high = _u32(src, at + 2)
            simd.fma_nibbles_word_bits(acc, 32 * (b & 1), src, at + 6, high, x, xb, xb + 16, d, d)
            offset -= np.float32(16.0) * d * (sums16[2 * b] + sums16[2 * b + 1])
        return offset


class Q5_1(BlockType, qtype=Q.Q5_1):
    """24 bytes: d, m, 32 high bits, 16 bytes of nibbles; value = (nibble | high << 4)·d + m."""
    f16_fields = (0, 2)

    @njit(fastmath=EXACT)
    def decode(src, first, blocks, dst, table, half):
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

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        offset = np.float32(0.0)
        for b in range(columns // 32):
            at, xb = b * 24, b * 32
            d = _f16(table, src, at)
            high = _u32(src, at + 4)
            simd.fma_nibbles_word_bits(acc, 32 * (b & 1), src, at + 8, high, x, xb, xb + 16, d, d)
            offset += _f16(table, src, at + 2) * (sums16[2 * b] + sums16[2 * b + 1])
        return offset


class Q8_0(BlockType, qtype=Q.Q8_0):
    """34 bytes: d, 32 signed bytes; value = q·d."""
    f16_fields = (0,)

    @njit(fastmath=EXACT)
    def decode(src, first, blocks, dst, table, half):
        count = 2 * half
        for b in range(blocks):
            at = (first + b) * 34
            d = _f16(table, src, at)
            out = b * 32
            for j in range(count):
                dst[out + j] = np.float32(np.int8(src[at + 2 + j])) * d

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        for b in range(columns // 32):
            at, xb = b * 34, b * 32
            d = _f16(table, src, at)
            bank = 32 * (b & 1)
            simd.fma_signed_bytes(acc, bank, src, at + 2, x, xb, d)
            simd.fma_signed_bytes(acc, bank + 16, src, at + 18, x, xb + 16, d)
        return np.float32(0.0)


# MXFP4 (gpt-oss's experts): e2m1 codes → their values doubled (gguf-py's `MXFP4.kvalues`), and an e8m0
# exponent byte → half its power of two, 2^(e − 128) (`ggml_e8m0_to_fp32_half`: bits 0x00200000 << e
# for e < 2, (e − 1) << 23 from 2 on; e = 0 and 1 give subnormals).
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
_EXPONENTS = np.arange(256, dtype=np.uint32)
E8M0_HALF = np.where(_EXPONENTS < 2, np.uint32(0x00200000) << _EXPONENTS,
                     (_EXPONENTS - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)


class MXFP4(BlockType, qtype=Q.MXFP4):
    """17 bytes: e (e8m0), 16 bytes of e2m1 nibbles; value j = E2M1_DOUBLED[low nibble]·half(e),
    j+16 = E2M1_DOUBLED[high nibble]·half(e) (OCP microscaling, as ggml stores it)."""

    @njit(fastmath=EXACT)
    def decode(src, first, blocks, dst, table, half):
        for b in range(blocks):
            at = (first + b) * 17
            d = E8M0_HALF[src[at]]
            out = b * 32
            for j in range(half):
                q = np.int32(src[at + 1 + j])
                dst[out + j] = d * E2M1_DOUBLED[q & 0xF]
                dst[out + half + j] = d * E2M1_DOUBLED[q >> 4]

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        for b in range(columns // 32):
            at, xb = b * 17, b * 32
            simd.fma_e2m1(acc, 32 * (b & 1), src, at + 1, x, xb, xb + 16, E8M0_HALF[src[at]])
        return np.float32(0.0)


@njit(inline="always")
def _scale_min_k4(j, src, at):
    """Scale and min of sub-block j from the 12 packed 6-bit bytes at `at` (Q4_K, Q5_K)."""
    if j < 4:
        return np.int32(src[at + j] & 63), np.int32(src[at + j + 4] & 63)
    scale = (src[at + j + 4] & 0xF) | ((src[at + j - 4] >> 6) << 4)
    minimum = (src[at + j + 4] >> 4) | ((src[at + j] >> 6) << 4)
    return np.int32(scale), np.int32(minimum)


@njit(inline="always")
def _chunk_scales(src, at, c, d, dmin):
    """d·scale, dmin·min of sub-block 2c, then of 2c+1, of the Q4_K/Q5_K super-block at `at`."""
    scale1, min1 = _scale_min_k4(2 * c, src, at + 4)
    scale2, min2 = _scale_min_k4(2 * c + 1, src, at + 4)
    return d * np.float32(scale1), dmin * np.float32(min1), d * np.float32(scale2), dmin * np.float32(min2)


class Q4_K(BlockType, qtype=Q.Q4_K):
    """144 bytes: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles. Four chunks of 64
    values: 32 bytes whose low nibbles are sub-block 2c and high nibbles sub-block 2c+1."""
    f16_fields = (0, 2)

    @njit(fastmath=EXACT)
    def decode(src, first, blocks, dst, table, half):
        count = 2 * half
        for b in range(blocks):
            at = (first + b) * 144
            d = _f16(table, src, at)
            dmin = _f16(table, src, at + 2)
            for c in range(4):
                d1, m1, d2, m2 = _chunk_scales(src, at, c, d, dmin)
                qs = at + 16 + 32 * c
                out = b * 256 + 64 * c
                for j in range(0, count, 16):  # 16 bytes at a time, as 16-lane vectors
                    simd.decode_nibbles(dst, out + j, out + count + j, src, qs + j, d1, m1, d2, m2)

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        for b in range(columns // 256):
            at = b * 144
            simd.fma_q4_k_block(acc, src, at, x, 256 * b, _f16(table, src, at), _f16(table, src, at + 2),
                                sums32, 8 * b)
        return np.float32(0.0)


class Q5_K(BlockType, qtype=Q.Q5_K):
    """176 bytes: d, dmin, 12 bytes of scales/mins, 32 bytes of high bits, 128 bytes of nibbles."""
    f16_fields = (0, 2)

    @njit(fastmath=EXACT)
    def decode(src, first, blocks, dst, table, half):
        count = 2 * half
        for b in range(blocks):
            at = (first + b) * 176
            d = _f16(table, src, at)
            dmin = _f16(table, src, at + 2)
            for c in range(4):
                d1, m1, d2, m2 = _chunk_scales(src, at, c, d, dmin)
                qs = at + 48 + 32 * c
                bit1, bit2 = 1 << (2 * c), 2 << (2 * c)
                out = b * 256 + 64 * c
                for j in range(count):
                    q = np.int32(src[qs + j])
                    high = np.int32(src[at + 16 + j])
                    dst[out + j] = d1 * np.float32((q & 0xF) + (16 if high & bit1 else 0)) - m1
                    dst[out + count + j] = d2 * np.float32((q >> 4) + (16 if high & bit2 else 0)) - m2

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        for b in range(columns // 256):
            at = b * 176
            simd.fma_q5_k_block(acc, src, at, x, 256 * b, _f16(table, src, at), _f16(table, src, at + 2),
                                sums32, 8 * b)
        return np.float32(0.0)


class Q6_K(BlockType, qtype=Q.Q6_K):
    """210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed scales, d. Two halves of
    128 values; in each, byte j gives values j, j+32, j+64, j+96 (scales change every 16 values)."""
    f16_fields = (208,)

    @njit(fastmath=EXACT)
    def decode(src, first, blocks, dst, table, half):
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
                    j = 16 * part  # columns j … j+15 of each quarter, as 16-lane vectors
                    simd.decode_six_bits(dst, out + j, src, low + j, high + j, s1, s2, s3, s4)

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        for b in range(columns // 256):
            at = b * 210
            # scale k (= 8·half + part + 2·quarter below) covers x[16k…16k+15] of the block: −32·scale·Σx
            simd.signed_scales(src, at + 192, _f16(table, src, at + 208), scales)
            simd.fma_products16(acc, OFFSET_LANES, scales, 0, sums16, 16 * b, -32.0)
            simd.fma_q6_k_block(acc, src, at, x, 256 * b, _f16(table, src, at + 208))
        return np.float32(0.0)


# The float types: a block is one value; src holds 2 (or 4) bytes a value.


class F16(BlockType, qtype=Q.F16):
    """IEEE half precision."""

    @njit(fastmath=EXACT)
    def decode(src, first, count, dst, table, half):
        for i in range(count):
            dst[i] = _f16(table, src, 2 * (first + i))

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        for i in range(0, columns - columns % 16, 16):
            simd.fma_half_floats(acc, (i >> 4 & 3) * 16, src, 2 * i, x, i)
        tail = np.float32(0.0)
        for i in range(columns - columns % 16, columns):
            tail += _f16_value(src, i) * x[i]
        return tail


class BF16(BlockType, qtype=Q.BF16):
    """bfloat16: the top half of a float32."""

    @njit(fastmath=EXACT)
    def decode(src, first, count, dst, table, half):
        bits = dst.view(np.uint32)  # shifted back up, the float32 bits written as uint32
        for i in range(count):
            at = 2 * (first + i)
            bits[i] = (np.uint32(src[at]) << 16) | (np.uint32(src[at + 1]) << 24)

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        for i in range(0, columns - columns % 16, 16):
            simd.fma_brain_floats(acc, (i >> 4 & 3) * 16, src, 2 * i, x, i)
        tail = np.float32(0.0)
        bits = np.empty(1, np.uint32)
        for i in range(columns - columns % 16, columns):
            bits[0] = (np.uint32(src[2 * i]) << 16) | (np.uint32(src[2 * i + 1]) << 24)
            tail += bits.view(np.float32)[0] * x[i]
        return tail


class F32(BlockType, qtype=Q.F32):
    """IEEE single precision (the engine gives F32 weights to BLAS; a stack may still hold one)."""

    @njit(fastmath=EXACT)
    def decode(src, first, count, dst, table, half):
        values = src.view(np.float32)
        for i in range(count):
            dst[i] = values[first + i]

    @njit(inline="always")
    def dot(src, columns, x, sums16, sums32, scales, acc, table):
        values = src.view(np.float32)
        total = np.float32(0.0)
        for i in range(columns):
            total += values[i] * x[i]
        return total


# ------------------------------------------------------------------------------ dispatch
#
# Generated from the records (`blocks.switch`): one branch per block type, its type id a literal.

block_values = switch("block_values", "", "return {values}", BLOCK_TYPES.values(), default="return 1")

# `_decode(qtype, src, first, blocks, dst, table, half)`: decode `blocks` blocks of one row from block
# `first` into dst[: blocks·block_values]. `half` is always 16, passed in at run time by the callers:
# with a loop bound LLVM can see, it unrolls the 16-iteration loops into scalar code instead of
# vectorizing them (measured on Q4_1: 1.4 G values/s unrolled, 4.6 G values/s vectorized, one thread).
_decode = switch("_decode", "src, first, blocks, dst, table, half",
                 "{decode}(src, first, blocks, dst, table, half)", BLOCK_TYPES.values())


@njit(nogil=True, fastmath=EXACT, cache=True)
def dequantize_rows(qtype, data, row_ids, out, table, half):
    """out[i] = row row_ids[i] of the encoded matrix `data` ([rows, bytes per row] uint8): embedding
    lookups, a few rows at a time."""
    block = block_values(qtype)
    blocks = out.shape[1] // block
    for i in range(row_ids.shape[0]):
        _decode(qtype, data[row_ids[i]], 0, blocks, out[i], table, half)


@njit(nogil=True, fastmath=EXACT, cache=True)
def dequantize_tile(qtype, data, first_row, out, table, half):
    """out[i] = row first_row + i of `data`, for every row of out (a tile of consecutive rows), in the
    calling thread, without the GIL: prefill's threads each decode their own tiles at once
    (`matrix.QuantizedMatrix.matmul`)."""
    block = block_values(qtype)
    blocks = out.shape[1] // block
    for i in range(out.shape[0]):
        _decode(qtype, data[first_row + i], 0, blocks, out[i], table, half)


@njit(nogil=True, fastmath=FAST, cache=True)
def transpose_tokens(x, xt):
    """xt[c, t] = x[t, c] for x [tokens, columns]; xt [columns, padded] has its columns past the tokens
    set to zero (prefill's tile product reads whole 16-token vectors)."""
    tokens, columns = x.shape
    padded = xt.shape[1]
    for c0 in range(0, columns, 64):  # 64 columns of x at a time: 64 rows of xt written in step
        c1 = min(c0 + 64, columns)
        for t in range(tokens):
            for c in range(c0, c1):
                xt[c, t] = x[t, c]
    for c in range(columns):
        for t in range(tokens, padded):
            xt[c, t] = 0.0


# Columns of the tile multiplied at a time: a block's 256 columns of xt (64 KB at 64 tokens) stay in
# the caches while it runs over the tile's rows. Over all the columns at once a 256 × 8192 tile at 128
# tokens ran at 48 GFLOP/s, by 256 at 162 (one Xeon core).
TILE_DEPTH = 256


@njit(inline="always")
def _tile_rows_block(rows, partial, partial_at, out, out_at, out_stride, tokens, a, a_at, columns, b,
                     padded, c0, depth, start, finish):
    """tile_product's blocks for `rows` (6 or 4) tile rows: 64 tokens a block, then 48, 32 or 16."""
    t0 = 0
    while t0 < padded:
        width = padded - t0
        left = tokens - t0
        at = out_at + t0 * out_stride
        sums = partial_at + rows * t0
        if rows == 6:
            if width >= 64:
                simd.tile_block_6x4(partial, sums, out, at, out_stride, left, a, a_at, columns, b,
                                    c0 * padded + t0, padded, depth, start, finish)
                t0 += 64
            elif width == 48:
                simd.tile_block_6x3(partial, sums, out, at, out_stride, left, a, a_at, columns, b,
                                    c0 * padded + t0, padded, depth, start, finish)
                t0 += 48
            elif width == 32:
                simd.tile_block_6x2(partial, sums, out, at, out_stride, left, a, a_at, columns, b,
                                    c0 * padded + t0, padded, depth, start, finish)
                t0 += 32
            else:
                simd.tile_block_6x1(partial, sums, out, at, out_stride, left, a, a_at, columns, b,
                                    c0 * padded + t0, padded, depth, start, finish)
                t0 += 16
        else:
            if width >= 64:
                simd.tile_block_4x4(partial, sums, out, at, out_stride, left, a, a_at, columns, b,
                                    c0 * padded + t0, padded, depth, start, finish)
                t0 += 64
            elif width == 48:
                simd.tile_block_4x3(partial, sums, out, at, out_stride, left, a, a_at, columns, b,
                                    c0 * padded + t0, padded, depth, start, finish)
                t0 += 48
            elif width == 32:
                simd.tile_block_4x2(partial, sums, out, at, out_stride, left, a, a_at, columns, b,
                                    c0 * padded + t0, padded, depth, start, finish)
                t0 += 32
            else:
                simd.tile_block_4x1(partial, sums, out, at, out_stride, left, a, a_at, columns, b,
                                    c0 * padded + t0, padded, depth, start, finish)
                t0 += 16


@njit(nogil=True, fastmath=FAST, cache=True)
def tile_product(tile, xt, tokens, partial, out, out_at, out_stride):
    """out[out_at + t·out_stride + r] = Σ_c tile[r, c]·xt[c, t] for every row r of a decoded prefill tile
    [rows, columns] and t < tokens: x · tileᵀ written straight into its columns of the output (`out` the
    output's rows as one flat array, `out_stride` values apart). xt is x transposed, [columns, padded],
    padded a multiple of 16 (`transpose_tokens`); partial is scratch of at least rows·padded values.

    TILE_DEPTH columns at a time, in register blocks of 6 rows × 64 tokens (`simd.tile_block_6x4`),
    the sums so far kept in `partial` between them: each output a sum over c in order, multiplied and
    added in float32 (fused), the float32 product up to summation order. Measured on one Xeon core
    against single-threaded OpenBLAS 0.3.31 on the same operands: `benchmarks.tile_product`.
    """
    rows, columns = tile.shape
    padded = xt.shape[1]
    a = tile.reshape(-1)
    b = xt.reshape(-1)
    for c0 in range(0, columns, TILE_DEPTH):
        depth = min(TILE_DEPTH, columns - c0)
        start = 1 if c0 == 0 else 0
        finish = 1 if c0 + depth == columns else 0
        r = 0
        while r < rows:
            left = rows - r
            if left >= 6 and left != 8:
                _tile_rows_block(6, partial, r * padded, out, out_at + r, out_stride, tokens, a,
                                 r * columns + c0, columns, b, padded, c0, depth, start, finish)
                r += 6
            elif left >= 4:
                _tile_rows_block(4, partial, r * padded, out, out_at + r, out_stride, tokens, a,
                                 r * columns + c0, columns, b, padded, c0, depth, start, finish)
                r += 4
            else:  # the last 1-3 rows of a tile no block fits (shapes of tiny test models)
                if finish:
                    for t in range(tokens):
                        total = np.float32(0.0)
                        for c in range(columns):
                            total += tile[r, c] * xt[c, t]
                        out[out_at + t * out_stride + r] = total
                r += 1


# Decode reads each weight row once, from memory: the row PREFETCH_ROWS ahead is asked for while this one
# is multiplied. Measured on a 2-core Xeon (SmolLM2, 2 threads): 56.8 → 92.4 tokens/s; the hardware
# prefetchers alone lose the stream at every 4 KB page.
PREFETCH_ROWS = 4


# How the threads that share a product (`matrix._on_threads`) hand out its pieces and make sure each
# lands in `out` once, without the calling thread ever waiting long for a helper that lost its core to
# another process. The product's `state` (int64, from `share_state`): [0] the next piece to take (an
# atomic counter, `simd.claim`), [1] how many rounds of `simd.pause` the caller watches a helper's
# unfinished piece before taking it back, [2 + k] piece k's state, one of OPEN, COPYING, DONE, TAKEN
# (`ember.parallel`'s, which marks the pieces it hands out in Python alike).
# A helper computes its pieces into a buffer of its own and copies each into `out` only after moving
# its state from OPEN to COPYING (`publish`); the caller computes straight into `out`. Once no piece is
# left to take, the caller goes through the pieces the helpers took: done, it moves on; open after its
# watch, it moves the state to TAKEN and computes the piece itself (the helper, when it runs again,
# finds the piece taken and drops its values); being copied, it waits for the copy (a few rows). So no
# helper writes into `out` once its caller has returned, and the caller's wait is bounded by its watch
# plus one piece of its own work: a share never waits out a time slice of another process.


def share_state(pieces: int, patience: int) -> np.ndarray:
    """A fresh `state` for a product of `pieces` pieces (see above), the caller watching `patience` rounds."""
    state = np.zeros(2 + pieces, np.int64)
    state[1] = patience
    return state


@njit(inline="always")
def publish(state, k, buffer, out, first, stop):
    """A helper's piece k (rows first…stop−1 of out's columns, computed into buffer[:, :stop − first]),
    copied into out unless the caller has taken the piece back."""
    if simd.exchange_if(state, 2 + k, OPEN, COPYING) == OPEN:
        for t in range(out.shape[0]):
            for r in range(first, stop):
                out[t, r] = buffer[t, r - first]
        simd.store_state(state, 2 + k, DONE)


@njit(inline="always")
def _take_back(state, k):
    """Whether the caller computes a helper's piece k itself: after watching it for state[1] rounds, it
    takes it if it is still open; one being copied is waited for."""
    for _ in range(state[1]):
        if simd.load_state(state, 2 + k) != OPEN:
            break
        simd.pause()
    if simd.exchange_if(state, 2 + k, OPEN, TAKEN) == OPEN:
        return True
    while simd.load_state(state, 2 + k) != DONE:
        simd.pause()
    return False


@njit(inline="always")
def next_piece(state, piece, rows, caller, checked):
    """(k, first, stop, checked): the piece k, rows first…stop−1 of a stack of `rows`, this thread
    computes next (first ≥ rows: none is left); pieces are taken through state[0] until none is left,
    then the caller (`caller` true) takes back the helpers' unfinished ones from piece `checked` on
    (see `share_state`). The thread marks each piece it computed with `finish_piece`."""
    pieces = (rows + piece - 1) // piece
    k = simd.claim(state)
    if k >= pieces:
        k = pieces
        while caller and checked < pieces:
            candidate = checked
            checked += 1
            if simd.load_state(state, 2 + candidate) != DONE and _take_back(state, candidate):
                k = candidate
                break
    first = k * piece
    return k, first, min(first + piece, rows), checked


@njit(nogil=True, cache=True)
def close_share(state):
    """Every piece still open marked taken, and every piece being copied waited for: what a caller leaving
    on an error (Ctrl-C between two kernel calls) does, so that no helper writes into `out` after it."""
    for k in range(len(state) - 2):
        if simd.exchange_if(state, 2 + k, OPEN, TAKEN) == COPYING:
            while simd.load_state(state, 2 + k) != DONE:
                simd.pause()


@njit(inline="always")
def finish_piece(state, k, caller, buffer, out, first, stop):
    """Piece k computed: the caller's is in out already (marked done), a helper's is in buffer
    (`publish`)."""
    if caller:
        state[2 + k] = DONE
    else:
        publish(state, k, buffer, out, first, stop)


@njit(inline="always")
def part_rows(first, stop, offsets, part):
    """(start, end): the rows of the stack's part `part` (the stack's rows offsets[part]…offsets[part+1]−1)
    that lie in first…stop−1, numbered within the part (start ≥ end: none)."""
    base = offsets[part]
    return max(first, base) - base, min(stop, offsets[part + 1]) - base


@njit(inline="always")
def prefetch_ahead(data, r, stop, rows_ahead):
    """Hint the cache lines of row min(r + rows_ahead, stop − 1) of `data` in (no effect on values)."""
    row_bytes = data.shape[1] * data.itemsize
    ahead = min(r + rows_ahead, stop - 1) * row_bytes
    for line in range(0, row_bytes, 64):
        simd.prefetch(data, ahead + line)


@njit(inline="always")
def _dot_block(rows, tokens, sums, w0, w1, b, b_at, b_stride, steps):
    """`simd.dot_block_<rows>x<tokens>`: sums of w0 (and w1) against `tokens` rows of b from b_at."""
    if rows == 2:
        if tokens == 4:
            simd.dot_block_2x4(sums, w0, w1, b, b_at, b_stride, steps)
        elif tokens == 3:
            simd.dot_block_2x3(sums, w0, w1, b, b_at, b_stride, steps)
        elif tokens == 2:
            simd.dot_block_2x2(sums, w0, w1, b, b_at, b_stride, steps)
        else:
            simd.dot_block_2x1(sums, w0, w1, b, b_at, b_stride, steps)
    elif tokens == 4:
        simd.dot_block_1x4(sums, w0, w1, b, b_at, b_stride, steps)
    elif tokens == 3:
        simd.dot_block_1x3(sums, w0, w1, b, b_at, b_stride, steps)
    elif tokens == 2:
        simd.dot_block_1x2(sums, w0, w1, b, b_at, b_stride, steps)
    else:
        simd.dot_block_1x1(sums, w0, w1, b, b_at, b_stride, steps)


@njit(inline="always")
def _rows_times_rows(rows, w0, w1, x, out, r, sums):
    """out[t, r] = w0 · x[t] (and out[t, r + 1] = w1 · x[t] when rows is 2) for every row t of x, four
    rows of x at a time in registers (`simd.dot_block_2x4`); columns past the last multiple of 16 (F16
    weights of a tiny model) added one by one."""
    tokens, columns = x.shape
    steps = columns // 16
    b = x.reshape(-1)
    t = 0
    while t < tokens:
        block = min(4, tokens - t)
        _dot_block(rows, block, sums, w0, w1, b, t * columns, columns, steps)
        for j in range(block):
            total = sums[j]
            for c in range(16 * steps, columns):
                total += w0[c] * x[t + j, c]
            out[t + j, r] = total
            if rows == 2:
                total = sums[block + j]
                for c in range(16 * steps, columns):
                    total += w1[c] * x[t + j, c]
                out[t + j, r + 1] = total
        t += block


@njit(nogil=True, fastmath=FAST, cache=True)
def matmul_rows(qtypes, parts, offsets, x, out, table, half, state, piece, caller):
    """out[t, r] = Σ_c W[r, c]·x[t, c] for a few activation rows t (x C-contiguous): two weight rows at
    a time are decoded once into small buffers (they stay in L1) and multiplied by every row of x, four
    rows of x at a time (`_rows_times_rows`). W as in `matvec`, the rows taken `piece` at a time as in
    `matvec` (`state`, `caller`).

    For a handful of rows this beats decoding a tile for BLAS (whose decoding runs in one thread per
    tile) and T separate matrix-vector products (each decoding W again); see `matrix.SMALL_BATCH`.
    Measured through `matrix.multiply_each` on 32 of Gemma-4-26B-A4B's experts (Xeon, best of 3, runs
    alternated, against one weight row times one row of x at a time in numba's 256-bit loops): Q4_K
    gate_up (1408 × 2816) at 8 rows 61 → 39–44 ms on one thread, 36 → 24–27 ms on two, at 4 rows
    38 → 29–32 and 23 → 19–20; Q8_0 down (2816 × 704) at 8 rows 32 → 24–25 and 20 → 16.
    Each row is decoded from its block 0: with the first block a variable (decoding a row in column
    chunks), Q8_0's decoding ran 3× slower.
    """
    rows = offsets[-1]
    columns = x.shape[1]
    w0 = np.empty(columns, np.float32)
    w1 = np.empty(columns, np.float32)
    sums = np.empty(8, np.float32)
    buffer = np.empty((x.shape[0], piece), np.float32)
    checked = 0
    while True:
        k, first, stop, checked = next_piece(state, piece, rows, caller, checked)
        if first >= rows:
            return
        target, shift = (out, 0) if caller else (buffer, first)
        for part in range(len(qtypes)):
            base = offsets[part] - shift
            start, end = part_rows(first, stop, offsets, part)
            qtype = qtypes[part]
            blocks = columns // block_values(qtype)
            data = parts[part]
            r = start
            while r < end:
                _decode(qtype, data[r], 0, blocks, w0, table, half)
                if r + 1 < end:
                    _decode(qtype, data[r + 1], 0, blocks, w1, table, half)
                    _rows_times_rows(2, w0, w1, x, target, base + r, sums)
                    r += 2
                else:  # a part's odd last row
                    _rows_times_rows(1, w0, w0, x, target, base + r, sums)
                    r += 1
        finish_piece(state, k, caller, buffer, out, first, stop)


# ------------------------------------------------------------------------------ row · vector


@njit(inline="always")
def _lanes_total(acc, offset):
    total = offset
    for lane in range(ACC_LANES):
        total += acc[lane]
    return total


# `_rows_dot(qtype, data, first, stop, shift, x, sums32, sums16, scales, acc, out, table)`:
# out[shift + r] = Σ_c W[r, c]·x[c] for rows first…stop−1 of `data` (block type `qtype`). The type is
# tested once per range, so each loop over rows holds one type's code only (testing it per row measured
# 1.7× slower on Q4_1).
_rows_dot = switch("_rows_dot", "data, first, stop, shift, x, sums32, sums16, scales, acc, out, table", """
for r in range(first, stop):
    prefetch_ahead(data, r, stop, PREFETCH_ROWS)
    acc[:] = 0.0
    out[shift + r] = _lanes_total(acc, {dot}(data[r], x.shape[0], x, sums16, sums32, scales, acc, table))
""", BLOCK_TYPES.values(), namespace={"prefetch_ahead": prefetch_ahead, "PREFETCH_ROWS": PREFETCH_ROWS,
                                            "_lanes_total": _lanes_total})
seal()  # every switch above is generated: a type declared from here on would have no branch


@njit(nogil=True, fastmath=FAST, cache=True)
def matvec(qtypes, parts, offsets, x, out, table, state, piece, caller):
    """out[0, r] = Σ_c W[r, c]·x[c] for every row r of W: decode's matrix-vector product.

    W is one matrix or several stacked along the rows (fused Q/K/V, gate/up): `parts` is a tuple of
    their encoded bytes, part p of block type qtypes[p] giving rows offsets[p]…offsets[p+1]−1 of W, so
    one call covers them all.

    The rows go in pieces of `piece` consecutive rows, taken through `state` (`share_state`): every
    thread that shares the product calls this kernel with the same state, in its own thread without
    the GIL (`matrix._on_threads`; `caller` true in the thread that called the product), and takes the
    next piece as it finishes one; the caller takes back a piece whose helper lost its core.
    Each row's sum is computed alike whoever takes it: the values do not depend on the threads.
    """
    rows = offsets[-1]
    columns = x.shape[0]
    sums16 = np.zeros(columns // 16 + 1, np.float32)
    for k in range(columns // 16):
        total = np.float32(0.0)
        for i in range(16):
            total += x[16 * k + i]
        sums16[k] = total
    sums32 = np.zeros(columns // 32 + 8, np.float32)  # padded: a super-block reads 8 at a time
    for k in range(columns // 32):
        sums32[k] = sums16[2 * k] + sums16[2 * k + 1]
    acc = np.empty(ACC_LANES, np.float32)
    scales = np.empty(16, np.float32)
    buffer = np.empty((1, piece), np.float32)
    checked = 0
    while True:
        k, first, stop, checked = next_piece(state, piece, rows, caller, checked)
        if first >= rows:
            return
        target, shift = (out, 0) if caller else (buffer, first)
        for part in range(len(qtypes)):  # this piece's rows of each part
            start, end = part_rows(first, stop, offsets, part)
            if start < end:
                _rows_dot(qtypes[part], parts[part], start, end, offsets[part] - shift, x, sums32, sums16,
                          scales, acc, target[0], table)
        finish_piece(state, k, caller, buffer, out, first, stop)
