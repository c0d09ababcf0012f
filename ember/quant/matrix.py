"""Weight matrices kept in their GGUF block encoding, multiplied by float32 activations.

`QuantizedMatrix` wraps one tensor's bytes (a read-only view of the mapped file) and offers what the
engine needs: `matmul(x, out)` (out = x Wᵀ), `rows(ids, out)` (embedding lookups) and `dequantize()`.
`StackedMatrix` puts several of them on top of each other (fused Q/K/V or gate/up projections whose
parts may have different block types) without copying any.

How `matmul` multiplies, by the number of activation rows T:

* T = 1 (decode): `kernels.matvec` multiplies each weight row by x straight from its blocks.
* T < `SMALL_BATCH` (short prompts, the evaluations of a study): `kernels.matmul_rows` decodes each
  weight row once and multiplies it by every row of x.
  Both run on ember's threads (`_on_threads`): each thread calls the kernel, which takes the rows
  PIECE_VALUES weights at a time through a counter shared by the calls, so a thread that lost its
  core to another process holds back one piece, never a fixed half.
* more rows (prefill): W is cut into tiles of consecutive rows, a tile's size fixed by W's shape alone
  (all the parts of a stacked W in one go). `ember.parallel.share` hands the tiles to the threads;
  each decodes one into its own reused scratch (`kernels.dequantize_tile`, values bit-identical to
  gguf-py's) and multiplies it by x: below `TRANSPOSED_BELOW` rows with `kernels.tile_product` (x
  transposed once per call, the products written straight into their columns), from there on by
  single-threaded BLAS (`numpy.matmul`). Either way the products are the float32 path's up to
  summation order, and the same whatever the thread count (each output element comes from the same
  tile product). Why ember's threads and not BLAS's: `ember.parallel`.

A matrix made with `q8=True` (weights="quantized-q8") whose parts are all Q4_K or Q6_K, or all Q8_0 or Q5_0,
takes none of these: every product, whatever T, rounds the rows of x to 8 bits and multiplies integers
(`ember.quant.q8`, llama.cpp's numerics), on the threads as a short prompt's.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ember import parallel
from ember.buffers import aligned_empty
from ember.ops import linear
from ember.quant import kernels, q8, simd, waiting

# A prefill tile holds at most TILE_VALUES weights (8 MB as float32: each thread's scratch) and, where W
# has the rows, at least MIN_TILE_ROWS rows (BLAS is slow on narrow products), and W is cut into at
# least MIN_TILES tiles so that 2 to 4 threads share it evenly. 2^21 and not 2^20: the 1B's ffn_down
# (2048 x 8192) tiles get 256 rows instead of 128, 137 -> 149 GFLOP/s a core at 128 tokens (Xeon, 2026-12-02).
TILE_VALUES = 1 << 21
MIN_TILE_ROWS = 64
MIN_TILES = 4
# Below this many activation rows `kernels.matmul_rows` multiplies; from it on, tiles and BLAS. Measured
# (2 threads, prompt tokens/s, row by row / tiles): SmolLM2 at 32 rows 327 / 229, at 64 363 / 385;
# Gemma 3 270M at 32 368 / 283, at 48 320 / 386.
SMALL_BATCH_AVX512 = 48
# Below this many activation rows a tile is multiplied by `kernels.tile_product`, from it on by
# OpenBLAS (x · tileᵀ), which gains on wider products. Measured on one Xeon core (2026-12-02,
# benchmarks/results/tile-product-2026-12-02-xeon.json), GFLOP/s tile_product / OpenBLAS on the 1B's
# 512 × 2048 and 256 × 8192 tiles: 64 tokens 171/105 and 153/106, 128 152/136 and 153/124, 192
# 149/149 and 153/144, 256 144/154 and 155/151, 512 145/172 and 150/157. In the engine (1B shape,
# 2 threads, prefill 128, medians of 7): 105 tok/s with OpenBLAS, 116 with tile_product. With the
# buffers cache-line aligned (2026-12-03, tile-product-2026-12-03-xeon.json) the kernel led at every
# length up to 512 (169/158 and 158/138 there). In the engine (1B shape, 2 threads, prompt tokens/s,
# in-process A/B alternating, medians of 7, 2026-12-03): 320 tokens 93.6 with OpenBLAS / 100.4 with
# the kernel, 448 97.0 / 99.1, 512 94.5 / 94.2 (the transpose of x eats the kernel's lead there).
TRANSPOSED_BELOW_AVX512 = 512


# `kernels.tile_product` keeps 24 accumulators in registers: AVX-512 has 32, AVX2 only 16, so without
# AVX-512 it spills and loses to OpenBLAS. Measured on an AMD EPYC with AVX2 (2 threads, SmolLM2's
# matrices, 2026-12-03): tile_product 20-26 GFLOP/s against OpenBLAS 46-70 at 64-480 rows (the LM head
# 24 vs 62 at 240); `matmul_rows` against tiles + OpenBLAS at 4/8/16/32/47 rows, qkv 244/542/595/739/
# 1289 µs vs 720/799/969/1020/1114, gate_up 776/831/1396/2221/2735 vs 1135/864/1021/1231/1830. So there
# every tile goes to OpenBLAS. With `matmul_rows` in 8 lanes there (`simd.DOT_LANES`; Zen 3 EPYC,
# 2026-12-07, 2 threads, best of 200, µs row by row / tiles) qkv at 16/24/32/48 rows 330/461/475/633 vs
# 523/552/569/607, gate_up 844/1311/1383/1793 vs 1191/1158/1455/1478, ffn_down 424/644/708/1085 vs
# 562/675/778/974; prompt tokens/s (A/B alternating in one process, medians of 5, 1 / 2 threads) at 16
# tokens 103 / 105 with rows from 16 on in tiles, 120 / 125 from 32 on; at 31 tokens 129 / 164 and
# 150 / 180. So rows from 32 on go to tiles.
SMALL_BATCH_AVX2 = 32
AVX512 = simd.AVX512
SMALL_BATCH = SMALL_BATCH_AVX512 if AVX512 else SMALL_BATCH_AVX2
TRANSPOSED_BELOW = TRANSPOSED_BELOW_AVX512 if AVX512 else 0
# Decode and short prompts share a product's rows among the threads in pieces of about PIECE_VALUES
# weights (times the activation rows), each taken by the next thread to finish one (`kernels.matvec`):
# a thread whose core another process took holds back one piece. 2^16 weights are ~10 µs of decode on
# one Xeon core (SmolLM2's 576-column products: 112-row pieces, its 1536-column ffn_down 32-row pieces).
# Not tuned on a quiet machine: per-piece timings taken while other sessions kept the load at 8-10
# (2 cores) did not separate 2^13...2^18 from each other.
PIECE_VALUES = 1 << 16
# A product of fewer multiply-adds than this (weights × activation rows) runs in the calling thread
# alone: waking a helper and waiting for its last piece costs more than the split saves. Measured on
# SmolLM2 (Xeon, idle, 2026-12-04, µs per product 1 thread / 2 threads): decode attn_output 576×576
# 40 / 78, qkv 960×576 60 / 78, ffn_down 576×1536 73 / 113, gate_up 3072×576 199 / 146; 2 rows:
# attn_output 77 / 93, qkv 165 / 121. Shared from 2^20 on, decode ran 1.00× at 2 threads against 1.
SHARED_FROM = 1 << 20
HALF = 16  # handed to the kernels at run time (see kernels._decode)
# The kernels take the parts of a stacked weight as a tuple of exactly this many (padded with empty
# parts): numba compiles a function once per tuple length, ~30 s each on 2 cores.
KERNEL_PARTS = 3
# The rounded products (`ember.quant.q8`) take at least this many weight rows a piece: a piece costs a
# claim and a cold start (measured when the kernel asked for rows ahead within its piece only; it now
# looks past it), and a prompt's experts of ~8 rows got 4-row pieces. Qwen3-30B-A3B prefill 128
# (2 threads, Zen 3 VM, runs alternated, medians of 4): 12.95 tokens/s at 4, 13.14 at 16, 13.64 at 32.
ROUNDED_MIN_PIECE = 32
# ... and about this many of x's values times weight rows: decode's pieces of 128-186 rows instead of 32
# (a piece starts cold: the rows its thread asked for ahead are in the piece after, the other thread's).
# Gemma-4-26B-A4B q8 decode (2 threads, Zen 3 VM, ms a token, two rounds alternated): 2^16 223 / 207,
# 2^18 202 / 194, 2^19 191 / 198, 2^20 189 / 194; one 2816 x 4096 Q4_K product out of cache 490-545 µs
# at 32 rows a piece, 440 at 256. A thread that loses its core mid-piece holds the others for as long as
# it is off its core whatever the piece's size; prompts keep their 32 rows.
ROUNDED_PIECE_VALUES = 1 << 19
# When a product's pieces are all taken, its caller watches each piece a helper has not finished for
# up to this many µs before computing it itself (`kernels.share_state`): about a piece's work, so a helper on
# its core finishes first, and one that lost its core costs no more than that and the piece.
REDO_WATCH = 50.0

_scratch = threading.local()


def q8_supports(parts: Sequence[QuantizedMatrix]) -> bool:
    """Whether the rounded products (`ember.quant.q8`) multiply these matrices: all Q4_K or Q6_K (x
    rounded in 256-value blocks), or all Q8_0 or Q5_0 (in 32-value blocks), on a CPU with AVX2; other block
    types, and stacks mixing the two roundings, keep float32 activations in every mode."""
    return (q8.AVAILABLE and all(q8.supports(part.ggml_type) for part in parts)
            and len({q8.rounding(part.ggml_type) for part in parts}) == 1)


def tile_rows(rows: int, columns: int) -> int:
    """The rows of one prefill tile of a [rows, columns] matrix: a multiple of 16, by shape alone."""
    by_count = -(-rows // MIN_TILES)
    by_size = max(MIN_TILE_ROWS, TILE_VALUES // columns)
    return max(16, min(by_size, max(by_count, MIN_TILE_ROWS)) // 16 * 16)


KernelGroup = tuple[np.ndarray, tuple[np.ndarray, ...], np.ndarray]


def kernel_groups(parts: Sequence[QuantizedMatrix]) -> list[KernelGroup]:
    """The (types, parts, row offsets) triples the kernels take for matrices stacked along their rows:
    KERNEL_PARTS parts a call, the last call padded with empty parts; offsets count the whole stack's
    rows, so each call writes its own columns of the output."""
    groups = []
    first = 0
    for start in range(0, len(parts), KERNEL_PARTS):
        chunk = list(parts[start:start + KERNEL_PARTS])
        offsets = list(itertools.accumulate((part.shape[0] for part in chunk), initial=first))
        first = offsets[-1]
        padding = KERNEL_PARTS - len(chunk)
        types = np.array([part.ggml_type for part in chunk] + [chunk[-1].ggml_type] * padding, np.int64)
        data = tuple(part.data for part in chunk) + (chunk[-1].data,) * padding
        groups.append((types, data, np.array(offsets + [offsets[-1]] * padding, np.int64)))
    return groups


def _on_threads(groups: list[KernelGroup], rows: int, piece: int, work: int,
                call: Callable[[KernelGroup, np.ndarray, bool], None]) -> None:
    """call(group, state, caller) for each kernel group, in the calling thread alone or, for a product
    of `work` multiply-adds from SHARED_FROM on, in each of up to `threads()` threads at once (`caller`
    true in the calling thread): each call takes `piece` rows at a time through the group's `state`
    until none is left, and the caller's call returns with all of them in the output
    (`kernels.share_state`, `parallel.race`). No BLAS runs inside."""
    pieces = -(-rows // piece)
    workers = parallel.racers(pieces) if work >= SHARED_FROM else 1
    states = [_states.take(pieces, _patience(workers)) for _ in groups]

    def run(caller: bool) -> None:
        for group, state in zip(groups, states, strict=True):
            call(group, state, caller)

    _race(run, states, workers)


def _race(run: Callable[[bool], None], states: list[np.ndarray], workers: int) -> None:
    """`parallel.race(run, workers)` over products marked in `states`; a caller leaving on an error
    closes them first (`kernels.close_share`), so no helper writes into an output after it."""
    def guarded(caller: bool) -> None:
        try:
            run(caller)
        except BaseException:
            if caller:
                for state in states:
                    kernels.close_share(state)
            raise

    _states.lend(states, parallel.race(guarded, workers))


class _StatePool:
    """Products' piece states (`kernels.share_state`), each reused once no helper can still touch it: a
    product's states go back when every helper's call on it has returned (its job is done) or when no
    helper was asked. Decode asks for a few a layer; a fresh one each time was a per-token allocation
    (SmolLM2's LM head: 441 values, 3.5 KB; a 128K-token vocabulary's at 2048 columns: 32 KB). One pool
    a calling thread."""

    def __init__(self) -> None:
        self.local = threading.local()

    def _pool(self) -> tuple[dict[int, list[np.ndarray]], collections.deque]:
        pool = getattr(self.local, "pool", None)
        if pool is None:
            pool = self.local.pool = ({}, collections.deque())
        return pool

    def take(self, pieces: int, patience: int) -> np.ndarray:
        """A state for `pieces` pieces, all open, the caller watching `patience` rounds."""
        free, lent = self._pool()
        while lent and (lent[0][0] is None or lent[0][0].done[0]):
            for state in lent.popleft()[1]:
                free.setdefault(len(state), []).append(state)
        spare = free.get(2 + pieces)
        if not spare:
            return kernels.share_state(pieces, patience)
        state = spare.pop()
        state.fill(0)
        state[1] = patience
        return state

    def lend(self, states: list[np.ndarray], job: object) -> None:
        """`states` in use by `job`'s helpers (None: by none) until it is done."""
        self._pool()[1].append((job, states))


