"""float32 buffers that start on a 64-byte cache line.

NumPy's buffers start wherever its allocator puts them: 16 or 32 bytes into a cache line, or on one,
by chance (measured: np.empty of 1024 values 32 bytes in, of 2^16 values on a line or 16 bytes in).
The kernels' 16-lane (64-byte) loads from a buffer off a line each straddle two lines: prefill's tile
product read a transposed x 16 bytes off at 131-141 GFLOP/s against 154-162 aligned (one Xeon core,
128 tokens, same process), so prefill's speed changed from run to run with the allocator's luck.
"""

from __future__ import annotations

import numpy as np

ALIGNMENT = 64  # bytes: one AVX-512 vector, one cache line


def _aligned(allocate, shape: int | tuple[int, ...]) -> np.ndarray:
    """allocate(count + 16 values), cut to start on a line: the first value at most 60 bytes in."""
    count = int(np.prod(shape))
    raw = allocate(count + ALIGNMENT // 4, np.float32)
    start = (-raw.ctypes.data % ALIGNMENT) // 4
    return raw[start:start + count].reshape(shape)


def aligned_empty(shape: int | tuple[int, ...]) -> np.ndarray:
    """np.empty(shape, float32), its first value on a cache line."""
    return _aligned(np.empty, shape)


def aligned_zeros(shape: int | tuple[int, ...]) -> np.ndarray:
    """np.zeros(shape, float32), its first value on a cache line (pages still touched only when written)."""
    return _aligned(np.zeros, shape)
