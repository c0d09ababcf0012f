"""Weights kept in their GGUF block encoding and the numba kernels that multiply them.

    blocks.py    one record per block type, registered once; the numba dispatch generated from them
    kernels.py   the records (each type's decoder, bit-identical to gguf-py, and row product) and the
                 parallel drivers
    matrix.py    QuantizedMatrix / StackedMatrix: matmul (decode and prefill), rows, dequantize

numba compiles the kernels the first time they run and keeps the machine code in
`<ember cache>/jit` (`NUMBA_CACHE_DIR`, unless already set), so later processes load them in a
fraction of a second. Importing this package does not import numba; `jit_unavailable()` says whether
it can be used.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache


def _point_numba_cache() -> None:
    if "NUMBA_CACHE_DIR" not in os.environ:
        from ember.paths import ember_cache_dir

        os.environ["NUMBA_CACHE_DIR"] = str(ember_cache_dir() / "jit")


@cache
def jit_unavailable() -> str | None:
    """None when the kernels can run here; otherwise why not (one line, for the fallback notice)."""
    if os.environ.get("EMBER_DISABLE_JIT"):
        return "EMBER_DISABLE_JIT is set"
    _point_numba_cache()
    try:
        import numba  # noqa: F401

        from ember.quant import kernels  # noqa: F401
    except Exception as error:  # ImportError, or llvmlite failing to start on this platform
        return f"numba cannot be used here ({type(error).__name__}: {error})"
    return None


@contextmanager
def compute_threads(threads: int) -> Iterator[None]:
    """Run BLAS and ember's own shared work (`ember.parallel`, which the kernels' products use too) on
    `threads` threads inside the block. The kernels start no threads of their own (numba's are never
    started): each product's threads are ember's, taking rows in small pieces (`kernels.matvec`)."""
    from threadpoolctl import threadpool_limits

    from ember.parallel import use_threads

    with threadpool_limits(threads), use_threads(threads):
        yield
