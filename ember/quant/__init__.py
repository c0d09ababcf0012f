"""Weights kept in their GGUF block encoding and the numba kernels that multiply them.

    blocks.py    one record per block type, registered once; the numba dispatch generated from them
    kernels.py   the records (each type's decoder, bit-identical to gguf-py, and row product) and the
                 parallel drivers
    matrix.py    QuantizedMatrix / StackedMatrix: matmul (decode and prefill), rows, dequantize
    q8.py        decode's products with activations rounded to 8 bits, as llama.cpp computes them (opt-in)

numba compiles the kernels the first time they run and keeps the machine code in
`<ember cache>/jit/<digest>` (`jit_cache_dir()`; `NUMBA_CACHE_DIR`, unless already set), so later
processes load them in a fraction of a second. Importing this package does not import numba;
`jit_unavailable()` says whether it can be used.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

# The files whose code numba compiles into the kernels. numba keys a cached kernel by its own file
# (kernels.py, token_ops.py) alone: after a change to simd.py or blocks.py only, it loaded the old
# machine code (seen 2026-12-06: an edited simd.py primitive was not in the kernels until the cache
# was deleted). The cache folder is named by a digest of all of them instead.
KERNEL_SOURCES = ("blocks.py", "jit.py", "kernels.py", "q8.py", "simd.py", "token_ops.py", "waiting.py")


def jit_cache_dir(sources: Path = Path(__file__).parent) -> Path:
    """`<ember cache>/jit/<digest of the KERNEL_SOURCES in sources>`: where numba keeps these kernels'
    machine code (hashing the ~150 KB of sources takes well under a millisecond)."""
    from ember.paths import ember_cache_dir

    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update((sources / name).read_bytes())
    return ember_cache_dir() / "jit" / digest.hexdigest()[:16]


@cache
def jit_unavailable() -> str | None:
    """None when the kernels can run here; otherwise why not (one line, for the fallback notice)."""
    if os.environ.get("EMBER_DISABLE_JIT"):
        return "EMBER_DISABLE_JIT is set"
    try:
        from ember.quant import kernels  # noqa: F401  (numba through ember.quant.jit, its cache set there)
    except Exception as error:  # ImportError, or llvmlite failing to start on this platform
        return f"numba cannot be used here ({type(error).__name__}: {error})"
    return None


def q8_available() -> bool:
    """Whether the 8-bit activation products (`ember.quant.q8`, AVX2 instructions) can run on this CPU."""
    from ember.quant import simd

    return simd.has_avx2()


@contextmanager
def compute_threads(threads: int, blas_threads: int = 1) -> Iterator[None]:
    """Run ember's own shared work (`ember.parallel`, which the kernels' products and float32 products
    use too) on `threads` threads inside the block, BLAS on `blas_threads`. The kernels start no
    threads of their own (numba's are never started): each product's threads are ember's, taking rows
    in small pieces (`kernels.matvec`).

    BLAS's own pool stays off (`blas_threads` 1) unless BLAS runs the model's products (weights=
    "float32", where its threads multiply faster than pieces shared out: a 8192 x 2048 product of one
    row took 1.35 ms on OpenBLAS's 2 threads, 1.50 in ember's pieces). After a call BLAS's idle threads
    spin, and on 2 cores the spinning thread takes the core ember's next share needs. Measured on
    Qwen3-30B-A3B (Zen 3, 2 threads, 128-token prefill): its float32 router ran on OpenBLAS's 2
    threads just before the experts, whose products then ran 1.45x slower (a third thread took 3.4 s
    of CPU in a 6.8 s prefill); with BLAS on one thread and the router shared out (`ops.linear`)
    prefill went from 17 to 23 tokens/s (8-bit activations) and from 14.7 to 20.2 (default)."""
    from threadpoolctl import threadpool_limits

    from ember.parallel import use_threads

    with threadpool_limits(blas_threads), use_threads(threads, blas_threads):
        yield