_states = _StatePool()


def _patience(workers: int) -> int:
    """The rounds a caller watches a helper's unfinished piece before it takes it back (see REDO_WATCH)."""
    return waiting.rounds(REDO_WATCH) if workers > 1 else 0


def _matvec(groups: list[KernelGroup], x: np.ndarray, out: np.ndarray) -> np.ndarray:
    piece = max(16, PIECE_VALUES // x.shape[1] // 16 * 16)
    _on_threads(groups, out.shape[1], piece, out.size * x.shape[1], lambda group, state, caller:
                kernels.matvec(*group, x[0], out, kernels.F16_TABLE, state, piece, caller))
    return out


class QuantizedActivation:
    """Activation rows x [T, columns] rounded to 8 bits for weights of one rounding (`q8.rounding`):
    "q8_k" as `q8.quantize_q8_k` rounds them, with their block sums, or "q8_0" as `q8.quantize_q8_0`;
    one row of each array per row of x."""

    def __init__(self, x: np.ndarray, rounding: str = "q8_k") -> None:
        self.rounding = rounding
        if rounding == "q8_0":
            self.values, self.scales = q8.quantize_q8_0(np.ascontiguousarray(x))
            return
        tokens, columns = x.shape
        blocks = columns // q8.BLOCK
        self.values = np.empty((tokens, columns), np.int8)
        self.scales = np.empty((tokens, blocks), np.float32)
        self.sums16 = np.empty((tokens, 16 * blocks), np.int32)
        self.sums32 = np.empty((tokens, 8 * blocks + 8), np.int32)  # padded: a super-block reads 8 at a time
        self.sums32[:, -8:] = 0
        q8.quantize_q8_k(x, self.values, self.scales, self.sums16, self.sums32)

    def operands(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.values, self.scales, self.sums16, self.sums32

    def multiply(self, group: KernelGroup, out: np.ndarray, state: np.ndarray, piece: int,
                 caller: bool) -> None:
        """out[:, rows of group] = these rows times the group's weights (`q8.matmul`, `q8.matmul_q8_0`),
        `piece` weight rows at a time through `state` (`kernels.share_state`)."""
        if self.rounding == "q8_0":
            q8.matmul_q8_0(*group, self.values, self.scales, out, state, piece, caller)
        else:
            q8.matmul(*group, *self.operands(), out, state, piece, caller)


def _rounded_rows(groups: list[KernelGroup], x: np.ndarray) -> tuple[QuantizedActivation, int]:
    """x rounded as the groups' weights take it (`q8.rounding` of their block type), and the weight
    rows a piece of their product (ROUNDED_MIN_PIECE, ROUNDED_PIECE_VALUES)."""
    piece = max(ROUNDED_MIN_PIECE, ROUNDED_PIECE_VALUES // x.size // 4 * 4)
    return QuantizedActivation(x, q8.rounding(int(groups[0][0][0]))), piece


def _rounded_product(groups: list[KernelGroup], x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = x Wᵀ with the rows of x rounded to 8 bits (`ember.quant.q8`), the parts of W all of one
    rounding (`q8_supports`): decode and prompts alike, on the threads as `_small_batch`."""
    if x.shape[0] == 0:
        return out
    rounded, piece = _rounded_rows(groups, x)
    return _into(out, lambda contiguous: _on_threads(
        groups, out.shape[1], piece, out.shape[1] * x.size, lambda group, state, caller: rounded.multiply(
            group, contiguous, state, piece, caller)))


def _into(out: np.ndarray, fill: Callable[[np.ndarray], None]) -> np.ndarray:
    """fill(a C-contiguous array of out's shape), then out holds it: out itself when contiguous (the
    kernels take one layout), else a copy made after (a column slice of a wider buffer)."""
    contiguous = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
    fill(contiguous)
    if contiguous is not out:
        out[...] = contiguous
    return out


def _small_batch(groups: list[KernelGroup], x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`kernels.matmul_rows` on contiguous operands (one compiled variant; the copies are a few rows)."""
    if x.shape[0] == 0:  # a batch's layer that no sequence has reached yet
        return out
    rows = np.ascontiguousarray(x)
    piece = max(4, PIECE_VALUES // x.size)
    return _into(out, lambda contiguous: _on_threads(
        groups, out.shape[1], piece, out.shape[1] * x.size, lambda group, state, caller: kernels.matmul_rows(
            *group, rows, contiguous, kernels.F16_TABLE, HALF, state, piece, caller)))


def multiply_each(products: Sequence[tuple[object, np.ndarray, np.ndarray]]) -> None:
    """out = x Wᵀ for every (W, x, out) of `products`, the few-row products (below SMALL_BATCH rows, W
    quantized) in one share among the threads: each thread goes through all of them, taking pieces of
    each through its own counter, so the products cost one wake-up and one wait instead of one each
    (a mixture of experts' step: the chosen experts, each over its own rows). The values are those of
    `W.matmul(x, out)` (the same kernels, row for row); wider or float32 products go there. `out` must
    be C-contiguous."""
    calls = []  # (kernel group, x, out, piece, one row)
    pieces = work = 0
    for weight, x, out in products:
        groups = getattr(weight, "_groups", None)
        if x.shape[0] == 0:
            continue
        rounded = groups is not None and weight.q8
        if groups is None or (x.shape[0] >= SMALL_BATCH and not rounded):
            linear(x, weight, out)
            continue
        single = x.shape[0] == 1
        if rounded:
            rows, piece = _rounded_rows(groups, x)
        else:
            piece = (max(16, PIECE_VALUES // x.shape[1] // 16 * 16) if single
                     else max(4, PIECE_VALUES // x.size))
            rows = np.ascontiguousarray(x)
        calls.extend((group, rows, out, piece, single) for group in groups)
        pieces += -(-out.shape[1] // piece) * len(groups)
        work += out.shape[1] * x.size
    if not calls:
        return
    workers = parallel.racers(pieces) if work >= SHARED_FROM else 1
    states = [_states.take(-(-out.shape[1] // piece), _patience(workers))
              for _, _, out, piece, _ in calls]

    # Helpers go through the products from the last: the threads then work on different experts until
    # they meet, each streaming whole matrices. Measured on Qwen3-30B-A3B's experts (a token's 96
    # shares, 2 threads, Zen 3 VM, medians of 8, runs alternated): 91 ms in the same order, 73 ms in
    # opposite orders (two threads each taking half the layers alone: 65).
    in_order = list(zip(calls, states, strict=True))

    def run(caller: bool) -> None:
        for (group, x, out, piece, single), state in (in_order if caller else in_order[::-1]):
            if isinstance(x, QuantizedActivation):
                x.multiply(group, out, state, piece, caller)
            elif single:
                kernels.matvec(*group, x[0], out, kernels.F16_TABLE, state, piece, caller)
            else:
                kernels.matmul_rows(*group, x, out, kernels.F16_TABLE, HALF, state, piece, caller)

    _race(run, states, workers)


def _scratch_buffer(name: str, values: int) -> np.ndarray:
    """This thread's scratch `name` (decoded tiles, transposed products), grown on demand and reused,
    cache-line aligned (`ember.buffers`)."""
    buffer = getattr(_scratch, name, None)
    if buffer is None or buffer.size < values:
        buffer = aligned_empty(values)
        setattr(_scratch, name, buffer)
    return buffer


def _flat_rows(out: np.ndarray) -> tuple[np.ndarray, int] | None:
    """out's rows as one flat array from out[0, 0] (out[t, c] at t·stride + c) and the stride, for the
    kernels to write into; None if out's values are not unit-spaced along its rows."""
    if out.strides[1] != out.itemsize or out.strides[0] % out.itemsize:
        return None
    stride = out.strides[0] // out.itemsize
    span = (out.shape[0] - 1) * stride + out.shape[1]
    return np.lib.stride_tricks.as_strided(out, shape=(span,), strides=(out.itemsize,)), stride


def _tiled(parts: tuple[tuple[QuantizedMatrix, int], ...], x: np.ndarray, out: np.ndarray) -> None:
    """out[:, column + r] = x · row r of W for each (W, column) of parts: prefill's tile products, the
    tiles of all the parts shared out among the threads at once."""
    tokens = x.shape[0]
    tiles = [(matrix, first, column) for matrix, column in parts
             for first in range(0, matrix.shape[0], tile_rows(*matrix.shape))]
    flat = _flat_rows(out) if tokens < TRANSPOSED_BELOW else None
    if flat is not None:
        padded = -(-tokens // 16) * 16
        width = x.shape[1] * padded
        transposed = _scratch_buffer("transposed", width)[:width].reshape(x.shape[1], padded)
        parallel.share_ranges(x.shape[1], x.size, lambda start, stop: kernels.transpose_tokens(
            x[:, start:stop], transposed[start:stop]))

    def decoded(index: int) -> tuple[np.ndarray, int, int]:  # one tile, in this thread's scratch
        matrix, first, column = tiles[index]
        rows, columns = matrix.shape
        step = tile_rows(rows, columns)
        count = min(step, rows - first)
        tile = _scratch_buffer("tile", step * columns)[: count * columns].reshape(count, columns)
        kernels.dequantize_tile(matrix.ggml_type, matrix.data, first, tile, kernels.F16_TABLE, HALF)
        return tile, column + first, step

    def multiply(tile: np.ndarray, step: int, into: np.ndarray) -> None:
        """into = x · tileᵀ (into: columns of out, or a helper's scratch): by BLAS, or by
        `kernels.tile_product` where x was transposed."""
        if flat is None:
            np.matmul(x, tile.T, out=into)
        else:
            target, stride = _flat_rows(into)
            partial = _scratch_buffer("partial", step * padded)
            kernels.tile_product(tile, transposed, tokens, partial, target, 0, stride)

    def straight(index: int) -> None:  # the caller's tiles: into out
        tile, at, step = decoded(index)
        multiply(tile, step, out[:, at:at + len(tile)])

    def aside(index: int) -> tuple[np.ndarray, int]:  # a helper's: into its own scratch
        tile, at, step = decoded(index)
        product = _scratch_buffer("product", tokens * step)[: tokens * len(tile)].reshape(tokens, len(tile))
        multiply(tile, step, product)
        return product, at

    def store(index: int, result: object) -> None:
        product, at = result
        out[:, at:at + product.shape[1]] = product

    parallel.race_pieces(len(tiles), aside, store, direct=straight, blas=flat is None)


class QuantizedMatrix:
    """One GGUF tensor [rows, columns] in its own block encoding.

    `data` is the tensor's bytes as uint8 [rows, bytes per row] (`GGUFFile.raw`); `ggml_type` is its
    block type, one of `ember.quant.blocks.BLOCK_TYPES` (declared in `kernels`).
    """

    def __init__(self, name: str, data: np.ndarray, ggml_type: int, shape: tuple[int, int],
                 q8: bool = False) -> None:
        self.name = name
        self.data = data.view()
        self.data.flags.writeable = False  # the mapped file's type: one compiled variant of each kernel
        self.ggml_type = int(ggml_type)
        self.shape = shape
        # every product rounds x to 8 bits first (`ember.quant.q8`, weights="quantized-q8")
        self.q8 = q8 and q8_supports([self])

    @functools.cached_property
    def _groups(self) -> list[KernelGroup]:
        """The kernels' view of this matrix, made on first use: a mixture of experts holds one matrix per
        expert (Qwen3-30B-A3B: 18,432) and a decode step uses a few. Made for all of them at load they
        took about 1 s of its 2.3 s warm load (Zen 3 EPYC, 2026-12-07)."""
        return kernel_groups([self])

    def __repr__(self) -> str:
        return f"QuantizedMatrix({self.name!r}, type {self.ggml_type}, shape {self.shape})"

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def matmul(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = x @ Wᵀ for x [T, columns]; out [T, rows] may be a column slice of a wider buffer."""
        if self.q8:
            _rounded_product(self._groups, x, out)
        elif x.shape[0] == 1:
            _matvec(self._groups, x, out)
        elif x.shape[0] < SMALL_BATCH:
            _small_batch(self._groups, x, out)
        else:
            _tiled(((self, 0),), x, out)
        return out

    def picked(self, ids: np.ndarray) -> QuantizedMatrix:
        """The matrix of rows ids[0], ids[1], … (their bytes copied), multiplied as this one is."""
        return QuantizedMatrix(self.name, self.data[ids], self.ggml_type, (len(ids), self.shape[1]),
                               q8=self.q8)

    def rows(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[i] = row ids[i], decoded (ids must be valid row numbers)."""
        kernels.dequantize_rows(self.ggml_type, self.data, ids, out, kernels.F16_TABLE, HALF)
        return out

    def dequantize(self) -> np.ndarray:
        """The whole matrix as a new float32 array."""
        out = np.empty(self.shape, np.float32)
        kernels.dequantize_tile(self.ggml_type, self.data, 0, out, kernels.F16_TABLE, HALF)
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
        self.offsets = list(itertools.accumulate((part.shape[0] for part in self.parts), initial=0))
        # decode multiplies every part in one kernel call when none of them is a float32 array
        self._quantized = all(isinstance(part, QuantizedMatrix) for part in self.parts)
        # rounded products when every part rounds x the same way (one rounding of x for the call)
        self.q8 = self._quantized and all(part.q8 for part in self.parts) and q8_supports(self.parts)

    @functools.cached_property
    def _groups(self) -> list[KernelGroup] | None:
        """The kernels' view of the stack (None with a float32 part), made on first use as a
        `QuantizedMatrix`'s."""
        return kernel_groups(self.parts) if self._quantized else None

    @property
    def nbytes(self) -> int:
        return sum(int(part.nbytes) for part in self.parts)

    def matmul(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.q8:
            return _rounded_product(self._groups, x, out)
        if x.shape[0] == 1 and self._quantized:
            return _matvec(self._groups, x, out)
        if x.shape[0] < SMALL_BATCH and self._quantized:
            return _small_batch(self._groups, x, out)
        if self._quantized:
            _tiled(tuple(zip(self.parts, self.offsets, strict=False)), x, out)
            return out
        for part, start, stop in zip(self.parts, self.offsets, self.offsets[1:], strict=False):
            linear(x, part, out[:, start:stop])
        return out



def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache) with the argument types the engine uses:
    mapped file bytes (read-only uint8), float32 activations. A first load compiles for about a minute
    on 2 cores (said once on stderr while it happens); a cached load takes a fraction of a second."""
    from ember.quant.jit import announce_compilation

    with announce_compilation():
        _warm_up()


def _warm_up() -> None:
    q8_0 = kernels.Q8_0.type_id
    matrix = QuantizedMatrix("warm-up", np.zeros((1, 34), np.uint8), q8_0, (1, 32))  # a Q8_0 block
    x = np.zeros((2, 32), np.float32)
    _matvec(matrix._groups, x, np.zeros((1, 1), np.float32))
    _small_batch(matrix._groups, x, np.zeros((2, 1), np.float32))
    tile = np.zeros((1, 32), np.float32)
    kernels.dequantize_tile(q8_0, matrix.data, 0, tile, kernels.F16_TABLE, HALF)
    kernels.dequantize_rows(q8_0, matrix.data, np.zeros(1, np.int64), tile, kernels.F16_TABLE, HALF)
    transposed = np.zeros((32, 16), np.float32)
    kernels.transpose_tokens(x, transposed)
    kernels.transpose_tokens(np.zeros((2, 64), np.float32)[:, :32], transposed)  # x a column slice
    kernels.tile_product(tile, transposed, 2, np.zeros(16, np.float32), np.zeros(2, np.float32), 0, 1)
    from ember import ops
    from ember.quant import token_ops, waiting

    token_ops.warm_up()
    ops.use_token_ops(token_ops)
    waiting.warm_up()
    parallel.use_waiting(waiting.wait_for_change)
