"""BLAS's own threads inside a forward (`ember.quant.compute_threads`): off with quantized weights, where
ember's threads share every product (float32 ones through `ops.linear`), on with float32 weights,
where BLAS runs the products. An idle BLAS thread spins and, on 2 cores, takes the core of ember's
helper (Qwen3-30B-A3B's experts ran 1.45x slower after its float32 router ran on 2 BLAS threads)."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info

import ember
from ember import ops, parallel
from ember.experiments import Experiment
from ember.quant import compute_threads


def blas_threads_now() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


class SeeBlasThreads(Experiment):
    name = "see-blas-threads"

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def after_layer(self, ctx, hidden) -> None:
        self.seen |= blas_threads_now()


@pytest.mark.parametrize(("weights", "expected"), [("quantized", 1), ("float32", 2)])
def test_blas_runs_its_own_threads_only_where_it_runs_the_products(smollm2_path, weights, expected):
    if not blas_threads_now():
        pytest.skip("NumPy reports no BLAS library to threadpoolctl")
    model = ember.load_model(smollm2_path, context_length=256, threads=2, weights=weights)
    if model.weights != weights:
        pytest.skip(f"this machine holds the weights as {model.weights}")
    seeing = SeeBlasThreads()
    model.generate("The capital of France is", max_new_tokens=2, temperature=0.0, experiments=[seeing])
    assert seeing.seen == {expected}


def test_a_float32_product_shared_among_ember_s_threads_equals_one_blas_call(monkeypatch):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((128, 2048)).astype(np.float32)
    weight = rng.standard_normal((130, 2048)).astype(np.float32)  # 130 features: pieces of unequal size
    assert x.shape[0] * weight.size >= ops.SHARED_PRODUCT
    shared = np.full((128, 130), np.nan, np.float32)
    calls = []
    original = parallel.race_pieces

    def counted(count, *args, **kwargs):
        calls.append(count)
        return original(count, *args, **kwargs)

    monkeypatch.setattr(parallel, "race_pieces", counted)
    with compute_threads(2):
        ops.linear(x, weight, shared)
    assert calls and calls[0] > 1  # the product was split into pieces
    expected = x.astype(np.float64) @ weight.T.astype(np.float64)
    np.testing.assert_allclose(shared, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    with compute_threads(1):
        alone = ops.linear(x, weight, np.empty_like(shared))
    np.testing.assert_allclose(shared, alone, rtol=0, atol=1e-6 * np.abs(alone).max())
