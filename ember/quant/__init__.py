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
import sys
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


_kernel_threads = 1


def kernel_threads() -> int:
    """The number of threads the kernels share a product among (set by `compute_threads`); numba's own
    `get_num_threads()` costs a microsecond or more a call, a noticeable share of a small product."""
    return _kernel_threads


@contextmanager
def compute_threads(threads: int) -> Iterator[None]:
    """Run BLAS, ember's own shared work (`ember.parallel`) and (when loaded) the numba kernels on
    `threads` threads inside the block."""
    global _kernel_threads
    from threadpoolctl import threadpool_limits

    from ember.parallel import use_threads

    numba = sys.modules.get("numba")  # only once the kernels are in use
    previous = numba.get_num_threads() if numba is not None else None
    saved = _kernel_threads
    with threadpool_limits(threads), use_threads(threads):
        if numba is not None:
            _kernel_threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
            numba.set_num_threads(_kernel_threads)
        try:
            yield
        finally:
            _kernel_threads = saved
            if numba is not None and previous is not None:
                numba.set_num_threads(previous)

