"""The block type records: one per type the loader takes, each complete, and the numba dispatch generated
from them, so that adding a type is one declaration (`ember.quant.blocks`)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from numba.core.dispatcher import Dispatcher

from ember.quant import kernels
from ember.quant.blocks import BLOCK_TYPES, BlockType, switch
from ember.quant.jit import njit
from ember.weights import kernel_types


def test_every_type_the_loader_takes_has_one_complete_record():
    assert kernel_types() is BLOCK_TYPES and BLOCK_TYPES is kernels.BLOCK_TYPES
    assert {Q(t).name for t in BLOCK_TYPES} == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0",
                                               "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"}
    for type_id, record in BLOCK_TYPES.items():
        assert record.type_id == type_id == int(record.qtype) and record.name == record.qtype.name
        assert (record.values, record.nbytes) == GGML_QUANT_SIZES[record.qtype]
        assert isinstance(record.decode, Dispatcher) and isinstance(record.dot, Dispatcher)
        assert getattr(kernels, record.name) is record  # declared in the kernels' module


def test_the_dispatch_has_one_branch_per_record():
    for dispatch in (kernels._decode, kernels._rows_dot, kernels.block_values):
        source = inspect.getsource(dispatch.py_func)
        branches = [line.split("==")[1].split(":")[0].strip() for line in source.splitlines()
                    if "qtype ==" in line]
        assert branches == [str(type_id) for type_id in BLOCK_TYPES], source


def test_a_record_without_its_kernels_or_declared_twice_is_refused():
    before = dict(BLOCK_TYPES)
    with pytest.raises(TypeError, match="Q2_K has no dot kernel"):
        class Q2K(BlockType, qtype=Q.Q2_K):
            decode = kernels.Q8_0.decode
    with pytest.raises(TypeError, match="Q8_0 is declared twice"):
        class Again(BlockType, qtype=Q.Q8_0):
            decode, dot = kernels.Q8_0.decode, kernels.Q8_0.dot
    # Complete and new, but declared once the dispatch is generated: it would have no branch to run it.
    with pytest.raises(TypeError, match="Q2_K is declared after the kernels' dispatch was generated"):
        class Late(BlockType, qtype=Q.Q2_K):
            decode, dot = kernels.Q8_0.decode, kernels.Q8_0.dot
    assert BLOCK_TYPES == before


def test_a_new_record_is_dispatched_by_its_type_id():
    # A made-up type 99 with Q8_0's kernels: the generated switch sends type 99 to them, nothing else.
    toy = SimpleNamespace(type_id=99, name="TOY", values=32, nbytes=34, decode=kernels.Q8_0.decode,
                          dot=kernels.Q8_0.dot)
    decode = switch("decode", "src, first, blocks, dst, table, half",
                    "{decode}(src, first, blocks, dst, table, half)", [toy])
    values = switch("values", "", "return {values}", [toy], default="return 1")

    @njit
    def decode_row(qtype, src, dst, table):
        decode(qtype, src, 0, dst.shape[0] // values(qtype), dst, table, 16)

    blocks = np.random.default_rng(3).integers(0, 256, (2, 34), dtype=np.uint8)
    blocks[:, :2] = np.array([0.5, -0.25], np.float16).view(np.uint8).reshape(2, 2)
    row = blocks.reshape(-1)
    out = np.zeros(64, np.float32)
    decode_row(int(Q.Q8_0), row, out, kernels.F16_TABLE)  # not a type of this switch: untouched
    assert not out.any()
    decode_row(99, row, out, kernels.F16_TABLE)
    np.testing.assert_array_equal(out, gguf.quants.dequantize(row, Q.Q8_0).reshape(-1))


CACHED = r"""
import json
from ember.quant import jit_unavailable
assert jit_unavailable() is None
from ember.quant import kernels, matrix
matrix.warm_up()
print(json.dumps({name: sum(getattr(kernels, name).stats.cache_misses.values())
                  for name in ("matvec", "matmul_rows", "dequantize_tile", "dequantize_rows")}))
"""


def test_the_generated_dispatch_is_loaded_from_numbas_cache_by_a_second_process():
    # The drivers inline the generated switches; numba's on-disk cache must still serve them: the first
    # process may compile (a cold cache), the second must not.
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CACHED], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == dict.fromkeys(
        ("matvec", "matmul_rows", "dequantize_tile", "dequantize_rows"), 0)
