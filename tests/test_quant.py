"""The numba kernels: every block type decodes to gguf-py's values bit for bit; products match float32."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ember.quant import compute_threads, kernels
from ember.quant.matrix import (
    SMALL_BATCH_AVX512,
    TILE_VALUES,
    TRANSPOSED_BELOW_AVX512,
    QuantizedMatrix,
    StackedMatrix,
    multiply_each,
    tile_rows,
)

RNG = np.random.default_rng(11)
# Every product path is exercised whatever this CPU picks by default (`matrix.AVX512`): the AVX-512
# thresholds route some row counts to each of matvec, matmul_rows, tile_product and OpenBLAS.
SMALL_BATCH, TRANSPOSED_BELOW = SMALL_BATCH_AVX512, TRANSPOSED_BELOW_AVX512


@pytest.fixture(autouse=True)
def every_path(monkeypatch):
    import ember.quant.matrix as matrix_module

    monkeypatch.setattr(matrix_module, "SMALL_BATCH", SMALL_BATCH)
    monkeypatch.setattr(matrix_module, "TRANSPOSED_BELOW", TRANSPOSED_BELOW)
KERNEL_TYPES = [record.qtype for record in kernels.BLOCK_TYPES.values()]


def random_encoded(qtype: Q, rows: int, columns: int) -> np.ndarray:
    """[rows, bytes per row] of `qtype`: every byte random except finite, small f16 scales."""
    if qtype == Q.F32:
        return RNG.standard_normal((rows, columns)).astype(np.float32).view(np.uint8)
    if qtype == Q.F16:
        return RNG.standard_normal((rows, columns)).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        bits = RNG.standard_normal((rows, columns)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = RNG.integers(0, 256, size=(rows, columns // block_values, block_bytes), dtype=np.uint8)
    for at in kernels.BLOCK_TYPES[qtype].f16_fields:  # random bits there: NaN or huge values
        scales = RNG.uniform(-0.02, 0.02, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., at:at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if qtype == Q.MXFP4:  # e8m0 exponents near 2^0 (random ones reach 2^127: products overflow)
        blocks[..., 0] = RNG.integers(118, 132, size=blocks.shape[:2], dtype=np.uint8)
    return blocks.reshape(rows, -1)


def reference_values(qtype: Q, data: np.ndarray) -> np.ndarray:
    if qtype == Q.F32:
        return data.view(np.float32)
    if qtype == Q.F16:
        return data.view(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return gguf.quants.dequantize(data, qtype).astype(np.float32)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES, key=int), ids=lambda t: t.name)
def test_every_block_type_decodes_like_gguf_py_and_multiplies_like_float32(qtype):
    rows, columns = 48, 768
    data = random_encoded(qtype, rows, columns)
    data.flags.writeable = False
    expected = reference_values(qtype, data)
    matrix = QuantizedMatrix("w", data, int(qtype), (rows, columns))

    np.testing.assert_array_equal(matrix.dequantize(), expected)  # bit for bit
    ids = np.array([5, 0, 47, 5])
    np.testing.assert_array_equal(matrix.rows(ids, np.empty((4, columns), np.float32)), expected[ids])

    exact = expected.astype(np.float64)
    # decode's matrix-vector kernel, a short prompt's row-by-row kernel, prefill tiles through BLAS
    for tokens in (1, 7, SMALL_BATCH + 3, TRANSPOSED_BELOW):
        x = RNG.standard_normal((tokens, columns)).astype(np.float32)
        got = matrix.matmul(x, np.zeros((tokens, rows), np.float32))
        reference = x.astype(np.float64) @ exact.T
        assert np.abs(got - reference).max() <= 2e-6 * np.abs(reference).max()


def test_stacked_parts_of_two_types_multiply_into_their_columns(monkeypatch):
    import ember.quant.matrix as matrix_module

    monkeypatch.setattr(matrix_module, "MIN_TILE_ROWS", 16)
    monkeypatch.setattr(matrix_module, "TILE_VALUES", 16 * 256)  # several tiles, the last one short
    rows, columns = 23, 256
    parts = [QuantizedMatrix(f"p{i}", random_encoded(qtype, rows, columns), int(qtype), (rows, columns))
             for i, qtype in enumerate((Q.Q4_K, Q.Q8_0))]
    stacked = StackedMatrix(parts)
    weight = np.concatenate([reference_values(Q(p.ggml_type), p.data) for p in parts])
    # prefill tiles as tile · xᵀ and as x · tileᵀ; a short prompt's and decode's one kernel call
    for tokens in (SMALL_BATCH + 1, TRANSPOSED_BELOW + 5, 9, 1):
        x = RNG.standard_normal((tokens, columns)).astype(np.float32)
        out = np.full((tokens, 2 * rows), np.nan, np.float32)
        stacked.matmul(x, out)
        expected = x.astype(np.float64) @ weight.T.astype(np.float64)
        assert np.abs(out - expected).max() <= 1e-6 * np.abs(expected).max()  # every column written
    assert TILE_VALUES >= 1 << 20  # the real tile: BLAS-sized


def test_tiles_depend_on_the_shape_alone_so_products_do_not_depend_on_the_threads():
    # Each output element comes from the same tile product whatever the thread count: bit-identical.
    rows, columns = 1000, 512
    matrix = QuantizedMatrix("w", random_encoded(Q.Q4_K, rows, columns), int(Q.Q4_K), (rows, columns))
    x = RNG.standard_normal((40, columns)).astype(np.float32)
    results = []
    for threads in (1, 2, 3):
        with compute_threads(threads):
            results.append(matrix.matmul(x, np.empty((40, rows), np.float32)))
    assert all(np.array_equal(results[0], other) for other in results[1:])
    step = tile_rows(rows, columns)
    assert step % 16 == 0 and -(-rows // step) >= 4  # several tiles, so threads share the work
    assert tile_rows(262144, 640) * 640 <= TILE_VALUES and tile_rows(14336, 4096) >= 64


def test_decode_and_short_prompt_products_do_not_depend_on_the_threads(monkeypatch):
    # Decode's and a short prompt's rows are taken in small pieces by whichever thread is free: every
    # row once, each computed alike, so bit-identical whatever the threads; pieces straddle the parts
    # of a stack and the stack spans two kernel calls (more parts than KERNEL_PARTS).
    import ember.quant.matrix as matrix_module

    monkeypatch.setattr(matrix_module, "PIECE_VALUES", 16 * 256)  # pieces of 16 rows
    columns = 256
    types = (Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q4_K)
    parts = [QuantizedMatrix(f"p{i}", random_encoded(qtype, 37 + 8 * i, columns), int(qtype),
                             (37 + 8 * i, columns)) for i, qtype in enumerate(types)]
    stacked = StackedMatrix(parts)
    assert len(stacked._groups) == 2
    weight = np.concatenate([reference_values(Q(p.ggml_type), p.data) for p in parts]).astype(np.float64)
    for tokens in (1, 3):
        x = RNG.standard_normal((tokens, columns)).astype(np.float32)
        results = []
        for threads in (1, 2, 3):
            with compute_threads(threads):
                out = np.full((tokens, stacked.shape[0]), np.nan, np.float32)
                results.append(stacked.matmul(x, out))
        assert all(np.array_equal(results[0], other) for other in results[1:])
        expected = x.astype(np.float64) @ weight.T
        assert np.abs(results[0] - expected).max() <= 1e-6 * np.abs(expected).max()


def test_products_multiplied_each_in_one_share_equal_each_matmul(monkeypatch):
    # A mixture of experts' step: several weights, each over its own rows (one row, a few, none, more
    # than SMALL_BATCH, a stack spanning two kernel calls), in one share: every output as W.matmul
    # gives it, bit for bit, whatever the threads.
    import ember.quant.matrix as matrix_module

    monkeypatch.setattr(matrix_module, "PIECE_VALUES", 16 * 256)
    monkeypatch.setattr(matrix_module, "SHARED_FROM", 1)  # shared even at these sizes
    columns = 256
    types = (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.MXFP4)
    single = [QuantizedMatrix(f"e{i}", random_encoded(qtype, 40 + 8 * i, columns), int(qtype),
                              (40 + 8 * i, columns)) for i, qtype in enumerate(types)]
    stack = StackedMatrix([QuantizedMatrix(f"s{i}", random_encoded(Q.Q4_K, 24, columns), int(Q.Q4_K),
                                           (24, columns)) for i in range(4)])
    weights = [*single, stack, single[0]]
    counts = [1, 3, 0, 2, 5, SMALL_BATCH + 2]
    xs = [RNG.standard_normal((n, columns)).astype(np.float32) for n in counts]
    expected = [w.matmul(x, np.empty((len(x), w.shape[0]), np.float32))
                for w, x in zip(weights, xs, strict=True)]
    for threads in (1, 2, 3):
        outs = [np.full((len(x), w.shape[0]), np.nan, np.float32) for w, x in zip(weights, xs, strict=True)]
        with compute_threads(threads):
            multiply_each(list(zip(weights, xs, outs, strict=True)))
        for out, want in zip(outs, expected, strict=True):
            assert np.array_equal(out, want)


def test_decoders_never_read_past_their_row():
    # A row's last block decoded from a view that ends exactly there (a file mapping can end too).
    for qtype in (Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.BF16):
        data = random_encoded(qtype, 3, 512)
        view = np.ascontiguousarray(data)[1:2]
        out = np.empty((1, 512), np.float32)
        kernels.dequantize_tile(int(qtype), view, 0, out, kernels.F16_TABLE, 16)
        np.testing.assert_array_equal(out, reference_values(qtype, data)[1:2])


def test_mxfp4_decodes_every_exponent_and_code_like_gguf_py():
    # Every e8m0 byte (0 and 1 give subnormal scales, 255 overflows to ±inf past code 7's 12) with every
    # pair of e2m1 codes: bit for bit as gguf-py; the row product from the blocks as float32's.
    blocks = np.zeros((256, 17), np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = np.arange(256).reshape(16, 16)[np.arange(256) % 16]
    data = blocks.reshape(32, 8 * 17)
    with np.errstate(over="ignore"):
        expected = gguf.quants.dequantize(data, Q.MXFP4).astype(np.float32)
    matrix = QuantizedMatrix("w", data, int(Q.MXFP4), (32, 256))
    np.testing.assert_array_equal(matrix.dequantize(), expected)
    assert np.isinf(expected).any() and (np.abs(expected[expected != 0]) < 2.0**-126).any()
    finite = np.ascontiguousarray(data.reshape(256, 17)[100:164].reshape(8, 8 * 17))  # exponents 100…163
    x = RNG.standard_normal((1, 256)).astype(np.float32)
    reference = x.astype(np.float64) @ gguf.quants.dequantize(finite, Q.MXFP4).astype(np.float64).T
    got = QuantizedMatrix("w", finite, int(Q.MXFP4), (8, 256)).matmul(x, np.zeros((1, 8), np.float32))
    assert np.abs(got - reference).max() <= 2e-6 * np.abs(reference).max()


def test_few_rows_products_of_every_count_and_a_ragged_width():
    # `kernels.matmul_rows` multiplies two weight rows by four rows of x at a time in 16-lane blocks:
    # every count of x's rows up to 9 (whole blocks and the last 1-3), an odd number of weight rows
    # (the last one alone) and a width that is not a multiple of 16 (F16: its last columns one by one).
    for qtype, rows, columns in ((Q.F16, 13, 40), (Q.Q4_K, 11, 512), (Q.Q8_0, 7, 96)):
        data = random_encoded(qtype, rows, columns)
        matrix = QuantizedMatrix("w", data, int(qtype), (rows, columns))
        exact = reference_values(qtype, data).astype(np.float64)
        for tokens in range(2, 10):
            x = RNG.standard_normal((tokens, columns)).astype(np.float32)
            got = matrix.matmul(x, np.full((tokens, rows), np.nan, np.float32))
            reference = x.astype(np.float64) @ exact.T
            assert np.abs(got - reference).max() <= 2e-6 * np.abs(reference).max(), (qtype, tokens)


@pytest.mark.parametrize("lanes", [8, 16])
def test_the_few_rows_register_block_in_either_lane_width(lanes):
    # `simd.DOT_LANES` picks 16 lanes with AVX-512 and 8 without; this CPU compiles only one of them
    # into the kernels, so both widths are checked here on their own, every block shape.
    from ember.quant import simd
    from ember.quant.jit import njit

    columns, steps = 80, 5
    a0, a1 = RNG.standard_normal((2, columns)).astype(np.float32)
    b = RNG.standard_normal(6 * columns).astype(np.float32)
    for rows in (1, 2):
        for tokens in (1, 2, 3, 4):
            block = simd._dot_block(rows, tokens, lanes)

            @njit
            def run(sums, a0, a1, b, block=block):
                block(sums, a0, a1, b, columns, columns, steps)

            sums = np.full(8, np.nan, np.float32)
            run(sums, a0, a1, b)
            x = b[columns:].reshape(5, columns)[:tokens].astype(np.float64)
            expected = np.stack([a0, a1][:rows]).astype(np.float64) @ x.T  # [rows, tokens]
            assert np.allclose(sums[:rows * tokens], expected.ravel(), rtol=1e-5, atol=1e-5), (rows, tokens)
