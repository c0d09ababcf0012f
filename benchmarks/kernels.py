"""ember's quantized kernels against float32 BLAS on the same matrices, one product at a time.

    python -m benchmarks.kernels                      # SmolLM2 and Gemma 3 matrices, 1 and 2 threads
    python -m benchmarks.kernels --json results/kernels.json

For each matrix (one of every block type the two real models use, and the LM heads): the decode
product (one activation row: `QuantizedMatrix.matmul` → `kernels.matvec`, against `numpy.matmul` of
the row by the float32 matrix, BLAS gemv) and the prefill product (128 rows: tiles decoded into scratch
and multiplied by BLAS, against one BLAS gemm on the float32 matrix). Medians of `--repeats` timings of
`--calls` products each, wall clock; the machine's load is printed (`benchmarks.machine_load`), since
on a shared 2-core machine a busy neighbour doubles every figure.
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

MATRICES = {
    "smollm2-135m": ["blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "token_embd.weight"],
    "gemma3-270m": ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
                    "blk.0.ffn_down.weight", "token_embd.weight"],
}


def _median_seconds(product, calls: int, repeats: int) -> float:
    product()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            product()
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times)


def time_products(quantized: Any, dense: np.ndarray, x: np.ndarray, calls: int,
                  repeats: int) -> dict[str, float]:
    """Median seconds of one product each way: decode (x's first row) and prefill (every row of x)."""
    out = np.zeros((x.shape[0], dense.shape[0]), np.float32)
    few = max(2, calls // 10)
    return {
        "decode_ember": _median_seconds(lambda: quantized.matmul(x[:1], out[:1]), calls, repeats),
        "decode_blas": _median_seconds(lambda: np.matmul(x[0], dense.T, out=out[0]), calls, repeats),
        "prefill_ember": _median_seconds(lambda: quantized.matmul(x, out), few, repeats),
        "prefill_blas": _median_seconds(lambda: np.matmul(x, dense.T, out=out), few, repeats),
    }


def measure(threads: int, calls: int, repeats: int, prefill_rows: int) -> list[dict[str, Any]]:
    from ember.gguf_file import GGUFFile
    from ember.quant import compute_threads
    from ember.quant.matrix import warm_up
    from ember.sources import resolve_model
    from ember.weights import WeightStore

    warm_up()
    results = []
    rng = np.random.default_rng(0)
    for model, names in MATRICES.items():
        gguf = GGUFFile.open(resolve_model(model).path)
        store = WeightStore(gguf)
        for name in names:
            dense = gguf.dequantize(name)
            rows, columns = dense.shape
            x = rng.standard_normal((prefill_rows, columns)).astype(np.float32)
            n = max(2, calls // 20) if rows * columns > 20_000_000 else calls
            with compute_threads(threads):
                f = time_products(store.matrix(name), dense, x, n, repeats)
            row = {"model": model, "tensor": name, "type": gguf.tensor(name).ggml_type.name,
                   "shape": [rows, columns], "threads": threads, **f,
                   "decode_values_per_second": rows * columns / f["decode_ember"]}
            results.append(row)
            print(f"{model:13s} {name:26s} {row['type']:5s} {rows:6d}x{columns:<5d} threads {threads}: "
                  f"decode {f['decode_ember'] * 1e6:7.0f} us vs BLAS {f['decode_blas'] * 1e6:7.0f} us "
                  f"({f['decode_blas'] / f['decode_ember']:.2f}x), prefill {prefill_rows} "
                  f"{f['prefill_ember'] * 1e3:6.2f} ms vs {f['prefill_blas'] * 1e3:6.2f} ms "
                  f"({f['prefill_blas'] / f['prefill_ember']:.2f}x)", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill-rows", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with LoadMeter(self_and_children_cpu_seconds) as meter:
        for threads in (int(t) for t in args.threads.split(",")):
            results += measure(threads, args.calls, args.repeats, args.prefill_rows)
    load = meter.foreign_cores
    print(f"others' load during the run: {load:.2f} cores")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"others_load_cores": load, "products": results}, indent=2))


if __name__ == "__main__":
    main()
