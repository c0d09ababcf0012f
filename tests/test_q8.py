"""8-bit activations (`ember.quant.q8`, weights="quantized-q8"): llama.cpp's rounding and products.

The golden values are llama.cpp's own: its CPU library's `quantize_row_q8_K` and
`ggml_vec_dot_q{4,6}_K_q8_K`, called through ctypes on the same bytes (llama-cpp-python's build).
Without llama.cpp the products are still checked against the exact integer sums they stand for."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_quant import random_encoded, reference_values  # noqa: E402

from ember.quant import compute_threads, q8
from ember.quant.matrix import QuantizedActivation, QuantizedMatrix, StackedMatrix, multiply_each

pytestmark = pytest.mark.skipif(not q8.AVAILABLE, reason="the 8-bit products need AVX2")

RNG = np.random.default_rng(8)
# ggml's block_q8_K: float d, 256 signed bytes, 16 int16 sums of 16
Q8_K = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])
# ggml's block_q8_0: f16 d, 32 signed bytes (the activations' rounding for Q8_0 weights)
Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])


def activations(columns: int) -> list[np.ndarray]:
    """Vectors that reach the rounding's corners: a block of zeros, a negative largest value, an outlier,
    values on a rounding tie (x = 0.5 / iscale)."""
    plain = RNG.standard_normal(columns).astype(np.float32)
    corners = plain.copy()
    corners[:256] = 0.0
    corners[300] = -40.0
    corners[700] = 1e-30
    ties = np.zeros(columns, np.float32)
    ties[::256] = 127.0  # iscale = -1: x.5 rounds to even
    ties[1::7] = 2.5
    ties[2::7] = -3.5
    return [plain, corners, ties]


@pytest.fixture(scope="module")
def ggml():
    llama_cpp = pytest.importorskip("llama_cpp")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_cpu_init()
    lib.quantize_row_q8_K.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.quantize_row_q8_0.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    for name in ("ggml_vec_dot_q4_K_q8_K", "ggml_vec_dot_q6_K_q8_K", "ggml_vec_dot_q8_0_q8_0",
                 "ggml_vec_dot_q5_0_q8_0"):
        getattr(lib, name).argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                       ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def ggml_q8_k(lib, x: np.ndarray) -> np.ndarray:
    blocks = np.zeros(x.shape[0] // 256, Q8_K)
    lib.quantize_row_q8_K(np.ascontiguousarray(x).ctypes.data, blocks.ctypes.data, x.shape[0])
    return blocks


def ggml_q8_0(lib, x: np.ndarray) -> np.ndarray:
    blocks = np.zeros(x.shape[0] // 32, Q8_0)
    lib.quantize_row_q8_0(np.ascontiguousarray(x).ctypes.data, blocks.ctypes.data, x.shape[0])
    return blocks


def q8_matvec(matrix, x: np.ndarray) -> np.ndarray:
    out = np.empty((1, matrix.shape[0]), np.float32)
    return matrix.matmul(x[None], out)[0]


def test_activations_round_to_bytes_as_llama_cpp_rounds_them(ggml):
    for x in activations(1024):
        expected = ggml_q8_k(ggml, x)
        ours = QuantizedActivation(x[None])
        np.testing.assert_array_equal(ours.scales[0], expected["d"])
        np.testing.assert_array_equal(ours.values[0], expected["qs"].reshape(-1))
        np.testing.assert_array_equal(ours.sums16[0], expected["bsums"].reshape(-1))
        np.testing.assert_array_equal(ours.sums32[0, :-8], expected["bsums"].reshape(-1, 2).sum(axis=1))
        # for Q8_0 weights: 32 values a scale, the scale an f16 (ggml-cpu's run-time quantize_row_q8_0)
        expected = ggml_q8_0(ggml, x)
        ours = QuantizedActivation(x[None], "q8_0")
        np.testing.assert_array_equal(ours.scales[0], expected["d"].astype(np.float32))
        np.testing.assert_array_equal(ours.values[0], expected["qs"].reshape(-1))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0])
def test_rows_times_rounded_activations_equal_llama_cpps_dot(ggml, qtype):
    rows, columns = 37, 1024
    data = random_encoded(qtype, rows, columns)
    data.flags.writeable = False
    matrix = QuantizedMatrix("w", data, int(qtype), (rows, columns), q8=True)
    assert matrix.q8
    if qtype in (Q.Q8_0, Q.Q5_0):  # weights of 32-value blocks: x rounded as ggml's Q8_0
        dot, rounded = getattr(ggml, f"ggml_vec_dot_{qtype.name.lower()}_q8_0"), ggml_q8_0
    else:
        dot, rounded = getattr(ggml, f"ggml_vec_dot_{qtype.name.lower().replace('_k', '_K')}_q8_K"), ggml_q8_k
    for x in activations(columns):
        y = rounded(ggml, x)
        expected = np.empty(rows, np.float32)
        result = ctypes.c_float()
        for r in range(rows):
            dot(columns, ctypes.byref(result), 0, data[r].ctypes.data, 0, y.ctypes.data, 0, 1)
            expected[r] = result.value
        ours = q8_matvec(matrix, x)
        # the integer sums are exact in both; the float sums of blocks differ in order only
        np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-6 * np.abs(expected).max())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0])
def test_products_are_the_exact_sums_of_the_rounded_values(qtype):
    """Without llama.cpp: Σ W·(q·d) in float64 from gguf-py's dequantized rows."""
    rows, columns = 29, 768
    data = random_encoded(qtype, rows, columns)
    data.flags.writeable = False
    weight = reference_values(qtype, data).astype(np.float64)
    matrix = QuantizedMatrix("w", data, int(qtype), (rows, columns), q8=True)
    block = 32 if qtype in (Q.Q8_0, Q.Q5_0) else 256
    for x in activations(columns):
        rounded = QuantizedActivation(x[None], "q8_0" if block == 32 else "q8_k")
        scales = rounded.scales.reshape(-1, 1).astype(np.float64)
        values = (rounded.values.reshape(-1, block) * scales).reshape(-1)
        # half a step of the block's scale (Q8_0's scale an f16: its rounding, 2^-11, on top)
        assert np.abs(values - x).max() <= np.abs(x).max() / 254 * 1.002
        expected = weight @ values
        np.testing.assert_allclose(q8_matvec(matrix, x), expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_only_stacks_of_one_rounding_round_and_each_row_rounds_alone(monkeypatch):
    import ember.quant.matrix as matrix_module

    monkeypatch.setattr(matrix_module, "PIECE_VALUES", 16 * 256)  # pieces of 16 rows
    columns = 512
    parts = {qtype: QuantizedMatrix(qtype.name, random_encoded(qtype, 40, columns), int(qtype), (40, columns),
                                    q8=True) for qtype in (Q.Q4_K, Q.Q6_K, Q.Q8_0)}
    assert parts[Q.Q4_K].q8 and parts[Q.Q6_K].q8 and parts[Q.Q8_0].q8
    plain_q4_1 = QuantizedMatrix("q4_1", random_encoded(Q.Q4_1, 40, columns), int(Q.Q4_1), (40, columns),
                                 q8=True)
    assert not plain_q4_1.q8  # no 8-bit product for this type: float32 activations in every mode
    x = RNG.standard_normal(columns).astype(np.float32)
    k_quants = StackedMatrix([parts[Q.Q4_K], parts[Q.Q6_K], parts[Q.Q4_K]])
    assert k_quants.q8
    expected = np.concatenate([q8_matvec(parts[qtype], x) for qtype in (Q.Q4_K, Q.Q6_K, Q.Q4_K)])
    np.testing.assert_array_equal(q8_matvec(k_quants, x), expected)  # row for row the same sums
    q5_0 = QuantizedMatrix("q5_0", random_encoded(Q.Q5_0, 40, columns), int(Q.Q5_0), (40, columns), q8=True)
    q8_0s = StackedMatrix([parts[Q.Q8_0], q5_0])  # both round x in 32-value blocks
    assert q8_0s.q8
    np.testing.assert_array_equal(q8_matvec(q8_0s, x),
                                  np.concatenate([q8_matvec(parts[Q.Q8_0], x), q8_matvec(q5_0, x)]))
    mixed = StackedMatrix([parts[Q.Q4_K], parts[Q.Q8_0]])
    assert not mixed.q8  # two roundings of x in one call: float32 for all of it
    plain = [QuantizedMatrix(p.name, p.data, p.ggml_type, p.shape) for p in (parts[Q.Q4_K], parts[Q.Q8_0])]
    np.testing.assert_array_equal(q8_matvec(mixed, x), q8_matvec(StackedMatrix(plain), x))
    # prompts round too, each row as it would alone: a sequence's numbers do not depend on its batch
    from ember.quant.matrix import SMALL_BATCH

    for count in (3, SMALL_BATCH + 5):
        rows = RNG.standard_normal((count, columns)).astype(np.float32)
        together = k_quants.matmul(rows, np.empty((count, k_quants.shape[0]), np.float32))
        for t in (0, count - 1):
            np.testing.assert_array_equal(together[t], q8_matvec(k_quants, rows[t]))
        batch = q8_0s.matmul(rows, np.empty((count, q8_0s.shape[0]), np.float32))
        for t in (0, count - 1):
            np.testing.assert_array_equal(batch[t], q8_matvec(q8_0s, rows[t]))
    wide = np.zeros((count, 200), np.float32)  # written into a column slice of a wider buffer
    k_quants.matmul(rows, wide[:, 10:10 + k_quants.shape[0]])
    np.testing.assert_array_equal(wide[:, 10:10 + k_quants.shape[0]], together)
    assert not wide[:, :10].any() and not wide[:, 10 + k_quants.shape[0]:].any()


def test_experts_multiplied_together_equal_each_alone_whatever_the_threads(monkeypatch):
    import ember.quant.matrix as matrix_module

    monkeypatch.setattr(matrix_module, "PIECE_VALUES", 16 * 256)
    monkeypatch.setattr(matrix_module, "SHARED_FROM", 1)  # shared even at these sizes
    columns = 512
    experts = [QuantizedMatrix(f"e{i}", random_encoded(qtype, 48, columns), int(qtype), (48, columns),
                               q8=True) for i, qtype in enumerate((Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q8_0))]
    xs = [RNG.standard_normal((1, columns)).astype(np.float32) for _ in experts]
    alone = [q8_matvec(expert, x[0]) for expert, x in zip(experts, xs, strict=True)]
    for threads in (1, 2, 3):
        outs = [np.full((1, 48), np.nan, np.float32) for _ in experts]
        with compute_threads(threads):
            multiply_each(list(zip(experts, xs, outs, strict=True)))
        for out, expected in zip(outs, alone, strict=True):
            np.testing.assert_array_equal(out[0], expected)


def test_kernel_sources_include_the_q8_module():
    # numba keys its cache on a kernel's own file: the cache folder's digest must cover q8.py's code
    from ember.quant import KERNEL_SOURCES

    assert "q8.py" in KERNEL_SOURCES


def test_a_q4_k_m_model_in_q8_mode_rounds_its_k_quant_products_and_keeps_its_answer():
    import ember

    exact = ember.load_model("gemma3-270m", context_length=64)
    rounded = ember.load_model("gemma3-270m", context_length=64, weights="quantized-q8")
    assert rounded.weights == "quantized-q8" and exact.weights == "quantized"
    prompt = "The capital of France is"
    reference, ours = exact.evaluate(prompt), rounded.evaluate(prompt)
    difference = np.abs(ours - reference).max() / np.abs(reference).max()
    # Gemma 3 270M's products are Q4_K/Q6_K and Q5_0/Q8_0: their inputs rounded, the logits move by
    # 5.5% of their largest value here (4.4% and 4.9% on "Once upon a time" and "def fibonacci(n):";
    # 4.7%, 3.1%, 4.0% when only the K-quants rounded), as llama.cpp's own logits differ from the
    # float32 forward's (3.7%, 3.6%, 5.9%: Gemma's outlier activations make the 8-bit steps coarse);
    # the answer stays
    assert 1e-4 < difference < 0.1, difference
    assert int(np.argmax(ours)) == int(np.argmax(reference))
    generated = rounded.generate(prompt, max_new_tokens=4)
    assert len(generated.token_ids) == 4
