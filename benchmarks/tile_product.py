"""Prefill's tile product (`kernels.tile_product`) against single-threaded OpenBLAS, one core.

    python -m benchmarks.tile_product                     # prints GFLOP/s by tokens and tile shape
    python -m benchmarks.tile_product --json results/tile-product-<label>.json

For the 1B shape's two tile kinds (512 × 2048: Q/K/V, output, gate/up; 256 × 8192: down) and 48 to
512 tokens: ember's kernel (x already transposed, as `matrix._tiled` does once per matrix; the
transpose's own time is reported beside it) against OpenBLAS's x · tileᵀ (what ember used before,
and still uses from `matrix.TRANSPOSED_BELOW` tokens on) on the same operands. Medians of `--repeats`
calls; the largest difference from a float64 product is reported, relative to the largest value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine_load import LoadMeter, self_and_children_cpu_seconds

TILES = ((512, 2048), (256, 8192))
TOKENS = (48, 64, 128, 192, 256, 384, 512)


def _median_seconds(call: Any, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_one(tokens: int, rows: int, columns: int, repeats: int,
                rng: np.random.Generator) -> dict[str, Any]:
    from ember.buffers import aligned_empty
    from ember.quant import kernels
    from ember.quant.matrix import _flat_rows

    x = rng.standard_normal((tokens, columns), dtype=np.float32)
    tile = rng.standard_normal((rows, columns), dtype=np.float32)
    padded = -(-tokens // 16) * 16
    transposed = aligned_empty((columns, padded))  # as the engine's scratch (`ember.buffers`)
    partial = aligned_empty(rows * padded)
    out = np.empty((tokens, rows), np.float32)
    flat, stride = _flat_rows(out)
    kernels.transpose_tokens(x, transposed)
    ours = _median_seconds(lambda: kernels.tile_product(tile, transposed, tokens, partial, flat, 0, stride),
                           repeats)
    reference = x.astype(np.float64) @ tile.T.astype(np.float64)
    error = float(np.abs(out - reference).max() / np.abs(reference).max())
    transpose = _median_seconds(lambda: kernels.transpose_tokens(x, transposed), repeats)
    blas = _median_seconds(lambda: np.matmul(x, tile.T, out=out), repeats)
    flops = 2.0 * tokens * rows * columns
    return {"tokens": tokens, "tile": [rows, columns], "tile_product_gflops": flops / ours / 1e9,
            "openblas_gflops": flops / blas / 1e9, "transpose_ms": transpose * 1e3,
            "tile_product_relative_error": error}


def measure(repeats: int) -> list[dict[str, Any]]:
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    results = []
    with threadpool_limits(1):
        for tokens in TOKENS:
            for rows, columns in TILES:
                result = measure_one(tokens, rows, columns, repeats, rng)
                results.append(result)
                print(f"{tokens:4d} tokens, tile {rows} x {columns}: tile_product "
                      f"{result['tile_product_gflops']:5.0f} GFLOP/s, OpenBLAS "
                      f"{result['openblas_gflops']:5.0f} (transpose {result['transpose_ms']:.2f} ms, "
                      f"error {result['tile_product_relative_error']:.1e})")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with LoadMeter(self_and_children_cpu_seconds) as meter:
        results = measure(args.repeats)
    print(f"others' load during the run: {meter.foreign_cores:.2f} cores")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"others_load_cores": meter.foreign_cores, "products": results},
                                        indent=2))


if __name__ == "__main__":
    main()
