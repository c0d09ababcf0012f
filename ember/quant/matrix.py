"""Weight matrices kept in their GGUF block encoding, multiplied by float32 activations.

`QuantizedMatrix` wraps one tensor's bytes (a read-only view of the mapped file) and offers what the
engine needs: `matmul(x, out)` (out = x Wᵀ), `rows(ids, out)` (embedding lookups) and `dequantize()`.
`StackedMatrix` puts several of them on top of each other (fused Q/K/V or gate/up projections whose
parts may have different block types) without copying any.

How `matmul` multiplies, by the number of activation rows T:

* T = 1 (decode): `kernels.matvec` decodes each weight row and multiplies it by x, straight from the
  blocks.
* more rows (prefill): a tile of at most `TILE_VALUES` weights is decoded into reused scratch memory and
  multiplied by BLAS (`numpy.matmul`), tile after tile: the decoded values are gguf-py's, so the
  products are the float32 path's up to BLAS's summation order. Even at T = 2 this costs one decoding
  of W, as a matrix-vector product does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from ember.ops import linear
from ember.quant import kernel_threads, kernels

# A prefill tile: 4 M float32 weights (16 MB). Large enough that BLAS runs at full speed on each tile,
# small enough that even Llama-3.1-8B's 28672-row gate/up projection never needs its 470 MB float32
# form at once.
TILE_VALUES = 1 << 22
HALF = 16  # handed to the kernels at run time (see kernels._decode)

_scratch = threading.local()


def _tile_buffer(values: int) -> np.ndarray:
    """This thread's scratch for decoded tiles, grown on demand and then reused."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < values:
        buffer = np.empty(values, np.float32)
        _scratch.buffer = buffer
    return buffer


class QuantizedMatrix:
    """One GGUF tensor [rows, columns] in its own block encoding.

    `data` is the tensor's bytes as uint8 [rows, bytes per row] (`GGUFFile.raw`); `ggml_type` is its
    block type, one of `kernels.SUPPORTED`.
    """

    def __init__(self, name: str, data: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> None:
        self.name = name
        self.data = data
        self.ggml_type = int(ggml_type)
        self.shape = shape
        self._types = np.array([self.ggml_type], np.int64)
        self._offsets = np.array([0, shape[0]], np.int64)

    def __repr__(self) -> str:
        return f"QuantizedMatrix({self.name!r}, type {self.ggml_type}, shape {self.shape})"

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def matmul(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = x @ Wᵀ for x [T, columns]; out [T, rows] may be a column slice of a wider buffer."""
        if x.shape[0] == 1:
            kernels.matvec(self._types, (self.data,), self._offsets, x[0], out[0], kernels.F16_TABLE,
                           kernel_threads())
            return out
        rows, columns = self.shape
        tile_rows = max(1, min(rows, TILE_VALUES // columns))
        buffer = _tile_buffer(tile_rows * columns)
        for first in range(0, rows, tile_rows):
            count = min(tile_rows, rows - first)
            tile = buffer[: count * columns].reshape(count, columns)
            kernels.dequantize_range(self.ggml_type, self.data, first, tile, kernels.F16_TABLE, HALF)
            np.matmul(x, tile.T, out=out[:, first:first + count])
        return out

    def rows(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[i] = row ids[i], decoded (ids must be valid row numbers)."""
        kernels.dequantize_rows(self.ggml_type, self.data, ids, out, kernels.F16_TABLE, HALF)
        return out

    def dequantize(self) -> np.ndarray:
        """The whole matrix as a new float32 array."""
        out = np.empty(self.shape, np.float32)
        kernels.dequantize_range(self.ggml_type, self.data, 0, out, kernels.F16_TABLE, HALF)
        return out


class StackedMatrix:
    """Matrices with the same number of columns stacked along the rows, each kept as it is (their block
    types may differ: Gemma 3's Q and K are Q5_0 where V is Q8_0)."""

    def __init__(self, parts: Sequence[QuantizedMatrix | np.ndarray]) -> None:  # F32 parts are arrays
        self.parts = list(parts)
        columns = {part.shape[1] for part in self.parts}
        if len(columns) != 1:
            raise ValueError(f"cannot stack matrices of shapes {[p.shape for p in self.parts]}")
        self.shape = (sum(part.shape[0] for part in self.parts), columns.pop())
        self.offsets = np.cumsum([0] + [part.shape[0] for part in self.parts]).tolist()
        # decode multiplies every part in one kernel call when none of them is a float32 array
        self._quantized = all(isinstance(part, QuantizedMatrix) for part in self.parts)
        if self._quantized:
            self._types = np.array([part.ggml_type for part in self.parts], np.int64)
            self._data = tuple(part.data for part in self.parts)
            self._offsets = np.array(self.offsets, np.int64)

    @property
    def nbytes(self) -> int:
        return sum(int(part.nbytes) for part in self.parts)

    def matmul(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        if x.shape[0] == 1 and self._quantized:
            kernels.matvec(self._types, self._data, self._offsets, x[0], out[0], kernels.F16_TABLE,
                           kernel_threads())
            return out
        for part, start, stop in zip(self.parts, self.offsets, self.offsets[1:], strict=False):
            linear(x, part, out[:, start:stop])
        return out



def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache) with the argument types the engine uses:
    mapped file bytes (read-only uint8), float32 activations. A first load compiles for about a minute
    on 2 cores; a cached load takes a fraction of a second."""
    data = np.zeros((1, 34), np.uint8)  # one Q8_0 block
    data.flags.writeable = False
    x = np.zeros(32, np.float32)
    out = np.zeros((1, 32), np.float32)
    for parts in ((data,), (data, data), (data, data, data)):  # one matrix, gate/up, Q/K/V
        types = np.full(len(parts), kernels.Q8_0, np.int64)
        kernels.matvec(types, parts, np.arange(len(parts) + 1), x, out[0], kernels.F16_TABLE, 1)
    kernels.dequantize_range(kernels.Q8_0, data, 0, out, kernels.F16_TABLE, HALF)
    kernels.dequantize_rows(kernels.Q8_0, data, np.zeros(1, np.int64), out, kernels.F16_TABLE, HALF)
