"""A model's weights as the engine holds them: quantized in the file's own encoding, or float32.

`WeightStore(gguf, mode)` hands the families what they ask for by tensor name:

* mode `"quantized"` (the default): matrices stay in their GGUF blocks, read straight from the mapped
  file (`ember.quant.QuantizedMatrix`, multiplied by numba kernels); nothing is copied, so a model costs
  about its file size in memory, and processes that map the same file share its pages. F32 tensors are
  float32 views of the file.
* mode `"float32"`: every matrix is dequantized into process memory at load (gguf-py and NumPy, no
  JIT), and BLAS multiplies everything. About 4–8× the file's size in memory; what ember falls back to
  when the kernels cannot run.
* mode `"quantized-q8"`: as "quantized", but the products of Q4_K, Q6_K, Q8_0 and Q5_0 matrices round their
  activations to 8 bits first, as llama.cpp does (`ember.quant.q8`): faster decode, activations no
  longer float32-exact (about 1/254 of a 256- or 32-value block's largest value). Opt-in.

Embedding tables that are not also the LM head are never dequantized whole in either mode: `table()`
returns something whose `rows(ids, out)` decodes only the requested rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ember.errors import GGUFError
from ember.gguf_file import GGUFFile

QUANTIZED, FLOAT32, QUANTIZED_Q8 = "quantized", "float32", "quantized-q8"
WEIGHT_MODES = (QUANTIZED, FLOAT32, QUANTIZED_Q8)


def kernel_types() -> dict[int, Any]:
    """The block types the kernels multiply, ggml type id → record: those declared in
    `ember.quant.kernels` (importing it imports numba; quantized mode only)."""
    from ember.quant.kernels import BLOCK_TYPES

    return BLOCK_TYPES


def remove_old_weight_cache() -> None:
    """ember 0.1 kept dequantized float32 copies of every matrix under `<ember cache>/weights/` (0.5–1.2 GB
    a model, 23 GB for an 8B file); nothing reads them any more. Deleted at the first load, with a note."""
    import shutil
    import sys

    from ember.paths import ember_cache_dir

    old = ember_cache_dir() / "weights"
    if not old.is_dir():
        return
    size = sum(f.stat().st_size for f in old.rglob("*") if f.is_file())
    shutil.rmtree(old, ignore_errors=True)
    print(f"ember: removed the float32 weight cache of ember 0.1 ({size / 2**20:.0f} MiB at {old}); "
          "weights now stay quantized in memory", file=sys.stderr, flush=True)


class FileRows:
    """Rows of a table decoded from the file on demand with NumPy (float32 mode's embedding tables)."""

    def __init__(self, store: WeightStore, name: str) -> None:
        self.store = store
        self.name = name
        self.shape = store.gguf.tensor(name).shape

    def rows(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        self.store.row_requests[self.name] += 1
        out[...] = self.store.gguf.dequantize_rows(self.name, ids)
        return out


class WeightStore:
    """The weights of one GGUF file, by tensor name, in `mode` ("quantized" or "float32")."""

    def __init__(self, gguf_file: GGUFFile, mode: str = QUANTIZED) -> None:
        if mode not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
        self.gguf = gguf_file
        self.mode = mode
        # What was read how, by tensor name (tests and `ember.memory` read these).
        self.full_dequantizations: Counter[str] = Counter()
        self.row_requests: Counter[str] = Counter()

    def has(self, name: str) -> bool:
        """Whether the file has a tensor called `name`."""
        return name in self.gguf.tensors

    def check_shapes(self, expected: Mapping[str, tuple[int, ...]], source: str) -> None:
        """Refuse tensors of the file whose shape is not the one its metadata (`source`) implies: the
        kernels trust shapes, and a wrong one reads or writes past an array (found by fuzzing)."""
        for name, shape in expected.items():
            info = self.gguf.tensors.get(name)
            if info is None:
                continue  # a missing tensor is named when the family asks for it
            if info.shape != shape or min(shape, default=1) < 1:
                raise GGUFError(f"{self.gguf.path}: tensor {name!r} has shape {info.shape}, but {source} "
                                f"implies {shape}: the file is corrupt")

    def matrix(self, name: str) -> Any:
        """A 2-D weight [out, in] the engine multiplies by (`ember.quant.multiply`)."""
        info = self.gguf.tensor(name)
        if len(info.shape) != 2:
            raise GGUFError(f"{self.gguf.path}: tensor {name!r} has shape {info.shape}, expected a matrix")
        if self.mode == FLOAT32:
            self.full_dequantizations[name] += 1
            values = self.gguf.dequantize(name)
            values.flags.writeable = False
            return values
        self._check_kernel_type(name, info)
        if info.ggml_type == GGMLQuantizationType.F32:
            return self.gguf.raw(name)  # a float32 view of the file: BLAS multiplies it as it is
        from ember.quant.matrix import QuantizedMatrix

        raw = self.gguf.raw(name)  # F16 comes as float16, BF16 as uint16: the kernels read bytes
        return QuantizedMatrix(name, raw.view(np.uint8).reshape(info.shape[0], -1), int(info.ggml_type),
                               info.shape, q8=self.mode == QUANTIZED_Q8)

    def experts(self, name: str) -> list[Any]:
        """A 3-D tensor of experts stacked along its first axis ([experts, out, in], GGUF ne [in, out,
        experts]) as one 2-D weight per expert, each what `matrix` would give for that slice: in
        quantized mode a view of the expert's own blocks in the mapped file (nothing is copied, and an
        expert nobody routes to is never read); in float32 mode the tensor dequantized once, sliced."""
        info = self.gguf.tensor(name)
        if len(info.shape) != 3:
            raise GGUFError(f"{self.gguf.path}: tensor {name!r} has shape {info.shape}, expected "
                            "[experts, rows, columns]")
        count, rows, columns = info.shape
        if self.mode == FLOAT32:
            self.full_dequantizations[name] += 1
            values = self.gguf.dequantize(name)
            values.flags.writeable = False
            return list(values)
        self._check_kernel_type(name, info)
        raw = self.gguf.raw(name)
        if info.ggml_type == GGMLQuantizationType.F32:
            return list(raw)
        from ember.quant.matrix import QuantizedMatrix

        blocks = raw.view(np.uint8).reshape(count, rows, -1)  # F16 comes as float16, BF16 as uint16
        return [QuantizedMatrix(f"{name}[{e}]", blocks[e], int(info.ggml_type), (rows, columns),
                                q8=self.mode == QUANTIZED_Q8) for e in range(count)]

    def stack(self, parts: Sequence[Any]) -> Any:
        """Weights already in hand (`matrix`, `experts` slices) stacked along their rows, as `stacked`."""
        if self.mode == FLOAT32:
            stacked = np.concatenate(parts) if len(parts) > 1 else parts[0]
            stacked.flags.writeable = False
            return stacked
        from ember.quant.matrix import StackedMatrix

        return parts[0] if len(parts) == 1 else StackedMatrix(parts)

    def stacked(self, names: Sequence[str]) -> Any:
        """Several matrices stacked along their rows (fused Q/K/V, gate/up), as one weight.

        float32: one concatenated array (one BLAS call). quantized: the parts as they are in the file.
        """
        if not names:
            raise ValueError("stacked() needs at least one tensor name")
        infos = [self.gguf.tensor(n) for n in names]
        if len({info.shape[1:] for info in infos}) != 1:
            shapes = ", ".join(f"{i.name} {i.shape}" for i in infos)
            raise GGUFError(f"{self.gguf.path}: cannot stack tensors of shapes {shapes}")
        return self.stack([self.matrix(n) for n in names])

    def _check_kernel_type(self, name: str, info: Any) -> None:
        if info.ggml_type not in kernel_types():
            supported = ", ".join(sorted(t.name for t in kernel_types().values()))
            raise GGUFError(
                f"{self.gguf.path}: tensor {name!r} has block type {info.ggml_type.name}, which ember's "
                f"kernels do not multiply (they do {supported}); load with weights='float32' to "
                "dequantize it instead"
            )

    def table(self, name: str) -> Any:
        """An embedding table whose rows are read on demand: `gather_rows(table, ids, out)`."""
        if self.mode == FLOAT32 or self.gguf.tensor(name).ggml_type not in kernel_types():
            return FileRows(self, name)
        return self.matrix(name)

    def vector(self, name: str) -> np.ndarray:
        """A 1-D tensor (norm weights, rope factors) as a new float32 array."""
        info = self.gguf.tensor(name)
        if len(info.shape) != 1:
            raise GGUFError(f"{self.gguf.path}: tensor {name!r} has shape {info.shape}, expected a vector")
        return self.gguf.dequantize(name)

    def vectors(self, name: str) -> list[np.ndarray]:
        """A 2-D tensor of one vector per expert ([experts, n]: gpt-oss's expert biases) as float32 rows."""
        info = self.gguf.tensor(name)
        if len(info.shape) != 2:
            raise GGUFError(f"{self.gguf.path}: tensor {name!r} has shape {info.shape}, expected "
                            "[experts, values]")
        return list(self.gguf.dequantize(name).reshape(info.shape))

    def rows(self, name: str, ids: np.ndarray | list[int]) -> np.ndarray:
        """float32 `[len(ids), cols]` of a table, decoding only those rows (NumPy, any block type)."""
        self.row_requests[name] += 1
        return self.gguf.dequantize_rows(name, np.asarray(ids))
